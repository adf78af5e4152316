"""Tool calls through the real openai SDK against a server over the tiny random model (Qwen2.5's
<tool_call> format, rendered by the model's chat template): forced calls (`required`, a named
function) always parse and follow the parameters schema; a two-turn round trip sends the calls and
their results back through the template."""

from __future__ import annotations

import json

from typing import Literal, Optional

import httpx
import jsonschema
import openai
import pydantic
import pytest

from radixserve.server.tool_calls import ToolCallStream, ToolPolicy, parse_tool_calls, tool_call_grammar

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
               "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
MAX_TOKENS = 200


def served_model(server) -> str:
    return httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"]


def ask(client, model, messages, stream: bool, max_tokens: int = MAX_TOKENS, tools=TOOLS, **kwargs):
    """(message dict, finish_reason) of one reply, streamed or not, as the SDK hands it over."""
    args = dict(model=model, messages=messages, tools=tools, max_tokens=max_tokens, temperature=1.0, seed=7,
                **kwargs)
    if not stream:
        reply = client.chat.completions.create(**args)
        choice = reply.choices[0]
        calls = [c.model_dump() for c in choice.message.tool_calls or []]
        return {"content": choice.message.content, "tool_calls": calls}, choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **args):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
            entry["id"] = call.id or entry["id"]
            entry["function"]["name"] += call.function.name or ""
            entry["function"]["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}, finish


def check_calls(calls, allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["id"] and call["type"] == "function"
        name = call["function"]["name"]
        assert name in allowed
        jsonschema.validate(json.loads(call["function"]["arguments"], strict=False), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named", "auto"])
def test_tool_round_trip(server, choice, stream):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    model = served_model(server)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else choice
    message, finish = ask(client, model, messages, stream, tool_choice=tool_choice, parallel_tool_calls=False)
    if choice == "auto" and not message["tool_calls"]:
        # A random model rarely writes a tool call of its own accord: a plain reply is well-formed too.
        assert finish in ("stop", "length") and isinstance(message["content"], str)
        message["tool_calls"] = [{"id": "call_manual", "type": "function",
                                  "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]
    else:
        assert finish == "tool_calls", message
        check_calls(message["tool_calls"], {"get_weather"} if choice == "named" else set(SCHEMAS))
        assert len(message["tool_calls"]) == 1  # parallel_tool_calls=False
    # Second turn: the calls and their results go back through the chat template.
    messages.append({"role": "assistant", "content": message["content"], "tool_calls": message["tool_calls"]})
    for call in message["tool_calls"]:
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 degrees"})
    message, finish = ask(client, model, messages, stream, tool_choice=tool_choice, parallel_tool_calls=False)
    if choice == "auto":
        assert finish in ("stop", "length", "tool_calls")
    else:
        assert finish == "tool_calls"
        check_calls(message["tool_calls"], {"get_weather"} if choice == "named" else set(SCHEMAS))


def test_tool_choice_none_and_errors(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    model = served_model(server)
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                           tool_choice="none", max_tokens=8, temperature=0.0)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason in ("stop", "length")
    bad = [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
              tool_choice="required"), "tools[0].function.parameters"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    ]
    for kwargs, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                           **kwargs)
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:  # a tool message must say which call it answers
        client.chat.completions.create(model=model, messages=[{"role": "tool", "content": "x"}], max_tokens=4)
    assert "tool_call_id" in e.value.body["param"]


def test_parse_tool_calls():
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"a": 1}),
                                                                                                ("g", {})]
    assert len(parse_tool_calls(text, parallel=False)[1]) == 1
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    stream = ToolCallStream()
    fed = [stream.feed(piece) for piece in ["Let me", " check.<tool", "_call>\n{\"name\": \"f\", ",
                                            "\"arguments\": {}}\n</tool_call>", "\n<tool_call>\nnot json",
                                            "</tool_call>"]]
    assert [shown for shown, _ in fed] == ["Let me", " check.", "", "", "", ""]
    assert [len(calls) for _, calls in fed] == [0, 0, 0, 1, 0, 0]  # a call is handed over as its block closes
    assert fed[3][1][0]["function"] == {"name": "f", "arguments": "{}"}
    assert stream.finish() == "<tool_call>\nnot json</tool_call>" and stream.num_calls == 1


class Address(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]
    floor: int = pydantic.Field(ge=0, le=20)


class Person(pydantic.BaseModel):
    """Nested models: the parameters schema refers to Address through "#/$defs/Address"."""
    address: Address
    previous: Optional[Address]


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_call_of_a_nested_pydantic_model(server, choice):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    tool = openai.pydantic_function_tool(Person)
    assert "$defs" in tool["function"]["parameters"]
    tool_choice = {"type": "function", "function": {"name": "Person"}} if choice == "named" else "required"
    reply = client.chat.completions.create(model=served_model(server), messages=[{"role": "user", "content": "hi"}],
                                           tools=[tool], tool_choice=tool_choice, parallel_tool_calls=False,
                                           max_tokens=MAX_TOKENS, temperature=1.0, seed=3)
    choice_ = reply.choices[0]
    assert choice_.finish_reason == "tool_calls", choice_
    (call,) = choice_.message.tool_calls
    assert call.function.name == "Person"
    Person.model_validate_json(call.function.arguments)  # references resolved: the nested model validates


def test_call_grammar_resolves_references_of_each_tool():
    tree = {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
            "required": ["children"]}
    nested = openai.pydantic_function_tool(Person)["function"]
    policy = ToolPolicy(tools=[{"type": "function", "function": {"name": "tree", "parameters": tree}},
                               {"type": "function", "function": nested}], mode="required")
    grammar = tool_call_grammar(policy)  # a reference that does not resolve is a ValueError
    assert "tool_tree" in grammar and "tool_Person" in grammar


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_tokens", [3, 12])
def test_forced_call_cut_off_by_max_tokens_shows_no_markup(server, stream, max_tokens):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    message, finish = ask(client, served_model(server), [{"role": "user", "content": "weather?"}], stream,
                          max_tokens, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert finish == "length"
    # Cut inside the opening tag (3 tokens) or inside the JSON (12): nothing parsed, nothing shown.
    assert message == {"content": None, "tool_calls": []}


# Arguments in ASCII only (an enum and a digit), so the reply's tokens, each decoded on its own in
# the log probabilities, spell its text exactly.
FORECAST = {"type": "function", "function": {"name": "get_forecast", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["unit", "days"], "additionalProperties": False}}}


def complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


@pytest.mark.parametrize("stream", [False, True])
def test_forced_call_cut_off_after_its_json_is_returned(server, stream):
    """max_tokens ends the reply after the call's JSON but before its closing tag: the call comes
    back (SDK code reads tool_calls[0]) with finish_reason length, whole and streamed alike."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    model = served_model(server)
    messages = [{"role": "user", "content": "forecast?"}]
    named = {"type": "function", "function": {"name": "get_forecast"}}
    full = client.chat.completions.create(model=model, messages=messages, tools=[FORECAST], tool_choice=named,
                                          max_tokens=MAX_TOKENS, temperature=1.0, seed=7, logprobs=True)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (expected,) = choice.message.tool_calls
    pieces = [entry.token for entry in choice.logprobs.content]
    # How many tokens spell the call's JSON in full (the closing tag comes after them).
    complete = next(i for i in range(1, len(pieces) + 1)
                    if complete_json("".join(pieces[:i]).partition("<tool_call>")[2].strip()))
    assert complete < len(pieces)
    for max_tokens in sorted({complete, len(pieces) - 1}):
        message, finish = ask(client, model, messages, stream, max_tokens, tools=[FORECAST], tool_choice=named)
        assert finish == "length", (max_tokens, message)
        assert message["content"] is None
        (call,) = message["tool_calls"]
        assert call["id"] and call["function"] == expected.function.model_dump(), (max_tokens, message)


def test_a_block_cut_off_after_its_json_is_a_call():
    """Cut anywhere after the call's arguments are complete JSON (the closing tag, the newline
    before it or the call's last brace missing), whole text and stream give the same call; cut
    inside the JSON, neither gives one."""
    full = '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n</tool_call>'
    arguments_end = full.index("]}") + 2
    for cut in range(len("<tool_call>"), len(full)):
        text = "Sure. " + full[:cut]
        content, calls = parse_tool_calls(text, names={"f"}, cut_off=True)
        stream = ToolCallStream(names={"f"})
        shown, handed = "", []
        third = len(text) // 3
        for piece in (text[:third], text[third:2 * third], text[2 * third:]):
            more, closed = stream.feed(piece)
            shown, handed = shown + more, handed + closed
        handed += stream.finish_calls(cut_off=True)
        shown += stream.finish(cut_off=True)
        assert content == "Sure." and shown.strip() == "Sure.", cut
        got = [c["function"] for c in calls]
        assert got == [c["function"] for c in handed], cut
        assert got == ([{"name": "f", "arguments": '{"a": [1, 2]}'}] if cut >= arguments_end else []), (cut, text)
    # Without arguments there is no call to make, and a call after one is refused without parallel calls.
    assert parse_tool_calls('<tool_call>\n{"name": "f"', names={"f"}, cut_off=True) == (None, [])
    done = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'
    assert len(parse_tool_calls(done + full[:-3], parallel=False, cut_off=True)[1]) == 1
    assert len(parse_tool_calls(done + full[:-3], cut_off=True)[1]) == 2


def test_cut_off_text_drops_the_unfinished_block_only():
    done = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    content, calls = parse_tool_calls("Sure.\n" + done + '\n<tool_call>\n{"name": "g", "argu', cut_off=True)
    assert content == "Sure." and [c["function"]["name"] for c in calls] == ["f"]
    assert parse_tool_calls("Sure. <tool_ca", cut_off=True) == ("Sure.", [])
    assert parse_tool_calls("Sure. <tool_ca") == ("Sure. <tool_ca", [])  # the model stopped there itself
    assert parse_tool_calls(done + "\n<tool_call>\n{", forced=True)[0] is None
    stream = ToolCallStream(forced=True)
    assert stream.feed("<tool_call>\n{\"na") == ("", []) and stream.finish(cut_off=True) == ""
    stream = ToolCallStream()
    assert stream.feed("Hi <tool") == ("Hi ", []) and stream.finish(cut_off=True) == ""


def test_only_calls_of_declared_tools_with_json_object_arguments_are_calls():
    def block(body: str) -> str:
        return f"<tool_call>\n{body}\n</tool_call>"

    ok = block('{"name": "get_time", "arguments": {"zone": "UTC"}}')
    as_text = block('{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}')  # a JSON text of an object
    undeclared = block('{"name": "rm_rf", "arguments": {}}')
    not_json = block('{"name": "get_time", "arguments": "zone=UTC"}')
    not_object = block('{"name": "get_time", "arguments": [1, 2]}')
    text = "\n".join([ok, as_text, undeclared, not_json, not_object])
    content, calls = parse_tool_calls(text, names=set(SCHEMAS))
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"zone": "UTC"}, {"zone": "UTC"}]
    assert content == "\n".join([undeclared, not_json, not_object])
    stream = ToolCallStream(names=set(SCHEMAS))
    handed = [call for piece in text.split("\n") for call in stream.feed(piece + "\n")[1]]
    assert len(handed) == 2 and stream.finish() == content
