"""Qwen3 reasoning in the chat API: the parser on every way a reply can be cut into pieces, the
Qwen3-format template, and a real server (`--reasoning-parser qwen3`) over the tiny random Qwen3
built with Qwen3's chat format, through the openai SDK. The random model is made to write a given
reply exactly, in the tokenizer's own tokens, by an EBNF grammar of the reply with logit_bias on
its tokens (`forced_reply`), so the replies, their tokens and the cache counts are deterministic."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Optional

import httpx
import openai
import pytest

from radixserve.bench.reasoning_history import forced_reply, reply_text
from radixserve.chat_formats import QWEN3_CHAT_TEMPLATE
from radixserve.server.reasoning import ReasoningFormat, ReasoningStream, split_reasoning

FMT = ReasoningFormat("<think>", "</think>", start_id=900, end_id=901)
REASONING = "the mill every turn"
ANSWER = "one small book"
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
USER = [{"role": "user", "content": "What is the capital of France?"}]


# ----------------------------------------------------------------------------- the parser
def streamed(text: str, cuts: list[int], in_reasoning: bool) -> tuple[str, str]:
    stream = ReasoningStream(FMT, in_reasoning)
    reasoning, content, last = "", "", 0
    for cut in [*cuts, len(text)]:
        r, c = stream.feed(text[last:cut])
        reasoning, content, last = reasoning + r, content + c, cut
    r, c = stream.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("text,in_reasoning,expected", [
    ("<think>\nthe mill\n</think>\n\nthe answer", False, ("the mill", "the answer")),
    ("  <think>a\n\nb</think>x</think>", False, ("a\n\nb", "x</think>")),  # only the first </think> ends it
    ("the answer <think>not reasoning</think>", False, (None, "the answer <think>not reasoning</think>")),
    ("\n\nplain answer\n", False, (None, "\n\nplain answer\n")),  # enable_thinking false: all content
    ("the mill\n</think>\n\nanswer", True, ("the mill", "answer")),  # the prompt opened <think>
    ("<think>\nthe mill is still going\n\n", False, ("the mill is still going", "")),  # never closed
    ("<think>\nthe mill </thi", False, ("the mill </thi", "")),  # cut inside the closing tag
    ("<thi", False, (None, "<thi")),  # a tag that never completed is text
    ("<think>\n\n</think>\n\nanswer", False, (None, "answer")),  # empty reasoning is none
])
def test_streamed_pieces_add_up_to_the_split_wherever_the_text_is_cut(text, in_reasoning, expected):
    assert split_reasoning(text, FMT, in_reasoning) == (expected[0], expected[1])
    for cut in range(len(text) + 1):  # every single cut, and every character on its own
        assert streamed(text, [cut], in_reasoning) == ((expected[0] or ""), expected[1]), cut
    assert streamed(text, list(range(len(text))), in_reasoning) == ((expected[0] or ""), expected[1])


def test_reasoning_never_shows_a_partial_tag_or_the_newlines_before_the_end():
    stream = ReasoningStream(FMT, False)
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>\nthe mill\n") == ("the mill", "")
    assert stream.feed("</th") == ("", "")
    assert stream.feed("ink>\n\nans") == ("", "ans")


def test_where_the_reply_starts_and_its_reasoning_tokens():
    assert FMT.starts_in_reasoning([5, 6, 900, 7])
    assert not FMT.starts_in_reasoning([900, 7, 901, 7, 7])  # enable_thinking false: a closed block
    assert not FMT.starts_in_reasoning([5, 6, 7])
    assert not FMT.starts_in_reasoning([900] + [7] * 40)  # an earlier turn's tag never decides
    assert FMT.reasoning_tokens([900, 1, 2, 3, 901, 4], False) == 3
    assert FMT.reasoning_tokens([1, 2, 901, 4], True) == 2
    assert FMT.reasoning_tokens([1, 2, 3], True) == 3  # cut off inside
    assert FMT.reasoning_tokens([4, 900, 1, 901], False) == 0  # no reasoning at the start


# ----------------------------------------------------------------------------- the template
def render(messages, **kwargs) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    return render_jinja_template([messages], chat_template=QWEN3_CHAT_TEMPLATE, add_generation_prompt=True,
                                 **kwargs)[0][0]


def test_the_qwen3_template_drops_reasoning_before_the_last_query_unless_kept():
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": {"query": "x"}}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello", "reasoning_content": "\ngreeting\n"},
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "reasoning_content": "need a tool", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = render(messages, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n") and "\n<tools>\n{" in text
    assert "<|im_start|>assistant\nHello<|im_end|>\n" in text  # before the last query: dropped
    assert ("<|im_start|>assistant\n<think>\nneed a tool\n</think>\n\n<tool_call>\n"
            '{"name": "lookup", "arguments": {"query": "x"}}\n</tool_call><|im_end|>\n') in text  # the loop: kept
    assert text.endswith("<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n")
    kept = render(messages, tools=TOOLS, keep_reasoning=True)
    assert "<|im_start|>assistant\n<think>\ngreeting\n</think>\n\nHello<|im_end|>\n" in kept
    # A <think> block inside content is reasoning too (clients that send the raw reply back).
    raw = render([messages[1], {"role": "assistant", "content": "<think>\nr\n</think>\n\nHello"}, messages[3]])
    assert "<|im_start|>assistant\nHello<|im_end|>" in raw and "<think>" not in raw
    assert render(USER, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(USER).endswith("<|im_start|>assistant\n") and "system" not in render(USER)


# ----------------------------------------------------------------------------- a real server
@pytest.fixture(scope="module")
def qwen3_model_dir(tmp_path_factory):
    from radixserve.testing.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), family="qwen3", chat_format="qwen3")


@pytest.fixture(scope="module")
def tokenizer(qwen3_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_model_dir)


def start(model_dir, workdir, *args):
    from conftest import ServerProcess

    return ServerProcess(["--model-path", str(model_dir), "--device", "cpu", "--context-length", "4096",
                          "--reasoning-parser", "qwen3", *args], workdir).wait_ready()


# The replies these servers write are forced by a grammar of the whole reply (forced_reply), the
# reasoning included: --grammar-in-reasoning. The grammar behind the reasoning, the default, has
# its own server below (gated_server).
@pytest.fixture(scope="module")
def reasoning_server(qwen3_model_dir, server_workdir):
    proc = start(qwen3_model_dir, server_workdir, "--grammar-in-reasoning")
    try:
        yield proc
    finally:
        proc.stop()


# Qwen3-2507's thinking-only template style: the generation prompt opens <think> itself.
GENERATION_PROMPT = "{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking"
OPEN_THINK_TEMPLATE = QWEN3_CHAT_TEMPLATE.replace(GENERATION_PROMPT,
                                                  GENERATION_PROMPT.replace("\\n'", "\\n<think>\\n'", 1))


@pytest.fixture(scope="module")
def open_think_server(qwen3_model_dir, server_workdir, tmp_path_factory):
    assert OPEN_THINK_TEMPLATE != QWEN3_CHAT_TEMPLATE
    template = tmp_path_factory.mktemp("open-think") / "open_think.jinja"
    template.write_text(OPEN_THINK_TEMPLATE)
    proc = start(qwen3_model_dir, server_workdir, "--chat-template", str(template), "--keep-reasoning-history",
                 "--grammar-in-reasoning")
    try:
        yield proc
    finally:
        proc.stop()


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def reply(server, stream: bool, **args):
    """(message fields, finish_reason, usage) of one chat completion through the openai SDK, streamed
    or not (streamed: the reasoning must come before the content; the fields joined). Not
    streamed with logprobs, the fields have the reply's tokens as written ("tokens")."""
    args["model"] = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
    client = sdk(server)
    if not stream:
        done = client.chat.completions.create(**args)
        m, logprobs = done.choices[0].message, done.choices[0].logprobs
        return ({"content": m.content, "reasoning_content": getattr(m, "reasoning_content", None),
                 "tool_calls": [c.model_dump() for c in m.tool_calls or []],
                 "tokens": [t.token for t in logprobs.content] if logprobs else None},
                done.choices[0].finish_reason, done.usage)
    order, fields, calls, finish, used = [], {"content": "", "reasoning_content": ""}, [], None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        if not chunk.choices:
            used = chunk.usage
            continue
        delta = chunk.choices[0].delta
        for name in fields:
            piece = getattr(delta, name, None)
            if piece:
                fields[name] += piece
                order.append(name)
        calls += [c.model_dump() for c in delta.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    assert order == sorted(order, key=lambda name: name != "reasoning_content"), order  # reasoning first
    return ({"content": fields["content"] or None, "reasoning_content": fields["reasoning_content"] or None,
             "tool_calls": calls}, finish, used)


def ask(server, tokenizer, text: str, messages=USER, stream: bool = False, **extra):
    """(message fields, finish_reason, usage) of a reply forced to be `text`."""
    body = {**forced_reply(tokenizer, text), **extra}
    return reply(server, stream, messages=messages, max_tokens=body.pop("max_tokens"),
                 temperature=body.pop("temperature"), tools=body.pop("tools", openai.NOT_GIVEN),
                 extra_body=body)  # ebnf, logit_bias and the radixserve fields


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_then_content(reasoning_server, tokenizer, stream):
    message, finish, usage = ask(reasoning_server, tokenizer, reply_text(REASONING, ANSWER), stream=stream)
    assert (message["reasoning_content"], message["content"], finish) == (REASONING, ANSWER, "stop")
    assert usage.completion_tokens_details.reasoning_tokens == len(tokenizer.encode("\n" + REASONING + "\n"))


@pytest.mark.parametrize("stream", [False, True])
def test_a_reply_cut_off_inside_its_reasoning_is_all_reasoning(reasoning_server, tokenizer, stream):
    text = reply_text(REASONING, ANSWER)
    cut = len(tokenizer.encode("<think>\n" + REASONING))  # stops before the closing tag
    message, finish, usage = ask(reasoning_server, tokenizer, text, stream=stream, max_tokens=cut)
    assert (message["reasoning_content"], message["content"], finish) == (REASONING, None, "length")
    assert usage.completion_tokens_details.reasoning_tokens == cut - 1


@pytest.mark.parametrize("stream", [False, True])
def test_separate_reasoning_false_returns_the_reply_as_written(reasoning_server, tokenizer, stream):
    text = reply_text(REASONING, ANSWER)
    message, _, _ = ask(reasoning_server, tokenizer, text, stream=stream, separate_reasoning=False)
    assert (message["reasoning_content"], message["content"]) == (None, text)


def test_enable_thinking_false_renders_an_empty_think_block(reasoning_server, tokenizer):
    message, _, usage = ask(reasoning_server, tokenizer, ANSWER, chat_template_kwargs={"enable_thinking": False})
    assert (message["reasoning_content"], message["content"]) == (None, ANSWER)
    _, _, thinking = ask(reasoning_server, tokenizer, ANSWER)
    assert usage.prompt_tokens - thinking.prompt_tokens == len(tokenizer.encode("<think>\n\n</think>\n\n"))
    assert usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_parsed_after_the_reasoning(reasoning_server, tokenizer, stream):
    # A call drafted inside the reasoning is reasoning, not a call.
    draft = 'the <tool_call>\n{"name": "lookup", "arguments": {"query": "mill"}}\n</tool_call> turn'
    call = {"name": "lookup", "arguments": {"query": "the capital"}}
    message, finish, _ = ask(reasoning_server, tokenizer, reply_text(draft, call=call), stream=stream, tools=TOOLS)
    assert message["reasoning_content"] == draft and message["content"] is None and finish == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("lookup", {"query": "the capital"})]


def turn_two(server, tokenizer, keep=None) -> tuple[int, int, int]:
    """(turn 1's prompt tokens, its completion tokens, turn 2's cached tokens) of a two-turn
    conversation that sends turn 1's reply back with its reasoning."""
    httpx.post(f"{server.base_url}/flush_cache", timeout=60).raise_for_status()
    kwargs = {} if keep is None else {"chat_template_kwargs": {"keep_reasoning": keep}}
    message, _, first = ask(server, tokenizer, reply_text(REASONING, ANSWER), **kwargs)
    history = [*USER, {"role": "assistant", "content": message["content"],
                       "reasoning_content": message["reasoning_content"]},
               {"role": "user", "content": "And of Spain?"}]
    _, _, second = ask(server, tokenizer, reply_text(REASONING, ANSWER), messages=history, **kwargs)
    return first.prompt_tokens, first.completion_tokens, second.prompt_tokens_details.cached_tokens


def test_keep_reasoning_keeps_the_whole_turn_in_the_cache(reasoning_server, tokenizer):
    prompt, completion, cached = turn_two(reasoning_server, tokenizer, keep=True)
    assert cached == prompt + completion - 1  # all but the reply's last token (<|im_end|>), never computed
    prompt, completion, cached = turn_two(reasoning_server, tokenizer, keep=False)
    assert cached == prompt  # Qwen3's default: the match stops where the reply's <think> began


def test_a_prompt_that_opens_think_starts_the_reply_inside_the_reasoning(open_think_server, tokenizer):
    text = f"{REASONING}\n</think>\n\n{ANSWER}"  # the model writes only the closing tag
    for stream in (False, True):
        message, _, usage = ask(open_think_server, tokenizer, text, stream=stream)
        assert (message["reasoning_content"], message["content"]) == (REASONING, ANSWER)
        assert usage.completion_tokens_details.reasoning_tokens == len(tokenizer.encode(REASONING + "\n"))


def test_keep_reasoning_history_is_the_server_default_a_request_can_turn_off(open_think_server, tokenizer):
    def second_prompt(**kwargs) -> int:
        history = [*USER, {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING},
                   {"role": "user", "content": "And of Spain?"}]
        return ask(open_think_server, tokenizer, ANSWER, messages=history, **kwargs)[2].prompt_tokens

    kept = second_prompt()
    assert kept - second_prompt(chat_template_kwargs={"keep_reasoning": False}) == \
        len(tokenizer.encode(f"<think>\n{REASONING}\n</think>\n\n"))


def test_reasoning_and_tool_results_that_answer_no_call_are_refused(reasoning_server):
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
    cases = [
        ([{"role": "user", "content": "hi", "reasoning_content": "x"}], "messages[0].reasoning_content"),
        ([*USER, {"role": "assistant", "content": "a", "reasoning_content": "x", "reasoning": "y"}],
         "messages[1].reasoning"),
        ([*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
          {"role": "tool", "tool_call_id": "c2", "content": "sunny"}], "messages[2].tool_call_id"),
        ([*USER, {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
          {"role": "assistant", "content": None, "tool_calls": [call]}], "messages[1].tool_call_id"),
    ]
    for messages, param in cases:
        r = httpx.post(f"{reasoning_server.base_url}/v1/chat/completions",
                       json={"messages": messages, "max_tokens": 2}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (param, r.text)
    for kwargs, param in (({"namespace": 1}, "chat_template_kwargs.namespace"),
                          ({"think": True}, "chat_template_kwargs.think")):
        r = httpx.post(f"{reasoning_server.base_url}/v1/chat/completions",
                       json={"messages": USER, "max_tokens": 2, "chat_template_kwargs": kwargs}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(f"{reasoning_server.base_url}/v1/chat/completions",
                   json={"messages": USER, "max_tokens": 2, "regex": "a+", "response_format": {"type": "json_object"}},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "regex", r.text


@pytest.mark.parametrize("flags,message", [
    (["--reasoning-parser", "qwen3"], "the tokenizer has no <think> token"),
    (["--keep-reasoning-history"], "--keep-reasoning-history needs a chat template that reads keep_reasoning"),
])
def test_reasoning_settings_the_model_cannot_serve_fail_at_start_up(server_model_dir, tmp_path, flags, message):
    from conftest import REPO_ROOT, free_port

    run = subprocess.run([sys.executable, "-m", "radixserve.launch_server", "--model-path", str(server_model_dir),
                          "--device", "cpu", "--port", str(free_port()), *flags], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=180)
    assert run.returncode == 1
    assert any("server failed: " in line and message in line for line in (run.stdout + run.stderr).splitlines()), \
        run.stdout + run.stderr


def test_reasoning_effort_none_turns_thinking_off_and_effort_levels_are_refused(reasoning_server, tokenizer):
    _, _, off = ask(reasoning_server, tokenizer, ANSWER, chat_template_kwargs={"enable_thinking": False})
    _, _, none = ask(reasoning_server, tokenizer, ANSWER, reasoning_effort="none")
    assert none.prompt_tokens == off.prompt_tokens  # the same empty think block in the prompt
    for body, param in (({"reasoning_effort": "high"}, "reasoning_effort"),
                        ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
                         "reasoning_effort")):
        r = httpx.post(f"{reasoning_server.base_url}/v1/chat/completions",
                       json={"messages": USER, "max_tokens": 2, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_served_schema_names_the_template_variables_a_request_may_set(reasoning_server):
    spec = httpx.get(f"{reasoning_server.base_url}/openapi.json", timeout=30).json()
    field = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]["chat_template_kwargs"]
    assert field["propertyNames"] == {"enum": ["enable_thinking", "keep_reasoning"]}, field


# ----------------------------------------------------------------------------- a grammar behind the reasoning
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
                 "additionalProperties": False}
JSON_ANSWER = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}


@pytest.fixture(scope="module")
def gated_server(qwen3_model_dir, server_workdir):
    proc = start(qwen3_model_dir, server_workdir)  # the default: a grammar waits for </think>
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def compilers(tokenizer):
    from radixserve.grammar.backend import GrammarCompilers

    c = GrammarCompilers(tokenizer, len(tokenizer), [tokenizer.convert_tokens_to_ids("<|im_end|>")])
    yield c
    c.shutdown()


def one_token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def scripted_reasoning(tokenizer, lead_in: bool = True) -> dict:
    """Request fields that make the random model write `<think> mill every</think>`, a newline
    (`lead_in`) and then whatever the grammar lets it: logit_bias ranks the tokens and
    repetition_penalty 2 halves a token's biased logit once it is written, so each is written once,
    in bias order (none of them is in the prompt). A grammar holding the reasoning allows none."""
    order = ["<think>", " mill", " every", "</think>"] + (["\n"] if lead_in else [])
    bias = {str(one_token(tokenizer, t)): 100.0 - 5 * i for i, t in enumerate(order)}
    return {"logit_bias": bias, "repetition_penalty": 2.0, "temperature": 0.0, "max_tokens": 40}


def structured(server, tokenizer, stream: bool = False, fields: Optional[dict] = None, **extra):
    """(message fields, finish_reason, usage) of a scripted reply under `extra`'s grammar."""
    body = {**(fields if fields is not None else scripted_reasoning(tokenizer)), **extra}
    sdk_fields = ("max_tokens", "temperature", "logit_bias", "response_format", "tools", "tool_choice",
                  "parallel_tool_calls", "logprobs")
    args = {name: body.pop(name, openai.NOT_GIVEN) for name in sdk_fields}
    return reply(server, stream, messages=USER, extra_body=body, **args)


def valid_answer(content: Optional[str]) -> dict:
    import jsonschema

    value = json.loads(content)
    jsonschema.validate(value, ANSWER_SCHEMA)
    return value


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_holds_the_answer_after_free_reasoning(gated_server, tokenizer, stream):
    message, finish, usage = structured(gated_server, tokenizer, stream, response_format=JSON_ANSWER,
                                        logprobs=not stream)
    assert message["reasoning_content"] == " mill every" and finish == "stop", message
    valid_answer(message["content"])  # the newline after </think> is not part of it
    assert usage.completion_tokens_details.reasoning_tokens == 2
    if not stream:  # the reply as written: the newline Qwen3 writes before its answer is allowed there
        assert message["tokens"][:6] == ["<think>", " mill", " every", "</think>", "\n", "{"], message["tokens"]


def test_with_thinking_off_the_grammar_holds_from_the_first_token(gated_server, tokenizer):
    # The prompt closes the think block: <think>, the most favoured token, is not the grammar's.
    message, finish, usage = structured(gated_server, tokenizer, response_format=JSON_ANSWER,
                                        chat_template_kwargs={"enable_thinking": False})
    assert message["reasoning_content"] is None and finish == "stop"
    valid_answer(message["content"])
    assert usage.completion_tokens_details.reasoning_tokens == 0


def test_a_reply_that_does_not_open_its_reasoning_follows_the_grammar_from_its_start(gated_server, tokenizer):
    fields = scripted_reasoning(tokenizer)
    fields["logit_bias"][str(one_token(tokenizer, "<think>"))] = -100.0
    for extra in ({"response_format": JSON_ANSWER}, {"regex": '\\{"answer": "(yes|no)"\\}'}):
        message, finish, _ = structured(gated_server, tokenizer, fields=fields, **extra)
        assert message["reasoning_content"] is None and finish == "stop", (extra, message)
        valid_answer(message["content"])


def test_a_forced_tool_call_comes_after_the_reasoning(gated_server, tokenizer):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}}]
    for choice in ("required", {"type": "function", "function": {"name": "lookup"}}):
        fields = dict(scripted_reasoning(tokenizer), max_tokens=120)  # a call is some 50 tokens
        message, finish, _ = structured(gated_server, tokenizer, fields=fields, tools=tools, tool_choice=choice,
                                        parallel_tool_calls=False)
        assert message["reasoning_content"] == " mill every" and message["content"] is None, (choice, message)
        assert finish == "tool_calls" and [c["function"]["name"] for c in message["tool_calls"]] == ["lookup"]
        assert json.loads(message["tool_calls"][0]["function"]["arguments"])["city"] in ("Paris", "Rome")


def test_reasoning_is_bounded_by_max_tokens_alone(gated_server, tokenizer):
    fields = scripted_reasoning(tokenizer)
    fields["logit_bias"].pop(str(one_token(tokenizer, "</think>")))  # the reasoning never ends
    message, finish, usage = structured(gated_server, tokenizer, fields=dict(fields, max_tokens=12),
                                        response_format=JSON_ANSWER)
    assert finish == "length" and message["content"] is None and usage.completion_tokens == 12
    assert message["reasoning_content"] and usage.completion_tokens_details.reasoning_tokens == 11


def test_grammar_in_reasoning_holds_the_reasoning_too(reasoning_server, tokenizer):
    # The same favoured <think> and words: the grammar allows none of them, so there is no reasoning.
    message, finish, _ = structured(reasoning_server, tokenizer, response_format=JSON_ANSWER)
    assert message["reasoning_content"] is None and finish == "stop"
    valid_answer(message["content"])


def test_separate_reasoning_false_keeps_the_grammar_over_the_whole_reply(gated_server, tokenizer):
    # The content is then the whole reply: the grammar holds it all.
    message, _, _ = structured(gated_server, tokenizer, response_format=JSON_ANSWER, separate_reasoning=False)
    assert message["reasoning_content"] is None
    valid_answer(message["content"])


# The gate itself, over real compiled grammars of the tiny vocabulary.
def test_where_a_gated_grammar_starts_and_what_it_allows(compilers, tokenizer):
    from radixserve.chat_formats import reasoning_format
    from radixserve.grammar.backend import RequestGrammar
    from radixserve.grammar.reasoning_gate import GRAMMAR, LEAD_IN, REASONING, UNDECIDED, GrammarAfterReasoning

    fmt = reasoning_format("qwen3", tokenizer)
    assert fmt.lead_in_ids == (one_token(tokenizer, "\n"),)
    compiled = compilers.compile("regex", "ab").result()

    def gate(prompt: str) -> GrammarAfterReasoning:
        return GrammarAfterReasoning(RequestGrammar(compiled), fmt, tokenizer.encode(prompt))

    assert gate("<|im_start|>assistant\n").state == UNDECIDED
    assert gate("<|im_start|>assistant\n<think>\n").state == REASONING
    assert gate("<|im_start|>assistant\n<think>\n\n</think>\n\n").state == GRAMMAR
    a, b, mill = one_token(tokenizer, "a"), one_token(tokenizer, "b"), one_token(tokenizer, " mill")

    g = gate("hi")
    assert g.constrains_next and g.also_allowed() == (fmt.start_id,)
    assert g.accept(fmt.start_id) and g.state == REASONING and not g.constrains_next and g.also_allowed() == ()
    assert g.accept(mill) and g.accept(a) and g.accept(fmt.start_id) and not g.terminated  # free text, unmatched
    assert g.accept(fmt.end_id) and g.state == LEAD_IN and g.also_allowed() == fmt.lead_in_ids
    assert g.accept(fmt.lead_in_ids[0]) and g.state == GRAMMAR and g.also_allowed() == ()
    assert not g.accept(fmt.lead_in_ids[0])  # one newline only: then the grammar's tokens
    assert g.accept(a) and g.accept(b) and g.accept(tokenizer.convert_tokens_to_ids("<|im_end|>")) and g.terminated

    g = gate("hi")
    assert g.accept(a) and g.state == GRAMMAR  # no <think>: the grammar from the first token
    assert not g.accept(fmt.start_id) and not g.accept(mill)
    g = gate("<think>\n")
    assert g.accept(fmt.end_id) and g.accept(a) and g.state == GRAMMAR  # no newline: straight into the grammar
    g = gate("hi")
    assert not g.accept(mill)  # neither <think> nor the grammar's
