"""A chat request as prompt tokens: the conversation rendered by the served chat template.

- **Only the operator's template runs.** `chat_template_kwargs` may set the variables the
  template reads (jinja2's `meta.find_undeclared_variables` of its source) and nothing else: a
  `chat_template` key (a client's own Jinja, which would run in the API process), the arguments
  of `apply_chat_template` (`tokenize`, ...), the variables the server sets (`messages`, `tools`,
  `add_generation_prompt`, the special tokens) and names the template does not read are 400s
  naming the key. Rendering is then the operator's template over the request, whose size the
  body limit bounds, and a rendered prompt longer than any the context can take is refused
  before it is tokenized.
"""

from __future__ import annotations

import inspect
from functools import lru_cache, partial
from typing import Any, Optional

from radixserve.server.errors import APIError, bad_request
from radixserve.server.protocol import ROLES
from radixserve.server.serving import ServingContext
from radixserve.server.tool_calls import ToolPolicy, template_tool_calls

# Variables the server gives the template itself (beyond apply_chat_template's arguments and the
# tokenizer's special tokens), or that transformers provides as globals.
SERVER_TEMPLATE_VARIABLES = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                       "raise_exception", "strftime_now"})


def _message_text(i: int, content) -> str:
    """A message's content as one text: only text parts are served."""
    if not isinstance(content, list):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise APIError(400, f"messages[{i}].content[{j}]: only text parts are supported, got "
                                f"{part.type!r}", param=f"messages[{i}].content", code="unsupported_parameter")
        if part.model_extra:
            raise APIError(400, f"messages[{i}].content[{j}]: a text part has only type and text, got "
                                f"{', '.join(sorted(part.model_extra))}", param=f"messages[{i}].content",
                           code="unsupported_parameter")
        parts.append(part.text)
    return "\n".join(parts)


def template_messages(body) -> list[dict[str, Any]]:
    """The conversation as the chat template reads it, tool calls and tool results included."""
    messages = []
    for i, msg in enumerate(body.messages):
        if msg.role not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {msg.role!r}",
                              f"messages[{i}].role")
        if msg.tool_calls is not None and msg.role != "assistant":
            raise bad_request(f"messages[{i}]: only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
        if (msg.tool_call_id is not None) != (msg.role == "tool"):
            raise bad_request(f"messages[{i}]: a tool message needs tool_call_id, and only a tool message has one",
                              f"messages[{i}].tool_call_id")
        message: dict[str, Any] = {"role": msg.role, "content": _message_text(i, msg.content)}
        if msg.tool_calls:
            message["tool_calls"] = template_tool_calls(msg.tool_calls)
        if msg.tool_call_id is not None:
            message["tool_call_id"] = msg.tool_call_id
        if msg.name is not None and msg.role == "tool":
            message["name"] = msg.name
        messages.append(message)
    return messages


# ----------------------------------------------------------------------------- template variables
@lru_cache(maxsize=16)
def template_variables(template: str) -> Optional[frozenset[str]]:
    """The variables `template` reads from outside (None when it cannot be parsed here)."""
    from jinja2 import meta

    try:  # transformers' own environment knows its extensions ({% generation %}, loop controls)
        from transformers.utils.chat_template_utils import _compile_jinja_template
        environment = _compile_jinja_template(template).environment
    except Exception:  # noqa: BLE001: an older transformers; jinja2 with loop controls reads most
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        environment = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return frozenset(meta.find_undeclared_variables(environment.parse(template)))
    except Exception:  # noqa: BLE001: a template this jinja2 cannot parse: no variable is settable
        return None


@lru_cache(maxsize=1)
def _apply_chat_template_arguments() -> frozenset[str]:
    from transformers import PreTrainedTokenizerBase

    return frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"self", "kwargs"}


def _templates(tokenizer) -> list[str]:
    template = tokenizer.chat_template
    return list(template.values()) if isinstance(template, dict) else [template]


def checked_template_kwargs(tokenizer, kwargs: Optional[dict[str, Any]]) -> dict[str, Any]:
    """`chat_template_kwargs`, each key a variable the served template reads and the server does
    not set; 400 naming the first key that is not."""
    if not kwargs:
        return {}
    reserved = SERVER_TEMPLATE_VARIABLES | _apply_chat_template_arguments() | set(
        getattr(tokenizer, "special_tokens_map", None) or {})
    readable: set[str] = set()
    for template in _templates(tokenizer):
        names = template_variables(template)
        readable |= names or set()
    settable = readable - reserved
    for key in kwargs:
        param = f"chat_template_kwargs.{key}"
        if key == "chat_template":
            raise APIError(400, "chat_template_kwargs.chat_template is not allowed: the server renders only its "
                                "own chat template (--chat-template)", param=param, code="unsupported_parameter")
        if key in reserved:
            raise APIError(400, f"chat_template_kwargs.{key} is set by the server, not by a request", param=param,
                           code="unsupported_parameter")
        if key not in settable:
            reads = ", ".join(sorted(settable)) or "none"
            raise APIError(400, f"the chat template does not read {key!r} (the variables a request may set: "
                                f"{reads})", param=param, code="unsupported_parameter")
    return dict(kwargs)


# ----------------------------------------------------------------------------- the prompt
async def chat_prompt_ids(ctx: ServingContext, body, policy: Optional[ToolPolicy] = None,
                          add_special_tokens: bool = False) -> list[int]:
    """The conversation rendered by the tokenizer's chat template (with the tools the policy
    shows) as token ids; add_special_tokens: with the tokenizer's own additions around it (a BOS,
    for tokenizers with one; /v1/tokenize's option)."""
    tok = ctx.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise bad_request("the served model has no chat template; use /v1/completions", "messages")
    kwargs = checked_template_kwargs(tok, getattr(body, "chat_template_kwargs", None))
    if policy is not None and policy.parses:  # with tool_choice none the model is not shown the tools
        kwargs["tools"] = policy.tools
    messages = template_messages(body)
    try:
        text = await ctx.run_blocking(partial(tok.apply_chat_template, messages, tokenize=False,
                                              add_generation_prompt=body.add_generation_prompt, **kwargs))
    except Exception as e:  # a template that rejects this conversation (raise_exception, ...)
        raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None
    ids = await ctx.tokenize(text, "messages")
    if add_special_tokens:
        ids = await ctx.run_blocking(_with_added_special_tokens, tok, text, ids)
    return ids


def _with_added_special_tokens(tokenizer, text: str, ids: list[int]) -> list[int]:
    """`ids` with what the tokenizer adds around `text` when asked to (a BOS, an EOS)."""
    plain = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.encode(text, add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start] + ids + full[start + len(plain):]
    return ids
