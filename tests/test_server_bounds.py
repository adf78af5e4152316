"""Every request is bounded: what a client may ask for (bodies, batches, sequences, response sizes,
connections) has a limit, and going over it is a 4xx naming the limit while the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from conftest import ServerProcess
from test_server_errors import assert_error_body

pytestmark = pytest.mark.timeout(300)
REQUEST_LIMIT = 60000


@pytest.fixture(scope="module")
def bounds_server(server_model_dir, server_workdir):
    # Chunks of 16 tokens: a 4,000-token prompt takes 250 steps, long enough to send others beside it.
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--max-request-bytes",
                          str(REQUEST_LIMIT), "--chunked-prefill-size", "16", "--max-running-requests", "16"],
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


def test_short_request_is_served_beside_a_long_prompt(bounds_server):
    """A 2-token request sent while a 4,000-token prompt is mid-way through its chunks is served in
    a few steps: each chunk leaves room in the step for it, instead of it waiting for all 250."""
    import concurrent.futures
    import time

    def post_timed(body: dict) -> tuple[httpx.Response, float]:
        response = http.post("/generate", json=body)
        return response, time.monotonic()

    with bounds_server.client(timeout=120) as http, concurrent.futures.ThreadPoolExecutor(1) as pool:
        long = pool.submit(post_timed, {"input_ids": [7 + i % 400 for i in range(4000)],
                                        "sampling_params": {"max_new_tokens": 1}})
        deadline = time.monotonic() + 60
        while bounds_server.server_info()["stats"]["running_requests"] < 1:
            assert time.monotonic() < deadline and not long.done(), "the long prompt never showed as running"
            time.sleep(0.02)
        sent = time.monotonic()
        short, short_done = post_timed({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}})
        long_response, long_done = long.result()
        assert short.status_code == 200 and long_response.status_code == 200, (short.text, long_response.text)
        # Served beside the long prompt, the short request takes a few steps of its 250; behind it,
        # all that were left.
        assert short_done - sent < (long_done - sent) / 2, (short_done - sent, long_done - sent)
        assert http.get("/health").status_code == 200
