"""Rendering the served chat template within bounds of time and size.

Only the operator's template runs (a request may set only the variables it reads), but those
variables, the messages and the tools are the client's: a template whose loops or repetitions
grow with them could hold a tokenizer thread or the API's memory for as long as the client
likes. So the template renders as transformers renders it (its sandboxed environment, filters
and globals, the tokenizer's special tokens as variables) but piece by piece: the text stops at
`max_chars` (the longest prompt the context could take) and the render at `timeout_s`, checked
at every piece of output and every call the template makes (`range` included, so nested loops
that write nothing are bounded too). Either limit is a `TemplateLimitError`, a 400.
"""

from __future__ import annotations

import threading
import time
from functools import lru_cache
from typing import Any, Optional

TEMPLATE_LIMIT = "template_limit"


class TemplateLimitError(ValueError):
    """The chat template went past a bound while rendering this request."""


_deadline = threading.local()


def _check_deadline() -> None:
    limit: Optional[float] = getattr(_deadline, "at", None)
    if limit is not None and time.monotonic() > limit:
        raise TemplateLimitError(f"the chat template took longer than {_deadline.timeout_s:g} s to render this "
                                 "request")


@lru_cache(maxsize=16)
def _bounded_template(template: str):
    """`template` compiled in an overlay of transformers' own chat-template environment whose
    calls check the render's deadline first."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    environment = _compile_jinja_template(template).environment.overlay()
    call = environment.call  # the sandbox's own check of what may be called

    def checked_call(context, obj, *args, **kwargs):
        _check_deadline()
        return call(context, obj, *args, **kwargs)

    environment.call = checked_call
    return environment.from_string(template)


def render_chat_template(tokenizer, messages: list[dict[str, Any]], *, tools: Optional[list[dict[str, Any]]],
                         add_generation_prompt: bool, variables: dict[str, Any], max_chars: int,
                         timeout_s: float) -> str:
    """The tokenizer's chat template over `messages` (plain dicts) as text; TemplateLimitError past
    `max_chars` characters or `timeout_s` seconds, the template's own errors as they are."""
    template = _bounded_template(tokenizer.get_chat_template(None, tools))
    context = {**(tokenizer.special_tokens_map or {}), **variables}  # as apply_chat_template: kwargs win
    _deadline.at, _deadline.timeout_s = time.monotonic() + timeout_s, timeout_s
    pieces, size = [], 0
    try:
        for piece in template.generate(messages=messages, tools=tools, documents=None,
                                       add_generation_prompt=add_generation_prompt, **context):
            size += len(piece)
            if size > max_chars:
                raise TemplateLimitError(f"the chat template rendered more than {max_chars} characters for this "
                                         "request, more than any prompt the context can take")
            _check_deadline()
            pieces.append(piece)
    finally:
        _deadline.at = None
    return "".join(pieces)
