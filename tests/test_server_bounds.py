"""Every request is bounded: what a client may ask for (bodies, batches, sequences, response sizes,
connections) has a limit, and going over it is a 4xx naming the limit while the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from conftest import ServerProcess
from test_server_errors import assert_error_body

pytestmark = pytest.mark.timeout(300)
REQUEST_LIMIT = 60000
MAX_CONNECTIONS = 12


@pytest.fixture(scope="module")
def bounds_server(server_model_dir, server_workdir):
    # Chunks of 16 tokens: a 4,000-token prompt takes 250 steps (a long prompt beside short ones is
    # test_long_prompt_server.py's).
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--max-request-bytes",
                          str(REQUEST_LIMIT), "--chunked-prefill-size", "16", "--max-running-requests", "16",
                          "--max-connections", str(MAX_CONNECTIONS)],
                         server_workdir)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_form_encoded_body_is_415_naming_the_content_type(bounds_server):
    """curl -d sends application/x-www-form-urlencoded; the answer says to send JSON."""
    with bounds_server.client(timeout=60) as http:
        for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/v1/tokenize"):
            r = http.post(path, content=b'{"prompt": "hi", "max_tokens": 2}',
                          headers={"content-type": "application/x-www-form-urlencoded"})
            err = assert_error_body(r, 415, "Content-Type", "unsupported_media_type")
            assert "application/x-www-form-urlencoded" in err["message"] and "application/json" in err["message"]
        r = http.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}')  # no Content-Type
        assert "not none" in assert_error_body(r, 415, "Content-Type")["message"]
        r = http.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}',
                      headers={"content-type": "application/json; charset=utf-8"})
        assert r.status_code == 200, r.text


def test_chunked_body_over_the_limit_is_413(bounds_server):
    def chunks():
        yield b'{"text": "'
        for _ in range(REQUEST_LIMIT // 1000 + 10):
            yield b"x" * 1000

    with bounds_server.client(timeout=60) as http:
        r = http.post("/generate", content=chunks(), headers={"content-type": "application/json"})
        err = assert_error_body(r, 413, code="request_too_large")
        assert f"{REQUEST_LIMIT} bytes" in err["message"]
        assert http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def test_batches_and_prompts_times_n_are_capped(bounds_server):
    with bounds_server.client(timeout=120) as http:
        for body, param in (({"text": ["a"] * 10000}, "text"), ({"input_ids": [[5]] * 10000}, "input_ids")):
            err = assert_error_body(http.post("/generate", json=body), 400, param, "too_many_sequences")
            assert "10000 prompts is 10000 sequences" in err["message"] and "--max-request-sequences" in err["message"]
        err = assert_error_body(http.post("/v1/completions", json={"prompt": ["hi"] * 40, "n": 64, "max_tokens": 1}),
                                400, "prompt", "too_many_sequences")
        assert "40 prompts x n=64 is 2560 sequences" in err["message"] and "at most 2048" in err["message"]
        ok = http.post("/v1/completions", json={"prompt": ["hi", "there"], "n": 2, "max_tokens": 1})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4
        assert http.get("/health").status_code == 200


def test_tokenize_and_detokenize_are_bounded(bounds_server):
    with bounds_server.client(timeout=60) as http:
        big = assert_error_body(http.post("/v1/tokenize", json={"prompt": "x" * 59000}), 400, "prompt",
                                "context_length_exceeded")
        assert "59000 characters" in big["message"]
        for body, param in (({"prompt": 5}, "prompt"), ({"messages": "hi"}, "messages"), ({}, "prompt"),
                            ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt")):
            assert_error_body(http.post("/v1/tokenize", json=body), 400, param)
        long = assert_error_body(http.post("/v1/detokenize", json={"tokens": [5] * 5000}), 400, "tokens",
                                 "context_length_exceeded")
        assert "at most this model's context length, 4096" in long["message"]
        for tokens in ([-1], ["a"], [10**6], [1.5], None):
            assert_error_body(http.post("/v1/detokenize", json={"tokens": tokens}), 400, "tokens")
            assert_error_body(http.post("/detokenize", json={"tokens": tokens}), 400, "tokens")
        assert http.post("/v1/detokenize", json={"tokens": [5] * 4096}).status_code == 200
        assert http.post("/v1/tokenize", json={"prompt": "hello"}).json()["count"] > 0


def test_slow_and_idle_connections_are_cut_off_and_capped(bounds_server):
    """A request whose headers trickle in (a byte a second) gets 408 after HEADER_TIMEOUT_S; idle
    connections beyond --max-connections are answered 503 as they open; once the slow ones are
    cut off, new clients are served."""
    import select
    import socket
    import time

    from radixserve.http_common.paced_http import HEADER_TIMEOUT_S

    def connect() -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", bounds_server.port), timeout=HEADER_TIMEOUT_S + 30)
        return sock

    def read_all(sock: socket.socket) -> bytes:
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data

    opened = time.monotonic()
    idle, refused = [], None
    for _ in range(MAX_CONNECTIONS + 2):
        sock = connect()
        sock.settimeout(0.5)
        try:
            answer = sock.recv(65536)  # an idle connection under the cap gets nothing yet
        except socket.timeout:
            sock.settimeout(HEADER_TIMEOUT_S + 30)
            idle.append(sock)
            continue
        refused = answer + read_all(sock)
        break
    assert refused is not None and len(idle) <= MAX_CONNECTIONS, len(idle)
    assert refused.startswith(b"HTTP/1.1 503") and b"too_many_connections" in refused, refused
    trickle = idle.pop()
    for byte in b"POST /generate HTTP/1.1\r\nHost: x\r\n":
        if select.select([trickle], [], [], HEADER_TIMEOUT_S / 8)[0]:
            break  # the server answered: cut off
        try:
            trickle.send(bytes([byte]))
        except OSError:
            break
    answers = [read_all(sock) for sock in [trickle, *idle]]
    waited = time.monotonic() - opened
    assert all(a.startswith(b"HTTP/1.1 408") and b"request_timeout" in a for a in answers), answers
    assert HEADER_TIMEOUT_S - 1 <= waited <= HEADER_TIMEOUT_S + 20, waited
    for sock in [trickle, *idle]:
        sock.close()
    assert httpx.get(f"{bounds_server.base_url}/health", timeout=30).status_code == 200


def test_log_probability_volume_is_bounded_up_front(bounds_server):
    prompt = [7 + i % 400 for i in range(4000)]
    with bounds_server.client(timeout=120) as http:
        r = http.post("/v1/completions", json={"prompt": prompt, "echo": True, "logprobs": 20, "n": 64,
                                               "max_tokens": 1})
        err = assert_error_body(r, 400, "logprobs", "response_too_large")
        assert "lower logprobs, n, max_tokens, echo" in err["message"], err
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                                    "top_logprobs": 20, "n": 64, "max_tokens": 2000})
        assert_error_body(r, 400, "top_logprobs", "response_too_large")
        r = http.post("/generate", json={"input_ids": [[5, 6]] * 64, "return_logprob": True, "top_logprobs_num": 20,
                                         "sampling_params": {"max_new_tokens": 2000}})
        assert_error_body(r, 400, "top_logprobs_num", "response_too_large")
        ok = http.post("/v1/completions", json={"prompt": prompt[:100], "echo": True, "logprobs": 5, "n": 2,
                                                "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["tokens"]) == 102, ok.text


def test_logit_bias_keys_are_decimal_token_ids_without_leading_zeros(bounds_server):
    with bounds_server.client(timeout=60) as http:
        for key in ("05", "00", "\u0663", "+5", " 5"):
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logit_bias": {key: 1}})
            assert_error_body(r, 400, "logit_bias")
        for key in ("0", "5", "50"):
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logit_bias": {key: 1}})
            assert r.status_code == 200, (key, r.text)


def test_schema_and_behaviour_agree_on_fuzzed_edges(bounds_server):
    """Values the served schema allows are served, and what it refuses is a 400 naming the field:
    an empty sampling_params list, top_logprobs 0 without logprobs, max_tokens past the context,
    a repetition_penalty so small that logits overflow (NaN and an empty answer, before)."""
    spec = httpx.get(f"{bounds_server.base_url}/openapi.json", timeout=30).json()
    schemas = spec["components"]["schemas"]
    sp = schemas["GenerateBody"]["properties"]["sampling_params"]["anyOf"]
    assert any(branch.get("type") == "array" and branch.get("minItems") == 1 for branch in sp), sp
    longest = 4096 - 1  # the context leaves a one-token prompt this many
    for model, field in (("CompletionRequest", "max_tokens"), ("ChatCompletionRequest", "max_tokens"),
                         ("ChatCompletionRequest", "max_completion_tokens"), ("NativeSamplingParams", "max_new_tokens")):
        assert schemas[model]["properties"][field]["maximum"] == longest, (model, field)
    for model in ("CompletionRequest", "NativeSamplingParams"):
        penalty = schemas[model]["properties"]["repetition_penalty"]
        assert any(b.get("minimum") == 0.01 for b in penalty.get("anyOf", [penalty])), penalty
    with bounds_server.client(timeout=60) as http:
        assert_error_body(http.post("/generate", json={"text": "x", "sampling_params": []}), 400, "sampling_params")
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                    "top_logprobs": 0, "logprobs": None})
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text
        assert_error_body(http.post("/v1/completions", json={"prompt": "x", "max_tokens": longest + 1}), 400,
                          "max_tokens", "context_length_exceeded")
        for path, body, param in (
                ("/v1/completions", {"prompt": "x", "max_tokens": 2, "repetition_penalty": 1e-300}, "repetition_penalty"),
                ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2, "repetition_penalty": 1e-300}},
                 "sampling_params.repetition_penalty")):
            assert_error_body(http.post(path, json=body), 400, param)
        r = http.post("/v1/completions", json={"prompt": "a b a b", "max_tokens": 4, "repetition_penalty": 0.01,
                                               "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
