"""One long prompt holds nobody up, on a real server (CPU, loopback): short requests sent while it
is in prefill finish before its first token, and /health stays 200 all along, because /health is
answered from the engine's heartbeats rather than by a request queued behind the steps. It goes 503
when the engine process is stopped and 200 again when it runs.

Ordering, not wall-clock: 16-token chunks with half of each step reserved make the long prompt's
prefill take 150-300 steps, a short request a handful (with no reserve, every short request here
finished after the long prompt's first token)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time

import httpx
import pytest

from conftest import ServerProcess

pytestmark = pytest.mark.timeout(300)
CHUNK = 16
LONG_PROMPT = [7 + i % 400 for i in range(2500)]
SHORT_CLIENTS = 4
SHORTS_PER_CLIENT = 3
STALL_TIMEOUT_S = 5


@pytest.fixture(scope="module")
def long_prompt_server(server_model_dir, server_workdir):
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu",
                          "--chunked-prefill-size", str(CHUNK), "--chunked-prefill-reserve", "0.5",
                          "--health-stall-timeout-s", str(STALL_TIMEOUT_S)], server_workdir)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def test_short_requests_finish_before_a_long_prompts_first_token(long_prompt_server):
    base = long_prompt_server.base_url
    events: dict[str, float] = {}
    long_done = threading.Event()
    health: list[int] = []

    def long_request() -> None:
        body = {"input_ids": LONG_PROMPT, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True},
                "stream": True}
        with httpx.stream("POST", base + "/generate", json=body, timeout=240) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.setdefault("long_first_token", time.monotonic())
        events["long_done"] = time.monotonic()
        long_done.set()

    def poll_health() -> None:
        with httpx.Client(base_url=base, timeout=30) as http:
            while not long_done.is_set():
                health.append(http.get("/health").status_code)
                time.sleep(0.1)

    def short_client(client: int) -> list[float]:
        """Requests sent one after another, as a chat user would; when each finished."""
        finished = []
        with httpx.Client(base_url=base, timeout=120) as http:
            for i in range(SHORTS_PER_CLIENT):
                if (client + i) % 2:
                    r = http.post("/v1/completions", json={"prompt": [5, 6 + client], "max_tokens": 2,
                                                           "temperature": 0})
                else:
                    r = http.post("/generate", json={"input_ids": [9, 10 + i],
                                                     "sampling_params": {"max_new_tokens": 2}})
                assert r.status_code == 200, r.text
                finished.append(time.monotonic())
        return finished

    with concurrent.futures.ThreadPoolExecutor(SHORT_CLIENTS + 2) as pool:
        long = pool.submit(long_request)
        wait_until(lambda: long_prompt_server.server_info()["stats"].get("running_requests", 0) >= 1 or long.done(),
                   60, "the long prompt is admitted")
        assert "long_first_token" not in events, "the long prompt finished its prefill before the test began"
        prober = pool.submit(poll_health)
        shorts = [pool.submit(short_client, c) for c in range(SHORT_CLIENTS)]
        finished = sorted(t for s in shorts for t in s.result())
        # A medium prompt, longer than the share: it starts in pieces of it beside the long one.
        with httpx.Client(base_url=base, timeout=120) as http:
            medium = http.post("/generate", json={"input_ids": list(range(20, 60)),
                                                  "sampling_params": {"max_new_tokens": 1}})
        assert medium.status_code == 200, medium.text
        medium_done = time.monotonic()
        long.result()
        prober.result()
    assert len(finished) == SHORT_CLIENTS * SHORTS_PER_CLIENT
    assert finished[-1] < events["long_first_token"] and medium_done < events["long_first_token"], \
        (finished[-1], medium_done, events)
    assert health and set(health) == {200}, health
    assert long_prompt_server.server_info()["stats"]["running_requests"] == 0
    with httpx.Client(base_url=base, timeout=60) as http:
        assert http.get("/health_generate").status_code == 200


def test_health_goes_red_while_the_engine_process_is_stopped(long_prompt_server):
    base = long_prompt_server.base_url
    engine_pid = long_prompt_server.server_info()["engine_pid"]
    ok = httpx.get(base + "/health", timeout=10)
    assert ok.status_code == 200 and ok.json()["status"] == "ok", ok.text
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        wait_until(lambda: httpx.get(base + "/health", timeout=10).status_code == 503, 4 * STALL_TIMEOUT_S,
                   "/health is 503 with the engine stopped")
        red = httpx.get(base + "/health", timeout=10)
        assert red.json()["error"]["code"] == "engine_unavailable" and "heartbeat" in red.json()["error"]["message"]
    finally:
        os.kill(engine_pid, signal.SIGCONT)
    wait_until(lambda: httpx.get(base + "/health", timeout=10).status_code == 200, 4 * STALL_TIMEOUT_S,
               "/health is 200 again")
    r = httpx.post(base + "/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}},
                   timeout=60)
    assert r.status_code == 200
