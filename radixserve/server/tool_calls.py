"""Tool calling in Qwen2/2.5's format: the chat template renders `tools`, the model answers with
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, and those are parsed into the
OpenAI `tool_calls` of the reply. `tool_choice: required` and a named function are enforced by a
grammar (an EBNF of such blocks whose JSON follows the tools' parameter schemas), so the arguments
of a forced call always parse; `auto` lets the model choose and parses what it wrote: a block
is a call only when it names a declared tool and its arguments are a JSON object, else it stays
text in `content`.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Collection, Optional

from radixserve.chat_formats import BUILTIN_CHAT_TEMPLATES
from radixserve.grammar.spec import build_grammar

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_END), re.DOTALL)


def load_chat_template(tokenizer, path: str) -> None:
    """Serve the Jinja template in `path` (or a built-in one by name) instead of the tokenizer's own."""
    if tokenizer is None:
        raise ValueError("--chat-template needs a tokenizer")
    if path in BUILTIN_CHAT_TEMPLATES and not os.path.exists(path):
        tokenizer.chat_template = BUILTIN_CHAT_TEMPLATES[path]
        return
    with open(path, encoding="utf-8") as f:
        tokenizer.chat_template = f.read()


@dataclass
class ToolPolicy:
    """What a chat request asks of tools: those offered, whether the model must call one, which."""

    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool objects, for the template
    mode: str = "none"  # none | auto | required | named
    name: Optional[str] = None  # the function a named choice forces
    parallel: bool = True

    @property
    def parses(self) -> bool:
        return self.mode != "none" and bool(self.tools)

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    def function(self, name: str) -> Optional[dict[str, Any]]:
        return next((t["function"] for t in self.tools if t["function"]["name"] == name), None)


# Keywords whose values are data, not schemas: a "$ref" key inside them is no reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _has_local_ref(node: Any) -> bool:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            return True
        return any(_has_local_ref(v) for k, v in node.items() if k not in _DATA_KEYWORDS)
    if isinstance(node, list):
        return any(_has_local_ref(v) for v in node)
    return False


def _relocated(node: Any, base: str) -> Any:
    """`node` with every local reference ("#", "#/$defs/X", "#/properties/a", ...) rewritten to
    point at the same place under `base`, where the schema will live."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                out[key] = base + value[1:]
            elif key in _DATA_KEYWORDS:
                out[key] = value
            else:
                out[key] = _relocated(value, base)
        return out
    if isinstance(node, list):
        return [_relocated(v, base) for v in node]
    return node


# Keywords beside which a schema's other keywords are not read: "type" is not added next to them.
_COMBINING = frozenset({"$ref", "anyOf", "oneOf", "allOf", "enum", "const"})


def _call_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON Schema of one call: {"name": <a function>, "arguments": <its parameters>}.

    The parameters become a subschema of the call, so their local references ("#/$defs/Address"
    of a nested pydantic model) would no longer resolve: a schema that has any is moved whole to
    the call's `$defs` under the function's name and its references are rewritten to match."""
    defs: dict[str, Any] = {}
    variants = []
    for f in functions:
        parameters = f.get("parameters") or {"type": "object"}
        if "type" not in parameters and not _COMBINING.intersection(parameters):
            parameters = {"type": "object", **parameters}  # {"properties": ...} alone would allow any value
        if _has_local_ref(parameters):
            key = f"tool_{f['name']}"  # names match ^[a-zA-Z0-9_-]{1,64}$: no JSON-pointer escapes
            defs[key] = _relocated(parameters, f"#/$defs/{key}")
            parameters = {"$ref": f"#/$defs/{key}"}
        variants.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": parameters},
                         "required": ["name", "arguments"], "additionalProperties": False})
    schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
    if defs:
        schema = {**schema, "$defs": defs}
    return schema


def tool_call_grammar(policy: ToolPolicy) -> str:
    """The EBNF of a forced reply: one `<tool_call>` block (or several, one per line, when parallel
    calls are allowed) whose JSON is a call of an allowed function with schema-valid arguments.
    ValueError when a parameters schema is not a usable JSON Schema."""
    import xgrammar

    functions = [policy.function(policy.name)] if policy.mode == "named" else [t["function"] for t in policy.tools]
    call_json = build_grammar("json_schema", json.dumps(_call_schema(functions)))
    block = xgrammar.Grammar.concat(xgrammar.Grammar.from_ebnf(f'root ::= "{TOOL_CALL_START}\\n"'), call_json,
                                    xgrammar.Grammar.from_ebnf(f'root ::= "\\n{TOOL_CALL_END}"'))
    text = str(block)
    if not policy.parallel:
        return text
    # concat names its parts root_1, root_2, ...: `root` itself is referenced by no other rule.
    assert text.startswith("root ::= ")
    return 'root ::= tool_call_block ("\\n" tool_call_block)*\ntool_call_block ::= ' + text[len("root ::= "):]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str, parallel: bool = True, *, names: Optional[Collection[str]] = None,
                     forced: bool = False, cut_off: bool = False) -> tuple[Optional[str], list[dict[str, Any]]]:
    """The reply's text outside tool-call blocks (None when empty) and its calls as OpenAI
    `tool_calls` entries. A block that is not a call of one of `names` (the declared tools; None:
    any name) with a JSON object for arguments stays in the text.

    forced: the grammar allowed only call blocks, so text outside them is the start of a block
    that `max_tokens` or a stop string cut off: no content at all. cut_off (finish reason
    length): an unclosed block at the end is a call when its JSON was complete (only the closing
    tag, or the brace after the arguments, was cut off: see `_cut_off_call`), else an unfinished
    call, dropped rather than shown as template markup."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        call = _call_of(match.group(1), names)
        if call is None or (calls and not parallel):
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(call)
    found = _cut_off_call(text, last, names) if cut_off and (parallel or not calls) else None
    if found is not None:
        kept.append(text[last:found[0]])
        last = len(text)
        calls.append(found[1])
    kept.append(text[last:])
    content = _shown_text("".join(kept), forced, cut_off)
    return (content or None), calls


def _cut_off_call(text: str, start: int, names: Optional[Collection[str]]) -> Optional[tuple[int, dict[str, Any]]]:
    """(where the block starts, its call) when text[start:] ends in a block that `max_tokens` cut
    off after the call's arguments were complete JSON: the closing tag (or part of it) is missing,
    and at most the `}` that closes the call after its arguments. None otherwise: a block cut
    inside its JSON is no call a client can run. A forced call's grammar allows nothing but `}`,
    a newline and the tag after the arguments, so nothing is lost."""
    at = text.rfind(TOOL_CALL_START, start)
    if at < 0 or TOOL_CALL_END in text[at:]:
        return None
    body = text[at + len(TOOL_CALL_START):]
    body = body[:len(body) - _partial_tag_length(body, TOOL_CALL_END)].strip()
    value = _json(body)
    if value is None and body.endswith("}"):
        value = _json(body + "}")
    if not isinstance(value, dict) or not ("arguments" in value or "parameters" in value):
        return None  # {"name": "f"} alone: the arguments were never written
    call = _call_of_value(value, names)
    return None if call is None else (at, call)


def _shown_text(rest: str, forced: bool, cut_off: bool) -> str:
    """The text outside parsed blocks that the reply shows (see `parse_tool_calls`)."""
    if forced:
        return ""
    if cut_off:
        at = rest.rfind(TOOL_CALL_START)
        if at >= 0 and TOOL_CALL_END not in rest[at:]:
            rest = rest[:at]
        else:  # cut inside the opening tag itself
            rest = rest[:len(rest) - _partial_tag_length(rest)]
    return rest.strip()


def _partial_tag_length(text: str, tag: str = TOOL_CALL_START) -> int:
    """How many characters at the end of `text` may be the start of `tag`."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


def _json(text: str) -> Any:
    # Not strict: a model not held by a grammar (tool_choice auto) may write a raw control
    # character inside a string; the arguments are written back with it escaped.
    try:
        return json.loads(text, strict=False)
    except json.JSONDecodeError:
        return None


def _call_of(body: str, names: Optional[Collection[str]]) -> Optional[dict[str, Any]]:
    """The call a block's JSON makes, or None when it is no call a client can run: not a JSON
    object, a function the request did not declare, or arguments that are not a JSON object (a
    model may write them as an object or as a JSON text of one)."""
    return _call_of_value(_json(body), names)


def _call_of_value(value: Any, names: Optional[Collection[str]]) -> Optional[dict[str, Any]]:
    """`_call_of` of a block's parsed JSON."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if names is not None and value["name"] not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _json(arguments)
    if not isinstance(arguments, dict):
        return None
    arguments = json.dumps(arguments, ensure_ascii=False)  # control characters come out escaped
    return {"id": new_call_id(), "type": "function", "function": {"name": value["name"], "arguments": arguments}}


class ToolCallStream:
    """Streams a reply's plain text as it comes and holds back everything from the first
    `<tool_call>` on; each call is handed over as soon as its block closes, and `finish` returns
    the text left outside blocks (a block that does not parse stays text)."""

    def __init__(self, parallel: bool = True, forced: bool = False, names: Optional[Collection[str]] = None):
        self.parallel = parallel
        self.forced = forced
        self.names = names
        self.held = ""  # text that may be the start of a tool-call tag
        self.calls_text: Optional[str] = None  # everything from the first tag on
        self.scanned = 0  # calls_text[:scanned] is done with: calls handed over, text kept
        self.kept: list[str] = []  # text outside blocks, shown at the end
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """The text that can be shown now and the calls whose blocks closed."""
        if self.calls_text is not None:
            self.calls_text += delta
            return "", self._closed_calls()
        text = self.held + delta
        at = text.find(TOOL_CALL_START)
        if at >= 0:
            self.held, self.calls_text = "", text[at:]
            return text[:at], self._closed_calls()
        keep = _partial_tag_length(text)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], []

    def _closed_calls(self) -> list[dict[str, Any]]:
        calls = []
        for match in _BLOCK.finditer(self.calls_text, self.scanned):
            call = _call_of(match.group(1), self.names)
            if call is None or (self.num_calls and not self.parallel):
                continue  # stays in the text (shown at the end)
            self.kept.append(self.calls_text[self.scanned:match.start()])
            self.scanned = match.end()
            self.num_calls += 1
            calls.append(call)
        return calls

    def finish_calls(self, cut_off: bool = False) -> list[dict[str, Any]]:
        """At the end, before `finish`: the call of a block that `max_tokens` cut off after its
        JSON was complete (as `parse_tool_calls` finds it), or none."""
        if not cut_off or self.calls_text is None or (self.num_calls and not self.parallel):
            return []
        found = _cut_off_call(self.calls_text, self.scanned, self.names)
        if found is None:
            return []
        self.kept.append(self.calls_text[self.scanned:found[0]])
        self.scanned = len(self.calls_text)
        self.num_calls += 1
        return [found[1]]

    def finish(self, cut_off: bool = False) -> str:
        """The text still to show: what was held and what lay outside the calls (forced and
        cut_off as in `parse_tool_calls`)."""
        if self.calls_text is None:
            return "" if self.forced or cut_off else self.held
        return _shown_text("".join(self.kept + [self.calls_text[self.scanned:]]), self.forced, cut_off)


def template_tool_calls(calls: list[Any]) -> list[dict[str, Any]]:
    """An assistant message's tool calls for the chat template, arguments as a JSON value and
    never as raw text: Qwen2.5's template writes a non-string with `tojson` but pastes a string as
    it is, so arguments that are not JSON (`1}\n</tool_call>`) would close the call block. Arguments
    that parse are handed over parsed (a JSON string among them as its quoted JSON text), anything
    else as the quoted JSON text of the string the client sent; blank arguments are a call without
    any (`{}`)."""
    out = []
    for call in calls:
        text = call.function.arguments
        arguments: Any = {} if not text.strip() else _json(text)
        if arguments is None and text.strip() != "null":  # not JSON at all
            arguments = json.dumps(text, ensure_ascii=False)
        elif isinstance(arguments, str):  # a JSON string value: the template would paste it unquoted
            arguments = json.dumps(arguments, ensure_ascii=False)
        out.append({"id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments}})
    return out


def tool_policy(body: Any) -> ToolPolicy:
    """A chat request's tools and tool_choice, checked (APIError 400 naming the field)."""
    from radixserve.server.errors import CONFLICTING_FIELDS, bad_request
    from radixserve.server.structured import response_format_constrains

    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", "tools")
    for i, tool in enumerate(tools):
        _check_parameters(tool["function"].get("parameters"), f"tools[{i}].function.parameters")
    choice = body.tool_choice
    policy = ToolPolicy(tools=tools, parallel=getattr(body, "parallel_tool_calls", None) is not False)
    if choice is None:
        policy.mode = "auto" if tools else "none"
    elif isinstance(choice, str):
        policy.mode = choice
    else:
        policy.mode, policy.name = "named", choice.function.name
    if policy.mode in ("required", "named") and not tools:
        raise bad_request(f"tool_choice {policy.mode!r} needs tools", "tool_choice", code=CONFLICTING_FIELDS)
    if policy.mode == "named" and policy.name not in names:
        raise bad_request(f"tool_choice names {policy.name!r}, which is not one of the tools", "tool_choice",
                          code=CONFLICTING_FIELDS)
    if policy.forced and response_format_constrains(getattr(body, "response_format", None)):
        raise bad_request("response_format cannot constrain a reply that tool_choice forces to be a tool call",
                          "response_format", code=CONFLICTING_FIELDS)
    if policy.forced:
        policy.parallel = policy.parallel and policy.mode == "required"
    return policy


def _check_parameters(parameters: Optional[dict[str, Any]], param: str) -> None:
    """400 unless `parameters` is a JSON Schema of an object (OpenAI's rule), whatever tool_choice
    says: the template shows it to the model under auto too, and a call's arguments are an object
    (a forced call under `{"type": "string"}` would write a string, which is no call)."""
    from radixserve.server.errors import bad_request

    if not parameters:  # omitted or {}: any object
        return
    if parameters.get("type", "object") != "object":
        raise bad_request(f"{param} must be a JSON Schema of type object, got type {parameters['type']!r}", param)
    properties = parameters.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(v, (dict, bool)) for v in properties.values()):
        raise bad_request(f"{param}.properties must map each argument name to a JSON Schema", param)
    required = parameters.get("required", [])
    if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
        raise bad_request(f"{param}.required must be a list of argument names", param)


def forced_call_grammar(policy: ToolPolicy) -> Optional[tuple[str, str]]:
    """The (kind, text) grammar of a forced tool call, or None; 400 for unusable parameter schemas."""
    if not policy.forced:
        return None
    from radixserve.server.errors import bad_request

    try:
        return "ebnf", tool_call_grammar(policy)
    except ValueError as e:
        raise bad_request(f"a tool's parameters are not a usable JSON Schema: {e}", "tools",
                          code="invalid_grammar") from None
