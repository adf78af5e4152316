"""Log probabilities, penalties and the tokenizer endpoints through a real server, with the openai
SDK and raw HTTP."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

pytestmark = pytest.mark.timeout(300)

PROMPT_IDS = [11, 52, 97, 140, 201, 33, 8]
ATOL = 1e-4


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def generate(server, **body) -> dict:
    r = httpx.post(f"{server.base_url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def reference(server, n: int, top: int) -> dict:
    """Greedy tokens and their log probabilities from /generate (SGLang's fields)."""
    return generate(server, input_ids=PROMPT_IDS, return_logprob=True, top_logprobs_num=top,
                    return_text_in_logprobs=True,
                    sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True})


def test_generate_logprob_fields(server):
    ref = reference(server, 6, 3)
    meta = ref["meta_info"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ref["output_ids"]
    assert all(isinstance(text, str) for _, _, text in meta["output_token_logprobs"])
    for (lp, token, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert len(top) == 3 and top[0][1] == token and top[0][0] == pytest.approx(lp, abs=ATOL)
        assert top[0][0] >= top[1][0] >= top[2][0]
    plain = generate(server, input_ids=PROMPT_IDS, return_logprob=True,
                     sampling_params={"max_new_tokens": 2, "temperature": 0})["meta_info"]
    assert all(text is None for _, _, text in plain["output_token_logprobs"])
    assert plain["output_top_logprobs"] == [[], []]
    without = generate(server, input_ids=PROMPT_IDS, sampling_params={"max_new_tokens": 2})["meta_info"]
    assert "output_token_logprobs" not in without
    # Streamed: the last event has every token's entry.
    with httpx.stream("POST", f"{server.base_url}/generate", timeout=60, json={
            "input_ids": PROMPT_IDS, "stream": True, "return_logprob": True, "top_logprobs_num": 3,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    last = json.loads(events[-1])["meta_info"]
    assert [x[1] for x in last["output_token_logprobs"]] == ref["output_ids"]
    assert [x[0] for x in last["output_token_logprobs"]] == pytest.approx(
        [x[0] for x in meta["output_token_logprobs"]], abs=ATOL)


def completion_logprobs(client, stream: bool, **kwargs) -> tuple[str, list, list, list, list]:
    """A completion's text, tokens, token log probabilities, top log probabilities and text
    offsets, gathered from the stream's chunks or read from the one response."""
    if not stream:
        choice = client.completions.create(**kwargs).choices[0]
        lp = choice.logprobs
        return choice.text, lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    text, tokens, values, tops, offsets = "", [], [], [], []
    for chunk in client.completions.create(stream=True, **kwargs):
        text += chunk.choices[0].text
        lp = chunk.choices[0].logprobs
        if lp is not None:
            tokens += lp.tokens
            values += lp.token_logprobs
            tops += lp.top_logprobs
            offsets += lp.text_offset
    return text, tokens, values, tops, offsets


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs(server, client, model, stream):
    ref = reference(server, 6, 5)
    kwargs = dict(model=model, prompt=PROMPT_IDS, max_tokens=6, temperature=0, logprobs=5,
                  extra_body={"ignore_eos": True})
    _, tokens, values, tops, offsets = completion_logprobs(client, stream, **kwargs)
    meta = ref["meta_info"]
    assert tokens == [text for _, _, text in meta["output_token_logprobs"]]
    assert values == pytest.approx([v for v, _, _ in meta["output_token_logprobs"]], abs=ATOL)
    assert len(tops) == 6 and all(1 <= len(top) <= 5 for top in tops)  # equal texts share a key
    for top, ref_top in zip(tops, meta["output_top_logprobs"]):
        assert max(top.values()) == pytest.approx(ref_top[0][0], abs=ATOL)
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


LONG_PROMPT = [(7 * i * i + 3 * i + 11) % 480 + 10 for i in range(40)]


@pytest.fixture(scope="module")
def hf_prompt_logprobs(server_model_dir):
    """log_softmax of Hugging Face's logits at every position of LONG_PROMPT (fp32)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(server_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([LONG_PROMPT])).logits[0].float(), dim=-1)


def check_prompt_entries(values: list, token_ids: list[int], start: int, ref: torch.Tensor) -> None:
    """values[k]: the log probability reported for prompt token start + k (None for token 0)."""
    assert len(values) == len(token_ids) == len(LONG_PROMPT) - start
    assert token_ids == LONG_PROMPT[start:]
    for k, value in enumerate(values):
        pos = start + k
        if pos == 0:
            assert value is None
        else:
            assert value == pytest.approx(ref[pos - 1, LONG_PROMPT[pos]].item(), abs=ATOL)


@pytest.mark.parametrize("start", [0, 25])
def test_generate_prompt_logprobs_match_hf(server, hf_prompt_logprobs, start):
    # The prompt cached first: the prefix is reused only up to the first position that is scored.
    generate(server, input_ids=LONG_PROMPT, sampling_params={"max_new_tokens": 1})
    out = generate(server, input_ids=LONG_PROMPT, return_logprob=True, top_logprobs_num=3, logprob_start_len=start,
                   return_text_in_logprobs=True, sampling_params={"max_new_tokens": 3, "temperature": 0})
    meta = out["meta_info"]
    entries = meta["input_token_logprobs"]
    check_prompt_entries([v for v, _, _ in entries], [t for _, t, _ in entries], start, hf_prompt_logprobs)
    assert all(isinstance(text, str) for _, _, text in entries)
    assert meta["cached_tokens"] <= max(start - 1, 0)
    tops = meta["input_top_logprobs"]
    assert len(tops) == len(entries) and (tops[0] is None) == (start == 0)
    for k, top in enumerate(tops):
        if top is not None:
            expected = hf_prompt_logprobs[start + k - 1].topk(3)
            assert [i for _, i, _ in top] == expected.indices.tolist()
            assert [v for v, _, _ in top] == pytest.approx(expected.values.tolist(), abs=ATOL)
    assert len(meta["output_token_logprobs"]) == 3


@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo_logprobs_match_hf(server, client, model, hf_prompt_logprobs, stream):
    kwargs = dict(model=model, prompt=LONG_PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True,
                  extra_body={"ignore_eos": True})
    text, tokens, values, tops, offsets = completion_logprobs(client, stream, **kwargs)
    n = len(LONG_PROMPT)
    assert len(tokens) == len(values) == len(tops) == n + 4
    check_prompt_entries(values[:n], LONG_PROMPT, 0, hf_prompt_logprobs)
    assert tops[0] is None and all(1 <= len(top) <= 2 for top in tops[1:])
    assert text  # the echoed prompt, then the completion
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    plain = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True}).choices[0].logprobs
    assert plain.tokens == tokens[n:]
    assert plain.token_logprobs == pytest.approx(values[n:], abs=ATOL)


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_with_echo_scores_the_prompt(server, client, model, hf_prompt_logprobs, stream):
    """The legacy API's scoring call: the prompt back with its log probabilities, nothing generated."""
    prompt_text = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=0, echo=True).choices[0].text
    text, tokens, values, tops, offsets = completion_logprobs(client, stream, model=model, prompt=LONG_PROMPT,
                                                              max_tokens=0, echo=True, logprobs=2)
    assert text == prompt_text and len(tokens) == len(LONG_PROMPT)
    check_prompt_entries(values, LONG_PROMPT, 0, hf_prompt_logprobs)
    assert tops[0] is None and all(1 <= len(top) <= 2 for top in tops[1:])
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    with server.client(timeout=60) as http:
        body = {"prompt": "The river ran", "max_tokens": 0, "echo": True, "n": 2, "stream": stream,
                "stream_options": {"include_usage": True} if stream else None}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            answer = {"choices": [c for e in events for c in e["choices"]], "usage": events[-1]["usage"]}
            assert "".join(c["text"] for c in answer["choices"] if c["index"] == 0) == "The river ran"
        else:
            answer = r.json()
            assert [c["text"] for c in answer["choices"]] == ["The river ran"] * 2
        assert [c["finish_reason"] for c in answer["choices"] if c["finish_reason"]] == ["length"] * 2
        usage = answer["usage"]
        assert usage["completion_tokens"] == 0 and usage["total_tokens"] == usage["prompt_tokens"] > 0
        for extra in ({"echo": False}, {"echo": True, "min_tokens": 1}):
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 0, **extra})
            assert r.status_code == 400 and r.json()["error"]["code"] == "conflicting_fields", r.text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs(client, model, stream):
    kwargs = dict(model=model, messages=[{"role": "user", "content": "count the rivers"}], max_tokens=5,
                  temperature=0, logprobs=True, top_logprobs=4, extra_body={"ignore_eos": True})
    if stream:
        content = []
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                content += chunk.choices[0].logprobs.content
        completion_tokens = 5
    else:
        completion = client.chat.completions.create(**kwargs)
        content = completion.choices[0].logprobs.content
        completion_tokens = completion.usage.completion_tokens
    assert len(content) == completion_tokens == 5
    for entry in content:
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 4
        # Greedy and nothing processes the logits: the chosen token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=ATOL)
        assert entry.top_logprobs[0].token == entry.token
    plain = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert plain.choices[0].logprobs is None
    only_chosen = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2, logprobs=True)
    assert all(e.top_logprobs == [] for e in only_chosen.choices[0].logprobs.content)


def test_chat_keeps_every_top_logprob_where_completions_merge_equal_texts(server, client, model):
    """Chat's top_logprobs is a list, so tokens that decode alike (pieces of a multi-byte
    character, all U+FFFD) each keep their entry; completions' is OpenAI's text -> logprob dict,
    which keeps the likeliest of equal texts (docs/sampling.md)."""
    messages = [{"role": "user", "content": "count the rivers"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=20, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and all(len(entry.top_logprobs) == 20 for entry in content)
    prompt = httpx.post(f"{server.base_url}/v1/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=20,
                                           extra_body={"ignore_eos": True}).choices[0].logprobs
    assert completion.tokens == [entry.token for entry in content]  # the same greedy tokens
    merged = 0
    for entry, top in zip(content, completion.top_logprobs):
        texts = [t.token for t in entry.top_logprobs]
        assert sorted(top) == sorted(set(texts))
        for text, value in top.items():  # the likeliest of the ids spelled `text`
            assert value == pytest.approx(max(t.logprob for t in entry.top_logprobs if t.token == text), abs=ATOL)
        merged += len(texts) - len(top)
    assert merged > 0  # the tiny byte-level vocabulary has such pieces among any 20


def test_penalties_and_logit_bias_through_the_sdk(server, client, model):
    forced = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=4, temperature=0.8, seed=1,
                                       logit_bias={"42": 100}, logprobs=0)
    assert forced.choices[0].logprobs.tokens == [forced.choices[0].logprobs.tokens[0]] * 4
    assert generate(server, input_ids=PROMPT_IDS, sampling_params={
        "max_new_tokens": 4, "temperature": 0, "logit_bias": {"42": 100}})["output_ids"] == [42] * 4
    base = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    penalised = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=12, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"ignore_eos": True, "repetition_penalty": 1.5})
    assert penalised.usage.completion_tokens == 12 and penalised.choices[0].text != base.choices[0].text
    stop_id = generate(server, input_ids=PROMPT_IDS, sampling_params={
        "max_new_tokens": 1, "temperature": 0, "ignore_eos": True})["output_ids"][0]
    held = client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=8, temperature=0,
                                     extra_body={"min_tokens": 5, "stop_token_ids": [stop_id]})
    assert held.usage.completion_tokens >= 5
    native = generate(server, input_ids=PROMPT_IDS, sampling_params={
        "max_new_tokens": 8, "temperature": 0, "min_new_tokens": 5, "stop_token_ids": [stop_id]})
    assert len(native["output_ids"]) >= 5 and stop_id not in native["output_ids"][:5]


def test_tokenize_round_trip_and_counts(server, client, model):
    text = "The river ran past the mill, and the mill ground the grain."
    with server.client() as http:
        tok = http.post("/v1/tokenize", json={"model": model, "prompt": text}).json()
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] > 0
        assert http.post("/v1/detokenize", json={"model": model, "tokens": tok["tokens"]}).json() == {"prompt": text}
        assert http.post("/tokenize", json={"prompt": text}).json() == tok
        assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"text": text}
        completion = client.completions.create(model=model, prompt=text, max_tokens=1)
        assert completion.usage.prompt_tokens == tok["count"]
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
        chat_tok = http.post("/v1/tokenize", json={"messages": messages}).json()
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
        assert chat.usage.prompt_tokens == chat_tok["count"]
        strs = http.post("/v1/tokenize", json={"prompt": text, "return_token_strs": True}).json()
        assert len(strs["token_strs"]) == tok["count"]


BAD = [
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", None),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"100000": 1}}, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"7": 101}}, None, None),
    ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 3}, "min_tokens", "conflicting_fields"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "conflicting_fields"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs", None),
    ("/generate", {"text": "x", "logprob_start_len": 0}, "logprob_start_len", "conflicting_fields"),
    ("/generate", {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len",
     "conflicting_fields"),
    ("/generate", {"text": "x", "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len", None),
    ("/generate", {"text": "x", "top_logprobs_num": 3}, "top_logprobs_num", "conflicting_fields"),
    ("/generate", {"text": "x", "sampling_params": {"logit_bias": {"abc": 1}}}, "sampling_params.logit_bias", None),
    ("/generate", {"text": "x", "sampling_params": {"min_new_tokens": 200}}, "sampling_params.min_new_tokens",
     "conflicting_fields"),
    ("/v1/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt", None),
    ("/v1/tokenize", {}, "prompt", None),
    ("/v1/detokenize", {"tokens": [100000]}, "tokens", None),
    ("/v1/detokenize", {"tokens": [1], "model": "gpt-4"}, "model", "model_not_found"),
]


@pytest.mark.parametrize("path,body,param,code", BAD)
def test_bad_sampling_inputs_are_refused_by_name(server, path, body, param, code):
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=30)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
