"""Bad input, --api-key, --max-queued-requests and schema fuzzing: 4xx with OpenAI bodies, never 5xx or a hang."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def auth_server(server_model_dir, server_workdir):
    """--api-key with a short context (fuzzed requests stay short)."""
    from conftest import ServerProcess

    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--api-key", "sk-test-key",
                          "--context-length", "64", "--max-running-requests", "16", "--served-model-name", "tiny",
                          "--log-requests"],
                         server_workdir, api_key="sk-test-key")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def fuzz_server(server_model_dir, server_workdir):
    """--api-key with a context of 24 tokens: a fuzzed request generates at most 23."""
    from conftest import ServerProcess

    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--api-key", "sk-fuzz-key",
                          "--context-length", "24", "--max-running-requests", "16", "--served-model-name", "tiny",
                          "--max-request-bytes", str(1 << 20)], server_workdir, api_key="sk-fuzz-key")
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def queue_server(server_model_dir, server_workdir):
    """One request at a time, at most two waiting."""
    from conftest import ServerProcess

    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--max-running-requests", "1",
                          "--max-queued-requests", "2", "--context-length", "128"], server_workdir)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def assert_error_body(response: httpx.Response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:  # a field, or an element of it: "messages[0].role"
        assert err["param"] == param or err["param"].startswith((param + "[", param + ".")), err
    if code is not None:
        assert err["code"] == code, err
    return err


C, CH, G = "/v1/completions", "/v1/chat/completions", "/generate"
USER = [{"role": "user", "content": "hi"}]
# (path, body (a dict, or raw bytes), status, param, code)
BAD_INPUTS = [
    (C, b"{not json", 400, None, None),
    (C, b"", 400, None, None),
    (C, b"[]", 400, None, None),
    (C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature", None),
    (C, {}, 400, "prompt", None),
    (C, {"prompt": 5}, 400, "prompt", None),
    (C, {"prompt": ""}, 400, "prompt", None),
    (C, {"prompt": []}, 400, "prompt", None),
    (C, {"prompt": [1, "a"]}, 400, "prompt", None),
    (C, {"prompt": [-1]}, 400, "prompt", None),
    (C, {"prompt": [10**6]}, 400, "prompt", None),
    (C, {"prompt": [5] * 5000}, 400, "prompt", "context_length_exceeded"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    (C, {"prompt": "x", "max_tokens": -3}, 400, "max_tokens", None),
    (C, {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens", None),
    (C, {"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens", "context_length_exceeded"),
    (C, {"prompt": "x", "max_tokens": 10**30}, 400, "max_tokens", None),
    (C, {"prompt": "x", "model": "no-such-model"}, 404, "model", "model_not_found"),
    (C, {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    (C, {"prompt": "x", "top_p": 1.5}, 400, "top_p", None),
    (C, {"prompt": "x", "top_k": -2}, 400, "top_k", None),
    (C, {"prompt": "x", "temperature": 2.5}, 400, "temperature", None),
    # Strict types: no numeric strings or bools taken for numbers, no strings for bools.
    (C, {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens", None),
    (C, {"prompt": "x", "max_tokens": True}, 400, "max_tokens", None),
    (C, {"prompt": "x", "stream": "yes"}, 400, "stream", None),
    (C, {"prompt": "x", "echo": 1}, 400, "echo", None),
    (C, b'{"prompt": "x", "temperature": Infinity}', 400, "temperature", None),
    (C, b'{"prompt": "x", "temperature": 1e400}', 400, "temperature", None),
    (C, {"prompt": "x", "suffix": "tail"}, 400, "suffix", "unsupported_parameter"),
    (C, {"prompt": "x", "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    (C, {"prompt": "x", "n": 0}, 400, "n", None),
    (C, {"prompt": "x", "n": 100000}, 400, "n", None),
    (C, {"prompt": "x", "stop": [""]}, 400, None, None),
    (C, {"prompt": "x", "stop": 7}, 400, "stop", None),
    (C, {"prompt": "x", "seed": 2**70}, 400, "seed", None),
    (C, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids", None),
    (C, {"prompt": "x", "logprobs": 30}, 400, "logprobs", None),
    (C, {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", None),
    (C, {"prompt": "x", "stream": "yes please"}, 400, "stream", None),
    (C, {"prompt": "x", "stream_options": {"include_usage": "x"}}, 400, None, None),
    (CH, {}, 400, "messages", None),
    (CH, {"messages": []}, 400, "messages", None),
    (CH, {"messages": "hi"}, 400, "messages", None),
    (CH, {"messages": [{"content": "no role"}]}, 400, None, None),
    (CH, {"messages": [{"role": "alien", "content": "x"}]}, 400, "messages[0].role", None),
    (CH, {"messages": [{"role": "user", "content": 42}]}, 400, None, None),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, None, "unsupported_parameter"),
    (CH, {"messages": USER, "model": "gpt-4"}, 404, "model", "model_not_found"),
    (CH, {"messages": USER, "max_tokens": 0}, 400, "max_tokens", None),
    (CH, {"messages": USER, "max_completion_tokens": 10**6}, 400, "max_completion_tokens", None),
    (CH, {"messages": USER, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, 400, None, None),
    (CH, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f g"}}]}, 400, None, None),
    (CH, {"messages": USER, "response_format": {"type": "xml"}}, 400, "response_format.type", None),
    (CH, {"messages": USER, "response_format": {"type": "json_schema"}}, 400, "response_format.json_schema",
     None),
    (CH, {"messages": USER, "logprobs": "yes"}, 400, "logprobs", None),
    (CH, {"messages": USER, "top_logprobs": 3}, 400, "top_logprobs", "conflicting_fields"),
    (G, {"text": "x", "logprob_start_len": 0}, 400, "logprob_start_len", "conflicting_fields"),
    (G, {"text": "x", "return_logprob": True, "logprob_start_len": "0"}, 400, "logprob_start_len", None),
    (CH, {"messages": [{"role": "user", "content": "word " * 5000}]}, 400, "messages", "context_length_exceeded"),
    (G, {}, 400, None, None),
    (G, {"text": "x", "input_ids": [1]}, 400, None, None),
    (G, {"text": "x", "sampling_params": {"bogus": 1}}, 400, "sampling_params", None),
    (G, {"text": "x", "sampling_params": {"max_new_tokens": -5}}, 400, "sampling_params", None),
    (G, {"text": "x", "sampling_params": {"max_new_tokens": "x"}}, 400, "sampling_params", None),
    (G, {"text": "x", "sampling_params": {"seed": 2**70}}, 400, None, None),
    (G, {"text": "x", "sampling_params": {"temperature": -2}}, 400, "sampling_params", None),
    (G, {"text": "x", "sampling_params": [{}, {}]}, 400, "sampling_params", None),
    (G, {"text": []}, 400, None, None),
    (G, {"input_ids": []}, 400, None, None),
    (G, {"input_ids": [[1], []]}, 400, None, None),
    (G, {"text": "x", "sampling_params": {"max_new_tokens": True}}, 400, "sampling_params.max_new_tokens", None),
    (G, {"text": "x", "sampling_params": {"seed": "7"}}, 400, "sampling_params.seed", None),
]
# Fields other servers implement and this one does not: refused by name, never ignored.
UNSUPPORTED_FIELDS = {"regex": "[a-z]+", "ebnf": "root ::= 'a'",
                      "priority": 1, "lora_path": "adapter", "chat_template_kwargs": {"enable_thinking": False},
                      "json_schema": "{}", "no_stop_trim": True}
# Served, but only in /generate's sampling_params (grammars), only on chat (template variables),
# or both (SGLang's chat fields regex and ebnf).
GENERATE_SAMPLING_ONLY = {"regex", "ebnf", "json_schema"}
CHAT_ONLY = {"chat_template_kwargs"}
CHAT_TOO = {"regex", "ebnf"}
for _name, _value in UNSUPPORTED_FIELDS.items():
    BAD_INPUTS += [(C, {"prompt": "x", _name: _value}, 400, _name, "unsupported_parameter"),
                   (G, {"text": "x", _name: _value}, 400, _name, "unsupported_parameter")]
    if _name not in CHAT_ONLY | CHAT_TOO:
        BAD_INPUTS.append((CH, {"messages": USER, _name: _value}, 400, _name, "unsupported_parameter"))
    if _name not in GENERATE_SAMPLING_ONLY | CHAT_ONLY:
        BAD_INPUTS.append((G, {"text": "x", "sampling_params": {_name: _value}}, 400, f"sampling_params.{_name}",
                           "unsupported_parameter"))
# A lone surrogate is valid JSON but no text: 400 naming the field, streaming or not.
LONE_SURROGATE = '"a\\ud800b"'
for _stream in ("false", "true"):
    BAD_INPUTS += [
        (C, f'{{"prompt": {LONE_SURROGATE}, "stream": {_stream}}}'.encode(), 400, "prompt", None),
        (C, f'{{"prompt": ["ok", {LONE_SURROGATE}], "stream": {_stream}}}'.encode(), 400, "prompt[1]", None),
        (CH, f'{{"messages": [{{"role": "user", "content": {LONE_SURROGATE}}}], "stream": {_stream}}}'.encode(),
         400, "messages[0].content", None),
        (CH, f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": {LONE_SURROGATE}}}]}}], '
             f'"stream": {_stream}}}'.encode(), 400, "messages[0].content", None),
        (G, f'{{"text": {LONE_SURROGATE}, "stream": {_stream}}}'.encode(), 400, "text", None),
        (C, f'{{"prompt": "x", "stop": [{LONE_SURROGATE}], "stream": {_stream}}}'.encode(), 400, "stop", None),
    ]


@pytest.mark.parametrize("path,body,status,param,code", BAD_INPUTS,
                         ids=[f"{i}-{p.strip('/').replace('/', '_')}" for i, (p, *_rest) in enumerate(BAD_INPUTS)])
def test_bad_input(server, path, body, status, param, code):
    with server.client(timeout=30) as http:
        if isinstance(body, bytes):
            r = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = http.post(path, json=body)
        assert_error_body(r, status, param, code)


def test_server_still_serves_after_bad_inputs(server):
    with server.client(timeout=30) as http:
        assert_error_body(http.get("/v1/completions"), 405)
        assert_error_body(http.get("/no/such/path"), 404)
        ok = http.post("/v1/completions", json={"prompt": "still here?", "max_tokens": 3, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert http.get("/health").status_code == 200
        stats = http.get("/server_info").json()["stats"]
        assert stats["running_requests"] == 0 and stats["queued_requests"] == 0


def test_openai_sdk_errors(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=client.models.list().data[0].id, prompt="x", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


def test_schema_allows_what_the_server_accepts(server):
    """Values the OpenAPI schema allows are served: seed -1, top_k 0 (off), an empty suffix, best_of == n."""
    with server.client(timeout=60) as http:
        for extra in ({"seed": -1, "temperature": 1.0}, {"seed": -(2**63), "temperature": 1.0}, {"top_k": 0},
                      {"suffix": ""}, {"n": 2, "best_of": 2}, {"temperature": 2.0}, {"presence_penalty": 0}):
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **extra})
            assert r.status_code == 200, (extra, r.text)
        r = http.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2, "top_k": 0, "seed": -5}})
        assert r.status_code == 200, r.text


def test_bad_text_keeps_the_connection(server):
    """A 400 for a lone surrogate, then the next request on the same keep-alive connection is served."""
    with server.client(timeout=60) as http:
        for body in (b'{"prompt": "a\\ud800b", "max_tokens": 2}', b'{"prompt": "a\\ud800b", "stream": true}'):
            bad = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            assert_error_body(bad, 400, "prompt")
            ok = http.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_request_size_limits(auth_server):
    """A body over --max-request-bytes (default: 64 bytes per context token, 4,096 for 64) is a 413;
    a prompt longer in characters than any prompt the context can hold is refused before tokenizing."""
    with auth_server.client(timeout=60) as http:
        big = http.post("/generate", json={"text": "word " * 1000})  # > 4,096 bytes
        assert_error_body(big, 413, code="request_too_large")
        # Under the body limit, but longer than 64 tokens of this vocabulary (13 characters at most) spell.
        for path, body in (("/generate", {"text": "abcdefghijklmnopqrstuvwxyz" * 40}),
                           ("/v1/completions", {"prompt": "abcdefghijklmnopqrstuvwxyz" * 40}),
                           ("/v1/completions", {"prompt": ["ok", "abcdefghijklmnopqrstuvwxyz" * 40]})):
            err = assert_error_body(http.post(path, json=body), 400, code="context_length_exceeded")
            assert "characters" in err["message"], err  # the early bound answered, not the tokenizer
        assert http.get("/v1/models").status_code == 200


def test_rejected_requests_are_counted_and_logged(auth_server):
    secret = "my-secret-prompt-text"
    with auth_server.client(timeout=60) as http:
        before = http.get("/metrics").text
        for _ in range(2):
            r = http.post("/v1/completions", json={"prompt": secret, "regex": "[a-z]+"})
            assert_error_body(r, 400, "regex", "unsupported_parameter")
        assert_error_body(http.post("/v1/completions", json={"prompt": secret, "model": "other"}), 404)
        assert_error_body(http.post("/generate", json={"text": secret * 400}), 413)
    assert_error_body(httpx.get(auth_server.base_url + "/v1/models", timeout=10), 401)
    metrics = httpx.get(auth_server.base_url + "/metrics", headers=auth_server.headers, timeout=10).text

    def count(labels: str, text: str) -> float:
        prefix = f"radixserve:rejected_requests_total{{{labels}}} "
        return next((float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix)), 0.0)

    for labels, n in (('reason="unsupported_parameter",status="400"', 2), ('reason="model_not_found",status="404"', 1),
                      ('reason="request_too_large",status="413"', 1), ('reason="invalid_api_key",status="401"', 1)):
        assert count(labels, metrics) - count(labels, before) == n, (labels, metrics)
    log = auth_server.output()
    assert ("Request rejected. path: /v1/completions, status: 400, reason: unsupported_parameter, "
            "param: regex") in log
    assert "Request rejected. path: /v1/models, status: 401, reason: invalid_api_key" in log
    assert secret not in log


# ---------------------------------------------------------------------------------------------- --api-key
def test_api_key(auth_server):
    base = auth_server.base_url
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("POST", "/generate"), ("GET", "/metrics"), ("GET", "/server_info"), ("GET", "/tokenizer"),
                         ("POST", "/flush_cache"), ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/nowhere")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-test-key"}):
            r = httpx.request(method, base + path, headers=headers, json={"prompt": "x"}, timeout=10)
            err = assert_error_body(r, 401, code="invalid_api_key")
            assert "sk-test-key" not in r.text and "tiny" not in r.text
    assert httpx.get(base + "/health", timeout=30).status_code == 200  # open for load balancers
    good = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-test-key", max_retries=0)
    assert good.models.list().data[0].id == "tiny"
    assert good.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="sk-wrong", max_retries=0).models.list()
    for scheme in ("bearer", "BEARER", "Bearer"):  # the scheme is case-insensitive (RFC 9110)
        r = httpx.get(base + "/v1/models", headers={"Authorization": f"{scheme} sk-test-key"}, timeout=10)
        assert r.status_code == 200, (scheme, r.text)
    info = httpx.get(base + "/server_info", headers=auth_server.headers, timeout=10).json()
    assert info["settings"]["api_key"] == "***"
    del err


# ---------------------------------------------------------------------------------------------- queue limit
def test_queue_limit_503_then_recovers(queue_server):
    body = {"prompt": "The river ran past the old mill", "max_tokens": 100, "temperature": 0, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=queue_server.base_url, timeout=60) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(12)))

    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    # Two fit in the waiting queue; a third is served when the engine admitted one before the
    # rest arrived (timing-dependent).
    assert codes.count(200) >= 2 and codes.count(503) >= 1, codes
    assert set(codes) <= {200, 503}
    for r in responses:
        if r.status_code == 503:
            assert_error_body(r, 503, code="queue_full")
            assert int(r.headers["retry-after"]) >= 1
        else:
            assert r.json()["usage"]["completion_tokens"] == 100
    # Recovers: the queue drained, a new request is served.
    again = httpx.post(f"{queue_server.base_url}/v1/completions", json=body, timeout=60)
    assert again.status_code == 200
    metrics = httpx.get(f"{queue_server.base_url}/metrics").text
    assert 'radixserve:rejected_requests_total{reason="queue_full",status="503"}' in metrics


# ---------------------------------------------------------------------------------------------- fuzzing
FUZZ_OPERATIONS = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/generate", "POST"),
                   ("/v1/models", "GET"), ("/server_info", "GET"), ("/flush_cache", "POST"), ("/health", "GET"),
                   ("/metrics", "GET"), ("/get_model_info", "GET"), ("/tokenizer", "GET"),
                   ("/v1/tokenize", "POST"), ("/v1/detokenize", "POST"), ("/tokenize", "POST"),
                   ("/detokenize", "POST")]
# Schema-valid requests the schema cannot tell from servable ones, because JSON Schema bounds each
# field and not their relations: a prompt plus max_tokens past the model's context (a 400, as
# OpenAI answers it), a conversation the chat template renders longer than any prompt the context
# takes, or two fields that contradict each other; nor can it say which strings are grammars (an
# `ebnf` or `regex` that does not parse).
CONTEXT_DEPENDENT_CODES = ("context_length_exceeded", "template_limit", "conflicting_fields", "invalid_grammar")


def positive_data_accepted_unless_context_bound(ctx, response, case):
    """schemathesis' positive_data_acceptance, except for `CONTEXT_DEPENDENT_CODES`."""
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    if response.status_code == 400 and response.json()["error"]["code"] in CONTEXT_DEPENDENT_CODES:
        return None
    return positive_data_acceptance(ctx, response, case)


@pytest.mark.parametrize("path,method", FUZZ_OPERATIONS)
def test_fuzz_openapi_all_checks(fuzz_server, path, method):
    """schemathesis with every default check (status codes, content types, response schemas,
    negative data rejected, positive data accepted, auth not ignored), not only "no 5xx"."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    spec = httpx.get(f"{fuzz_server.base_url}/openapi.json", headers=fuzz_server.headers, timeout=10).json()
    schema = schemathesis.openapi.from_dict(spec)
    operation = schema[path][method]
    modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
    strategy = st.one_of(*(operation.as_strategy(generation_mode=mode) for mode in modes))
    examples = 20 if method == "POST" and path != "/flush_cache" else 4
    seen = []

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case):
        response = case.call(base_url=fuzz_server.base_url, headers=fuzz_server.headers, timeout=60)
        seen.append(response.status_code)
        case.validate_response(response, headers=fuzz_server.headers,
                               excluded_checks=[positive_data_acceptance],
                               additional_checks=[positive_data_accepted_unless_context_bound],
                               transport_kwargs={"base_url": fuzz_server.base_url})
        if response.status_code >= 400:
            assert set(json.loads(response.text)) == {"error"}

    run()
    assert seen
    assert httpx.get(f"{fuzz_server.base_url}/health", timeout=30).status_code == 200
