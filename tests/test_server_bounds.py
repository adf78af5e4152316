"""Every request is bounded: what a client may ask for (bodies, batches, sequences, response sizes,
connections) has a limit, and going over it is a 4xx naming the limit while the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

from conftest import ServerProcess
from test_server_errors import assert_error_body

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def bounds_server(server_model_dir, server_workdir):
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--max-request-bytes", "4000",
                          "--context-length", "256", "--max-running-requests", "16"], server_workdir)
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
        for _ in range(10):
            yield b'{"text": "' + b"x" * 1000 if _ == 0 else b"x" * 1000

    with bounds_server.client(timeout=60) as http:
        r = http.post("/generate", content=chunks(), headers={"content-type": "application/json"})
        err = assert_error_body(r, 413, code="request_too_large")
        assert "4000 bytes" in err["message"]
        assert http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
