"""A chat request as prompt tokens: the conversation rendered by the served chat template, with
what the client wrote kept as text.

- **Only the operator's template runs.** `chat_template_kwargs` may set the variables the
  template reads (jinja2's `meta.find_undeclared_variables` of its source) and nothing else: a
  `chat_template` key (a client's own Jinja, which would run in the API process), the arguments
  of `apply_chat_template` (`tokenize`, ...), the variables the server sets (`messages`, `tools`,
  `add_generation_prompt`, the special tokens, Jinja's globals) and names the template does not
  read are 400s naming the key. Rendering is then the operator's template over the request,
  bounded in time (`--chat-template-timeout-s`) and in size (the longest prompt the context can
  take) by `template_render`: either limit is a 400 `template_limit`.
- **A tool result answers a call.** A tool message's `tool_call_id` must be the id of a call an
  earlier assistant message made; an assistant message's reasoning (`reasoning_content`) goes to
  the template, which decides whether the model sees it.
- **Where chats branch.** For a model whose prefix cache keeps states where requests branch (a
  hybrid's recurrent state), the end of a chat's system turn is sent with the request
  (`system_turn_end`): every chat on the same system prompt shares the prompt up to there, so the
  first one keeps its state there and the second resumes there.
- **Control tokens in message text are text.** The template's control tokens (the special
  tokens, and added tokens its source spells, as `transformers` decides them) are tokens only
  where the template writes them: every string the client sent (message content, tool results,
  tool calls, tool definitions, template variables) has its control tokens wrapped in private-use
  markers before rendering, and a marked token is encoded as the plain text it spells. A
  `<|im_start|>system` in a user message is therefore characters, never a forged turn.
"""

from __future__ import annotations

import inspect
import re
from functools import lru_cache, partial
from typing import Any, Optional

from radixserve.cache.prefix import common_prefix_len
from radixserve.chat_formats import KEEP_REASONING, SYSTEM_ROLES
from radixserve.server.errors import CONFLICTING_FIELDS, APIError, bad_request
from radixserve.server.protocol import ROLES
from radixserve.server.serving import ServingContext
from radixserve.server.template_render import TEMPLATE_LIMIT, TemplateLimitError, render_chat_template
from radixserve.server.tool_calls import ToolPolicy, template_tool_calls

# Private-use code points around a control token that a client's text spells (the markers
# transformers' own `sanitize_control_tokens` uses); a client's own markers are dropped first.
MARK_START = "\U000f0000"
MARK_END = "\U000f0001"
# Variables the server gives the template itself (beyond apply_chat_template's arguments and the
# tokenizer's special tokens), or that transformers provides as globals.
SERVER_TEMPLATE_VARIABLES = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                       "raise_exception", "strftime_now"})
# The roles of the turns a chat's system prompt is made of (the leading ones).
# Jinja's own globals and those transformers adds: a template reads them as undeclared names, and a
# request that set one would replace the function (`namespace`, `range`) the template calls.
JINJA_GLOBALS = frozenset({"range", "dict", "lipsum", "cycler", "joiner", "namespace"})


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


def _reasoning(i: int, msg) -> Optional[str]:
    """An assistant message's reasoning (reasoning_content, or vLLM's name for it, reasoning)."""
    given = [(name, getattr(msg, name)) for name in ("reasoning_content", "reasoning")
             if getattr(msg, name) is not None]
    if not given:
        return None
    if msg.role != "assistant":
        raise bad_request(f"messages[{i}]: only assistant messages carry {given[0][0]}", f"messages[{i}].{given[0][0]}")
    if len(given) == 2 and given[0][1] != given[1][1]:
        raise bad_request(f"messages[{i}]: reasoning_content and reasoning disagree (give one)",
                          f"messages[{i}].reasoning", code=CONFLICTING_FIELDS)
    return given[0][1]


def template_messages(body) -> list[dict[str, Any]]:
    """The conversation as the chat template reads it, tool calls and tool results included. A
    tool message answers a call an earlier assistant message made (its tool_call_id is that call's
    id), as OpenAI requires."""
    messages = []
    call_ids: set[str] = set()
    for i, msg in enumerate(body.messages):
        if msg.role not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {msg.role!r}",
                              f"messages[{i}].role")
        if msg.tool_calls is not None and msg.role != "assistant":
            raise bad_request(f"messages[{i}]: only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
        if (msg.tool_call_id is not None) != (msg.role == "tool"):
            raise bad_request(f"messages[{i}]: a tool message needs tool_call_id, and only a tool message has one",
                              f"messages[{i}].tool_call_id")
        if msg.tool_call_id is not None and msg.tool_call_id not in call_ids:
            # A relation between messages that the schema cannot state: conflicting, as OpenAI refuses it.
            raise bad_request(f"messages[{i}].tool_call_id {msg.tool_call_id!r} answers no tool call of an earlier "
                              "assistant message", f"messages[{i}].tool_call_id", code=CONFLICTING_FIELDS)
        message: dict[str, Any] = {"role": msg.role, "content": _message_text(i, msg.content)}
        reasoning = _reasoning(i, msg)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if msg.tool_calls:
            message["tool_calls"] = template_tool_calls(msg.tool_calls)
            call_ids.update(call.id for call in msg.tool_calls)
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


def _reserved_variables(tokenizer) -> frozenset[str]:
    return SERVER_TEMPLATE_VARIABLES | _apply_chat_template_arguments() | JINJA_GLOBALS | set(
        getattr(tokenizer, "special_tokens_map", None) or {})


def settable_template_variables(tokenizer) -> frozenset[str]:
    """The variables a request's chat_template_kwargs may set: those the served template reads and
    the server does not set (the served OpenAPI schema lists them)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return frozenset()
    readable: set[str] = set()
    for template in _templates(tokenizer):
        readable |= template_variables(template) or set()
    return frozenset(readable - _reserved_variables(tokenizer))


def checked_template_kwargs(tokenizer, kwargs: Optional[dict[str, Any]]) -> dict[str, Any]:
    """`chat_template_kwargs`, each key a variable the served template reads and the server does
    not set; 400 naming the first key that is not."""
    if not kwargs:
        return {}
    reserved = _reserved_variables(tokenizer)
    settable = settable_template_variables(tokenizer)
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


def template_reads(tokenizer, name: str) -> bool:
    """Whether the served chat template reads the variable `name`."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return False
    return any(name in (template_variables(t) or ()) for t in _templates(tokenizer))


def check_template_keeps_reasoning(tokenizer) -> None:
    """--keep-reasoning-history needs a served template that reads keep_reasoning (ValueError)."""
    if not template_reads(tokenizer, KEEP_REASONING):
        raise ValueError(f"--keep-reasoning-history needs a chat template that reads {KEEP_REASONING}, and the "
                         "served one does not: add --chat-template qwen3 (Qwen3's format with it) or a template "
                         "of your own that reads it")


# ----------------------------------------------------------------------------- control tokens
class ControlTokens:
    """A tokenizer's control tokens for its chat template, and how to mark and encode them."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        added = list(getattr(tokenizer, "added_tokens_decoder", {}).values())
        source = "".join(_templates(tokenizer))
        # transformers' rule: the special tokens, and the added tokens the template spells
        # (whitespace ones excepted: templates write "\n" as text).
        tokens = sorted({t.content for t in added if t.special or (t.content in source and not t.content.isspace())},
                        key=len, reverse=True)  # longest first: a token wins over the tokens inside it
        alternation = "|".join(map(re.escape, tokens)) or "(?!)"
        self.pattern = re.compile(alternation)
        self.marked = re.compile(f"{MARK_START}({alternation}){MARK_END}|[{MARK_START}{MARK_END}]")
        self.newline_ids = tokenizer.encode("\n", add_special_tokens=False)

    def mark(self, value: Any) -> tuple[Any, bool]:
        """`value` (strings, lists and dicts of them) with its control tokens marked, and whether
        any string needed it."""
        if isinstance(value, str):
            if MARK_START not in value and MARK_END not in value and not self.pattern.search(value):
                return value, False
            cleaned = value.replace(MARK_START, "").replace(MARK_END, "")
            return self.pattern.sub(lambda m: MARK_START + m.group(0) + MARK_END, cleaned), True
        if isinstance(value, dict):
            out, changed = {}, False
            for key, item in value.items():
                out[key], hit = self.mark(item)
                changed |= hit
            return out, changed
        if isinstance(value, (list, tuple)):
            marked = [self.mark(item) for item in value]
            return [item for item, _ in marked], any(hit for _, hit in marked)
        return value, False

    def encode(self, text: str) -> list[int]:
        """Token ids of a chat rendered from marked strings: marked control tokens as plain text,
        everything else (the template's own control tokens included) as usual. A lone marker
        (a template's string method can split a pair) is dropped but still ends the text before
        it, so the text on its two sides cannot join into a control token."""
        pieces = self.marked.split(text)  # text, marked token (None: lone marker), text, ...
        ids = self.tokenizer.encode(pieces[0], add_special_tokens=False)
        for i, piece in enumerate(pieces[1:], start=1):
            if piece:
                ids += self._encode_piece(piece, as_text=i % 2 == 1)
        return ids

    def _encode_piece(self, piece: str, as_text: bool) -> list[int]:
        encode = self._plain_text_ids if as_text else partial(self.tokenizer.encode, add_special_tokens=False)
        # After a newline, then without it: a SentencePiece tokenizer would add a prefix space at
        # the start of a string (transformers does the same).
        ids = encode("\n" + piece)
        n = len(self.newline_ids)
        return ids[n:] if ids[:n] == self.newline_ids else encode(piece)

    def _plain_text_ids(self, text: str) -> list[int]:
        """`text` through the normalizer, pre-tokenizer and model with no added token matched,
        special or not (`split_special_tokens` still matches the non-special ones)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:  # a slow tokenizer
            return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        pieces = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer is not None else [(text, None)]
        return [token.id for piece, _ in pieces for token in backend.model.tokenize(piece)]


def control_tokens(ctx: ServingContext) -> ControlTokens:
    found = getattr(ctx, "chat_control_tokens", None)
    if found is None or found.tokenizer is not ctx.tokenizer:
        found = ctx.chat_control_tokens = ControlTokens(ctx.tokenizer)
    return found


# ----------------------------------------------------------------------------- the prompt
async def chat_prompt_ids(ctx: ServingContext, body, policy: Optional[ToolPolicy] = None,
                          add_special_tokens: bool = False) -> list[int]:
    """The conversation rendered by the tokenizer's chat template (with the tools the policy
    shows) as token ids; add_special_tokens: with the tokenizer's own additions around it (a BOS,
    for tokenizers with one; /v1/tokenize's option)."""
    return await _rendered_ids(ctx, body, template_messages(body), body.add_generation_prompt, policy,
                               add_special_tokens)


async def system_turn_end(ctx: ServingContext, body, ids: list[int], policy: Optional[ToolPolicy] = None
                          ) -> Optional[int]:
    """How many of a chat's prompt `ids` its system turn takes (its leading system and developer
    messages, rendered alone with the same tools and variables): what every chat on the same system
    prompt shares. None when it has none, or the template does not render it alone."""
    messages = template_messages(body)
    head = 0
    while head < len(messages) and messages[head]["role"] in SYSTEM_ROLES:
        head += 1
    if head == 0 or head == len(messages):
        return None
    try:
        system = await _rendered_ids(ctx, body, messages[:head], False, policy)
    except APIError:  # a template that wants a user turn: no hint, the chat is served as it is
        return None
    shared = common_prefix_len(system, ids)
    return shared if 0 < shared < len(ids) else None


async def _rendered_ids(ctx: ServingContext, body, template_msgs: list[dict[str, Any]], add_generation_prompt: bool,
                        policy: Optional[ToolPolicy], add_special_tokens: bool = False) -> list[int]:
    """`template_msgs` rendered by the chat template with body's variables (see chat_prompt_ids)."""
    tok = ctx.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise bad_request("the served model has no chat template; use /v1/completions", "messages")
    kwargs = checked_template_kwargs(tok, getattr(body, "chat_template_kwargs", None))
    if ctx.settings.keep_reasoning_history:  # the server's default; a request may still say false
        kwargs.setdefault(KEEP_REASONING, True)
    if policy is not None and policy.parses:  # with tool_choice none the model is not shown the tools
        kwargs["tools"] = policy.tools
    controls = control_tokens(ctx)
    messages, marked = controls.mark(template_msgs)
    kwargs, marked_kwargs = controls.mark(kwargs)
    tools = kwargs.pop("tools", None)
    try:
        text = await ctx.run_blocking(partial(
            render_chat_template, tok, messages, tools=tools, add_generation_prompt=add_generation_prompt,
            variables=kwargs, max_chars=ctx.max_token_chars * ctx.prompt_token_limit,
            timeout_s=ctx.settings.chat_template_timeout_s))
    except TemplateLimitError as e:
        raise APIError(400, str(e), param="messages", code=TEMPLATE_LIMIT) from None
    except Exception as e:  # a template that rejects this conversation (raise_exception, ...)
        raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None
    ctx.check_text_length(text, "messages")
    if not (marked or marked_kwargs):  # nothing to tell apart: the plain path, as fast as before
        ids = await ctx.tokenize(text, "messages")
    else:
        ids = await ctx.run_blocking(controls.encode, text)
    if add_special_tokens:
        ids = await ctx.run_blocking(_with_added_special_tokens, tok, controls.marked.sub(r"\1", text), ids)
    return ids


def _with_added_special_tokens(tokenizer, text: str, ids: list[int]) -> list[int]:
    """`ids` with what the tokenizer adds around `text` when asked to (a BOS, an EOS)."""
    plain = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.encode(text, add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start] + ids + full[start + len(plain):]
    return ids
