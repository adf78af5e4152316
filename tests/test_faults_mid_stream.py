"""Faults while requests stream, against real server processes: a tensor-parallel rank killed
mid-stream (every client gets an error body, the server ends with one line naming the rank) and
`/flush_cache` sent over and over while streams run (refused or served, never corrupting: the
streams' tokens equal those of the same requests run alone, and every KV slot, device and host
tier, comes back)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time

import httpx
import pytest

from conftest import ServerProcess
from test_server_lifecycle import children_of, pid_alive

pytestmark = pytest.mark.timeout(300)


def stream_events(base_url: str, body: dict, started: threading.Event, timeout: float = 120) -> list[dict]:
    """The data events of one streamed completion, read to its end; `started` is set once two
    token events have arrived."""
    events = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json={**body, "stream": True}, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[len("data: "):]))
            if sum(1 for e in events if isinstance(e, dict) and "choices" in e) >= 2:
                started.set()
    return events


def test_a_rank_killed_mid_stream_gives_every_client_an_error_body(server_model_dir, server_workdir):
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--tp-size", "2",
                          "--max-total-tokens", "8192"], server_workdir).wait_ready()
    long = {"max_tokens": 3000, "ignore_eos": True}
    try:
        engine_pid = proc.server_info()["engine_pid"]
        (rank,) = children_of(engine_pid)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            started = [threading.Event() for _ in range(3)]
            streams = [pool.submit(stream_events, proc.base_url, {"prompt": f"stream {i}", **long}, started[i])
                       for i in range(3)]
            plain = pool.submit(httpx.post, f"{proc.base_url}/v1/completions", json={"prompt": "plain", **long},
                                timeout=120)
            for event in started:
                assert event.wait(120), "a stream never started"
            os.kill(rank, signal.SIGKILL)
            killed_at = time.monotonic()
            for future in streams:
                events = future.result(timeout=60)
                assert events[-1] == "[DONE]", events[-3:]
                error = events[-2]["error"]
                assert error["code"] == "engine_unavailable" and error["type"] == "service_unavailable_error", error
            response = plain.result(timeout=60)
            assert response.status_code == 503 and response.json()["error"]["code"] == "engine_unavailable", \
                response.text
            assert time.monotonic() - killed_at < 30
        code = proc.proc.wait(30)
    finally:
        if pid_alive(rank):
            os.kill(rank, signal.SIGKILL)
        proc.stop(timeout_s=20)
    assert code != 0
    output = proc.output_path.read_text()
    # One line naming the rank, not the failed collective's traceback (before: "engine loop
    # crashed" and gloo's "Connection closed by peer" in 40 frames).
    assert f"tensor-parallel rank 1 (pid {rank}) exited (killed by signal 9)" in output, output[-3000:]
    assert "Traceback" not in output and "engine loop crashed" not in output, output[-3000:]
    assert not pid_alive(engine_pid)


@pytest.fixture(scope="module")
def tiered_server(server_model_dir, server_workdir):
    """A small device pool over a small host tier: streams evict prefixes to the host and load them back."""
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--max-total-tokens", "600",
                          "--hicache-size", "0.001", "--max-running-requests", "8"], server_workdir)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def idle_stats(server: ServerProcess, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.server_info()["stats"]
        if not stats["running_requests"] and not stats["queued_requests"] and not stats["loading_tokens"]:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


def test_flush_cache_while_streams_run_never_corrupts_them(tiered_server):
    prefixes = ["The first shared preamble of this test, long enough to be cached. " * 3,
                "Another preamble, which the host tier keeps when the device pool evicts it. " * 3]
    bodies = [{"prompt": prefixes[i % 2] + f"question {i}", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
              for i in range(8)]
    with tiered_server.client(timeout=120) as http:
        expected = [http.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]
        assert idle_stats(tiered_server)["host_cached_tokens"] > 0  # the small pool evicted to the host tier

        flushes: list[int] = []
        done = threading.Event()

        def flush_forever() -> None:
            with tiered_server.client(timeout=60) as admin:
                while not done.is_set():
                    flushes.append(admin.post("/flush_cache").status_code)
                    time.sleep(0.02)

        with concurrent.futures.ThreadPoolExecutor(len(bodies) + 1) as pool:
            flusher = pool.submit(flush_forever)
            futures = []
            for round_ in range(2):  # two waves with gaps between, so some flushes land while idle
                started = [threading.Event() for _ in bodies]
                futures += [pool.submit(stream_events, tiered_server.base_url, b, started[i])
                            for i, b in enumerate(bodies)]
                for future in futures[-len(bodies):]:
                    future.result(timeout=120)
                time.sleep(0.3)
            done.set()
            flusher.result(timeout=60)
        for i, future in enumerate(futures):
            events = future.result()
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1] if isinstance(e, dict))
            text = "".join(c["text"] for e in events[:-1] for c in e["choices"])
            assert text == expected[i % len(bodies)], i
        assert set(flushes) <= {200, 409} and 409 in flushes and 200 in flushes, flushes

        stats = idle_stats(tiered_server)
        assert stats["held_by_running_tokens"] == 0 and stats["protected_tokens"] == 0, stats
        assert stats["free_tokens"] + stats["evictable_tokens"] == stats["pool_tokens"], stats
        assert stats["host_free_tokens"] + stats["host_cached_tokens"] == stats["host_pool_tokens"], stats
        assert http.post("/flush_cache").status_code == 200
        stats = tiered_server.server_info()["stats"]
        assert stats["free_tokens"] == stats["pool_tokens"] and stats["evictable_tokens"] == 0, stats
        assert stats["host_free_tokens"] == stats["host_pool_tokens"] and stats["host_cached_tokens"] == 0, stats
