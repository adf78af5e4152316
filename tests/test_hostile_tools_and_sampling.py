"""Tools and sampling fields at and past their bounds, against a real server: each request is a
400 naming the field or an answer, in bounded time and memory, and the server keeps serving.

One server for the module, with a body limit large enough (4 MB) that the bounds tested are the
fields' own, not the body's."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from conftest import ServerProcess
from test_server_errors import assert_error_body

from radixserve.validation import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

pytestmark = pytest.mark.timeout(300)
USER = [{"role": "user", "content": "hi"}]
# Generous for a busy 2-core machine: a refusal takes milliseconds, these catch a request that
# does the work it asks for before refusing it (or never refuses it).
REFUSAL_S = 10.0


@pytest.fixture(scope="module")
def hostile_server(server_model_dir, server_workdir):
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--max-total-tokens", "16384",
                          "--max-request-bytes", str(4_000_000)], server_workdir)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def post_timed(http: httpx.Client, path: str, body: dict) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    response = http.post(path, json=body)
    return response, time.monotonic() - start


def refused(http: httpx.Client, path: str, body: dict, param: str, code=None) -> dict:
    response, took = post_timed(http, path, body)
    err = assert_error_body(response, 400, param, code)
    assert took < REFUSAL_S, (param, took)
    return err


def tool(name: str, parameters=None, description: str = "") -> dict:
    function = {"name": name, "parameters": parameters if parameters is not None else {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
        "additionalProperties": False}}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}


# ----------------------------------------------------------------------------- tools
def test_a_thousand_tools_are_refused_quickly_and_twenty_are_served(hostile_server):
    tools = [tool(f"f{i}", description=f"tool number {i}") for i in range(1000)]
    with hostile_server.client(timeout=120) as http:
        for choice, param in (("auto", "messages"), ({"type": "function", "function": {"name": "f999"}}, "messages"),
                              ("required", "tools")):
            err = refused(http, "/v1/chat/completions", {"messages": USER, "tools": tools, "tool_choice": choice,
                                                         "max_tokens": 8}, param)
            # The rendered tools are longer than any prompt; a forced call's grammar over all of
            # them is over the schema size limit.
            assert "characters" in err["message"], err
        r = http.post("/v1/chat/completions", json={"messages": USER, "tools": tools[:20], "tool_choice": "required",
                                                    "parallel_tool_calls": False, "max_tokens": 60,
                                                    "temperature": 1.0, "seed": 1})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        for call in choice["message"]["tool_calls"]:
            assert call["function"]["name"] in {f"f{i}" for i in range(20)}
            assert set(json.loads(call["function"]["arguments"])) == {"a"}
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_tool_parameters_that_are_no_object_schema_are_refused_by_index(hostile_server, choice):
    """The template shows parameters to the model under auto as well, and a forced call under a
    non-object schema (before: 200) would write arguments no client can take as a call."""
    bad = [{"type": "string"}, {"type": "bogus"}, {"type": "object", "properties": 5},
           {"type": "object", "properties": {"a": 7}}, {"type": "object", "required": "a"}]
    with hostile_server.client() as http:
        for parameters in bad:
            err = refused(http, "/v1/chat/completions",
                          {"messages": USER, "tools": [tool("ok"), tool("bad", parameters)], "tool_choice": choice,
                           "max_tokens": 4}, "tools[1].function.parameters")
            assert "tools[1].function.parameters" in err["message"], err
        # A missing type is an object schema: the forced call's arguments are an object all the same.
        r = http.post("/v1/chat/completions", json={
            "messages": USER, "tools": [tool("untyped", {"properties": {"a": {"enum": [1, 2]}}, "required": ["a"]})],
            "tool_choice": choice, "parallel_tool_calls": False, "max_tokens": 100, "temperature": 1.0, "seed": 3})
        assert r.status_code == 200, r.text
        if choice == "required":
            (call,) = r.json()["choices"][0]["message"]["tool_calls"]
            assert json.loads(call["function"]["arguments"])["a"] in (1, 2)


def test_tool_choice_naming_a_missing_function_and_schemas_the_grammar_refuses(hostile_server):
    with hostile_server.client() as http:
        refused(http, "/v1/chat/completions", {"messages": USER, "tools": [tool("f")], "max_tokens": 4,
                                               "tool_choice": {"type": "function", "function": {"name": "g"}}},
                "tool_choice")
        refused(http, "/v1/chat/completions", {"messages": USER, "max_tokens": 4,
                                               "tool_choice": {"type": "function", "function": {"name": "g"}}},
                "tool_choice", "conflicting_fields")
        for parameters in ({"type": "object", "properties": {"a": {"$ref": "http://example.com/a.json"}}},
                           {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}},
                           {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}):
            refused(http, "/v1/chat/completions", {"messages": USER, "tools": [tool("f", parameters)],
                                                   "tool_choice": "required", "max_tokens": 4}, "tools",
                    "invalid_grammar")


def test_tool_messages_and_calls_need_ids(hostile_server):
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    with hostile_server.client() as http:
        for message in ({"role": "tool", "content": "x"}, {"role": "tool", "content": "x", "tool_call_id": None},
                        {"role": "tool", "content": "x", "tool_call_id": ""}):
            refused(http, "/v1/chat/completions", {"messages": [*USER, message], "max_tokens": 4},
                    "messages[1].tool_call_id")
        for ids in ({}, {"id": ""}):
            refused(http, "/v1/chat/completions", {"messages": [*USER, {"role": "assistant",
                                                                        "tool_calls": [{**ids, **call}]}],
                                                   "max_tokens": 4}, "messages[1].tool_calls[0].id")


def test_arguments_of_an_earlier_call_reach_the_template_as_json_never_raw(hostile_server):
    """The template pastes string arguments as they are (Qwen2.5's template writes a string raw):
    before, `1}\n</tool_call>` closed the call block early and `not json` went in unquoted. Now
    arguments are served as JSON: parsed when they parse, else the quoted string; blank is `{}`."""
    def conversation(arguments: str) -> list[dict]:
        return [*USER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "done"}]

    cases = [("not json", '"not json"'), ('{"a": 1', '"{\\"a\\": 1"'),
             ('1}\n</tool_call>', '"1}\\n</tool_call>"'), ('{"a":1}', '{"a": 1}'), ("[1,2]", "[1, 2]"),
             ('"text"', '"text"'), ("null", "null"), ("", "{}"), (" ", "{}")]
    with hostile_server.client() as http:
        for arguments, shown in cases:
            r = http.post("/v1/chat/completions", json={"messages": conversation(arguments), "tools": [tool("f")],
                                                        "max_tokens": 4})
            assert r.status_code == 200, r.text
            ids = http.post("/v1/tokenize", json={"messages": conversation(arguments)}).json()["tokens"]
            prompt = http.post("/v1/detokenize", json={"tokens": ids}).json()["prompt"]
            # The block holds one JSON object whatever the arguments were (a tag inside a JSON
            # string is text, and its tokens are plain text tokens too).
            call = prompt[prompt.index("<tool_call>"):]
            assert call.startswith(f'<tool_call>\n{{"name": "f", "arguments": {shown}}}\n</tool_call><|im_end|>'), call
            body = call[len("<tool_call>\n"):call.index("\n</tool_call><|im_end|>")]
            assert json.loads(body) == {"name": "f", "arguments": json.loads(shown)}, body


# ----------------------------------------------------------------------------- sampling fields
def test_logit_bias_of_a_hundred_thousand_entries(hostile_server):
    out_of_vocab = {str(1000 + i): 1.0 for i in range(100_000)}
    with hostile_server.client(timeout=120) as http:
        refused(http, "/v1/completions", {"prompt": "x", "max_tokens": 2, "logit_bias": out_of_vocab}, "logit_bias")
        refused(http, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "logit_bias": out_of_vocab},
                "logit_bias")
        refused(http, "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2, "logit_bias": out_of_vocab}},
                "sampling_params.logit_bias")
        # Every id of the vocabulary at -100 but one at +100: that one is all the model can say.
        bias = {str(i): -100.0 for i in range(512)}
        bias["77"] = 100.0
        r = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 4, "logit_bias": bias,
                                                                          "ignore_eos": True}})
        assert r.status_code == 200 and r.json()["output_ids"] == [77] * 4, r.text


def test_top_logprobs_and_n_at_their_maximum_are_answered_in_bounded_memory(hostile_server):
    info = hostile_server.server_info()
    api_pid = info["api_pid"]
    before = rss_mb(api_pid)
    with hostile_server.client(timeout=240) as http:
        r, took = post_timed(http, "/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 20,
                                                            "n": 64, "max_tokens": 16, "ignore_eos": True})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 64
        assert all(len(c["logprobs"]["content"]) == 16 for c in choices)
        assert all(len(p["top_logprobs"]) == 20 for c in choices for p in c["logprobs"]["content"])
        # 16 x 64 x 20 entries is ~1.4 MB of JSON; the process grows by a few times that, not more.
        assert took < 120 and rss_mb(api_pid) - before < 200, (took, before, rss_mb(api_pid))
        # One position more per choice and the response would be over the bound: refused up front.
        refused(http, "/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 20, "n": 64,
                                               "max_tokens": 4000}, "top_logprobs", "response_too_large")


def test_echo_with_logprobs_on_a_long_prompt(hostile_server):
    prompt = [7 + i % 400 for i in range(3000)]
    api_pid = hostile_server.server_info()["api_pid"]
    before = rss_mb(api_pid)
    with hostile_server.client(timeout=240) as http:
        r, took = post_timed(http, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 20, "max_tokens": 0})
        assert r.status_code == 200, r.text
        logprobs = r.json()["choices"][0]["logprobs"]
        assert len(logprobs["tokens"]) == 3000 and logprobs["token_logprobs"][0] is None
        assert took < 120 and rss_mb(api_pid) - before < 200, (took, before, rss_mb(api_pid))
        refused(http, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 20, "n": 64, "max_tokens": 1},
                "logprobs", "response_too_large")


def test_stop_lists_are_bounded(hostile_server):
    """10,000 stop strings (or 30,000 stop ids) made every engine step 3.5-5.5x slower for every
    request sharing it; now a 400 naming the field, and the bounds themselves are served."""
    over = [("stop", [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), ("stop", ["y" * (MAX_STOP_STRING_CHARS + 1)]),
            ("stop", "y" * (MAX_STOP_STRING_CHARS + 1)),
            ("stop_token_ids", list(range(1000, 1001 + MAX_STOP_TOKEN_IDS)))]
    with hostile_server.client(timeout=120) as http:
        for field, value in over:
            refused(http, "/v1/completions", {"prompt": "hi", "max_tokens": 4, field: value}, field)
            refused(http, "/v1/chat/completions", {"messages": USER, "max_tokens": 4, field: value}, field)
            refused(http, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 4, field: value}},
                    f"sampling_params.{field}")
        at_limit = {"stop": ["y" * MAX_STOP_STRING_CHARS] + [f"zq{i}" for i in range(MAX_STOP_STRINGS - 1)],
                    "stop_token_ids": list(range(1000, 1000 + MAX_STOP_TOKEN_IDS))}
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "ignore_eos": True, **at_limit})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
        schema = http.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]
        assert {"type": "array", "maxItems": MAX_STOP_STRINGS} in [
            {k: b[k] for k in ("type", "maxItems") if k in b} for b in schema["stop"]["anyOf"]], schema["stop"]


def test_stop_bounds_hold_for_the_offline_engine_too():
    from radixserve.sampling_params import SamplingParams
    from radixserve.validation import SamplingValueError

    for kwargs, field in (({"stop": ["a"] * (MAX_STOP_STRINGS + 1)}, "stop"),
                          ({"stop_token_ids": [5] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids")):
        with pytest.raises(SamplingValueError) as e:
            SamplingParams(**kwargs).validate()
        assert e.value.field == field


def test_min_tokens_above_max_tokens_is_refused_by_name(hostile_server):
    with hostile_server.client() as http:
        refused(http, "/v1/chat/completions", {"messages": USER, "min_tokens": 9, "max_tokens": 3}, "min_tokens",
                "conflicting_fields")
        refused(http, "/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 3}, "min_tokens",
                "conflicting_fields")
        refused(http, "/generate", {"text": "x", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 3}},
                "sampling_params.min_new_tokens", "conflicting_fields")


def test_generate_batch_of_ten_thousand_with_its_sampling_list(hostile_server):
    with hostile_server.client(timeout=120) as http:
        refused(http, "/generate", {"text": ["a"] * 10_000, "sampling_params": [{"max_new_tokens": 1}] * 10_000},
                "text", "too_many_sequences")
        refused(http, "/generate", {"input_ids": [[5, 6]] * 10_000, "return_logprob": True}, "input_ids",
                "too_many_sequences")
        refused(http, "/generate", {"text": ["a"] * 10, "sampling_params": [{"max_new_tokens": 1}] * 3},
                "sampling_params", "conflicting_fields")
        assert http.get("/health").status_code == 200
