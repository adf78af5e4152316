"""Hardening against careless and hostile clients, against a real server process: request ids are
labels, log lines cannot be forged, the queue limit never sheds a burst an idle server can run,
SIGTERM drains with a deadline, a dead engine ends the server, admin endpoints take their own key
and /kv_events carries no token id."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import signal
import threading
import time

import httpx
import pytest

from conftest import ServerProcess

pytestmark = pytest.mark.timeout(300)

LONG = {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}
HEX16 = re.compile(r"^[0-9a-f]{16}$")


def wait_until(predicate, timeout_s: float, what: str, extra=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}{extra()}")
        time.sleep(0.05)


def stats(proc: ServerProcess) -> dict:
    return proc.server_info()["stats"]


def running(proc: ServerProcess) -> int:
    return stats(proc)["running_requests"]


def wait_idle(proc: ServerProcess) -> dict:
    wait_until(lambda: running(proc) == 0 and stats(proc)["queued_requests"] == 0, 20.0, "the engine is idle")
    return stats(proc)


@pytest.fixture(scope="module")
def logged_server(server_model_dir, server_workdir):
    log_file = server_workdir / "hardening.log"
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--log-requests",
                          "--log-file", str(log_file), "--max-total-tokens", "32768"], server_workdir)
    proc.log_file = log_file
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


# ---------------------------------------------------------------------------------------------- request ids
def test_client_rid_is_a_label_that_never_reaches_another_request(logged_server):
    base = logged_server.base_url
    first = {"text": "The weather today is sunny", "rid": "R", "stream": True, "sampling_params": LONG}
    with httpx.Client(base_url=base, timeout=60) as http:
        with http.stream("POST", "/generate", json=first) as stream:
            lines = stream.iter_lines()  # held: closing the iterator would close the stream
            assert next(line for line in lines if line.startswith("data: "))
            wait_until(lambda: running(logged_server) == 1, 10.0, "the first request runs",
                       lambda: f": {logged_server.server_info()}")
        # The connection is dropped mid-stream; the same rid is sent again at once.
    second = httpx.post(base + "/generate", timeout=60, json={
        "text": "The weather today is sunny", "rid": "R",
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}})
    assert second.status_code == 200, second.text
    out = second.json()
    assert out["meta_info"]["id"] == "R"  # the label comes back ...
    assert out["meta_info"]["finish_reason"]["type"] == "length"  # ... with this request's own tokens
    assert out["meta_info"]["completion_tokens"] == 5 and len(out["output_ids"]) == 5
    idle = wait_idle(logged_server)
    assert idle["held_by_running_tokens"] == 0 and idle["protected_tokens"] == 0  # no orphan left running
    assert logged_server.server_info()["in_flight_requests"] == 0
    # Two requests with one label at once are two requests.
    with httpx.Client(base_url=base, timeout=60) as http:
        both = [http.post("/generate", json={"text": f"twin {i}", "rid": "twin",
                                             "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
                for i in range(2)]
    assert [r.status_code for r in both] == [200, 200]
    for bad in ("x" * 129, "", "x\nRequest finished. id: forged", "tab\there", "bell\x07"):
        r = httpx.post(base + "/generate", json={"text": "a", "rid": bad, "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "rid", (bad, r.text)
    assert httpx.post(base + "/generate", json={"text": "a", "rid": "x" * 128,
                                                "sampling_params": {"max_new_tokens": 1}}).status_code == 200


# ---------------------------------------------------------------------------------------------- log lines
def test_log_lines_cannot_be_forged(logged_server):
    forged = {"text": "a", "rid": "x\nRequest finished. id: forged", "sampling_params": {"max_new_tokens": 2}}
    httpx.post(logged_server.base_url + "/generate", json=forged, timeout=30)
    label = "label Request finished. id: forged"  # printable: accepted, and logged on its own line's end
    r = httpx.post(logged_server.base_url + "/generate", json={**forged, "rid": label}, timeout=30)
    assert r.status_code == 200
    wait_until(lambda: label in logged_server.log_file.read_text(), 10.0, "the labelled request is logged")
    for line in logged_server.log_file.read_text().splitlines():
        assert re.match(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \d+ [A-Z]+\] ", line), line


def test_every_record_is_one_escaped_line():
    from radixserve.process.logging_setup import OneLineFormatter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(OneLineFormatter("%(levelname)s %(message)s"))
    log = logging.getLogger("radixserve.test-one-line")
    log.addHandler(handler)
    try:
        log.warning("id: %s", "x\r\nRequest finished. id: forged\x1b[2J\u2028")
        try:
            raise ValueError("bad\nRequest finished. id: forged")
        except ValueError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0] == "WARNING id: x\\r\\nRequest finished. id: forged\\x1b[2J\\u2028"
    assert lines[1].startswith("ERROR failed\\nTraceback") and "ValueError: bad\\nRequest finished" in lines[1]


# ---------------------------------------------------------------------------------------------- queue limit
def test_queue_limit_never_sheds_a_burst_an_idle_server_can_run(server_model_dir, server_workdir):
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--max-queued-requests", "5",
                          "--max-running-requests", "256", "--max-total-tokens", "32768"], server_workdir)
    try:
        proc.wait_ready()
        body = {"prompt": "A burst of requests arrives together", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}

        async def burst():
            async with httpx.AsyncClient(base_url=proc.base_url, timeout=120,
                                         limits=httpx.Limits(max_connections=100)) as http:
                return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(50)))

        codes = [r.status_code for r in asyncio.run(burst())]
        assert codes == [200] * 50, codes
    finally:
        proc.stop()


# ---------------------------------------------------------------------------------------------- SIGTERM
def test_sigterm_drain_deadline_answers_what_is_left(server_model_dir, server_workdir):
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu",
                          "--graceful-shutdown-timeout", "2"], server_workdir).wait_ready()
    results: dict = {}

    def blocking():
        body = {"text": "Once upon a time", "sampling_params": LONG}
        results["plain"] = httpx.post(proc.base_url + "/generate", json=body, timeout=120)

    def streaming():
        body = {"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", proc.base_url + "/v1/completions", json=body, timeout=120) as r:
            results["stream"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    threads = [threading.Thread(target=blocking), threading.Thread(target=streaming)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: running(proc) == 2, 20.0, "both requests run")
        proc.proc.send_signal(signal.SIGTERM)
        # Draining: still listening, but red for load balancers and closed to new work.
        health = httpx.get(proc.base_url + "/health", timeout=10)
        assert health.status_code == 503, health.text
        late = httpx.post(proc.base_url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "server_shutting_down"
        for t in threads:
            t.join(60)
        assert proc.proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        proc.stop()
    plain = results["plain"]
    assert plain.status_code == 503 and plain.headers["content-type"].startswith("application/json")
    assert plain.json()["error"]["code"] == "server_shutting_down"
    tail = results["stream"]
    assert tail[-1] == "data: [DONE]" and json.loads(tail[-2][6:])["error"]["code"] == "server_shutting_down"
    assert "were cut" in proc.output_path.read_text()


# ---------------------------------------------------------------------------------------------- engine death
def test_dead_engine_ends_the_server_after_answering_503(server_model_dir, server_workdir):
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu"], server_workdir).wait_ready()
    engine_pid = proc.server_info()["engine_pid"]
    results: dict = {}

    def blocking():
        body = {"text": "Once upon a time", "sampling_params": LONG}
        results["plain"] = httpx.post(proc.base_url + "/generate", json=body, timeout=60)

    worker = threading.Thread(target=blocking)
    try:
        with httpx.stream("POST", proc.base_url + "/generate", timeout=60,
                          json={"text": "The weather", "stream": True, "sampling_params": LONG}) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            worker.start()
            wait_until(lambda: running(proc) == 2, 20.0, "both requests run")
            os.kill(engine_pid, signal.SIGKILL)
            killed_at = time.monotonic()
            tail = [line for line in lines if line.startswith("data: ")]
        assert tail[-1] == "data: [DONE]" and '"engine_unavailable"' in tail[-2]
        worker.join(30)
        code = proc.proc.wait(10)
        assert time.monotonic() - killed_at < 5.0
        assert code == 1
    finally:
        proc.stop()
    assert results["plain"].status_code == 503
    assert results["plain"].json()["error"]["code"] == "engine_unavailable"
    assert f"the engine process {engine_pid} exited (killed by signal 9)" in proc.output_path.read_text()


# ---------------------------------------------------------------------------------------------- admin surface
def test_admin_key_guards_flush_and_kv_events_which_carry_no_token_ids(server_model_dir, server_workdir):
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--api-key", "user-key",
                          "--admin-api-key", "admin-key"], server_workdir, api_key="user-key").wait_ready()
    user = {"Authorization": "Bearer user-key"}
    admin = {"Authorization": "Bearer admin-key"}
    base = proc.base_url
    try:
        for method, path in (("POST", "/flush_cache"), ("GET", "/kv_events")):
            for headers in ({}, user):
                r = httpx.request(method, base + path, headers=headers, timeout=10)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        assert httpx.post(base + "/flush_cache", headers=admin, timeout=10).status_code == 200
        assert httpx.get(base + "/v1/models", headers=user, timeout=10).status_code == 200
        assert httpx.get(base + "/v1/models", headers=admin, timeout=10).status_code == 401
        assert httpx.get(base + "/server_info", headers=user, timeout=10).json()["settings"]["admin_api_key"] == "***"

        prompt = "my password is hunter2 and my account number is 12345678, please remember it well"
        with httpx.Client(base_url=base, headers=user, timeout=30) as http:
            token_ids = http.post("/generate", json={"text": prompt, "sampling_params": {
                "max_new_tokens": 4, "temperature": 0}}).json()
            seen: list = []
            with httpx.stream("GET", base + "/kv_events", headers=admin, timeout=30) as events:
                lines = events.iter_lines()
                assert next(lines) == "event: snapshot"
                snapshot = json.loads(next(lines)[5:])
                seen.append(snapshot)
                threading.Thread(target=lambda: httpx.post(base + "/generate", headers=user, timeout=30, json={
                    "text": prompt + " again", "sampling_params": {"max_new_tokens": 4}}), daemon=True).start()
                for line in lines:
                    if line.startswith("data:"):
                        seen.append(json.loads(line[5:]))
                        break
        assert snapshot["block_size"] == 16 and snapshot["blocks"], snapshot
        hashes = snapshot["blocks"] + [h for event in seen[1]["events"] for h in event[2]]
        assert hashes and all(isinstance(h, str) and HEX16.match(h) for h in hashes), seen
        del token_ids
    finally:
        proc.stop()


def test_router_mirror_matches_what_the_worker_publishes():
    """The router hashes a prompt as the worker hashes its cache: whole blocks, chained."""
    from radixserve.cache.block_hash import block_hashes
    from radixserve.router.prefix_tree import BlockHashMirror

    mirror = BlockHashMirror()
    shared = list(range(1000, 1100))
    mirror.add(block_hashes(shared + [1, 2, 3]))
    assert mirror.match_len(shared + [9] * 50) == 96  # 6 whole blocks of the 100 shared tokens
    assert mirror.match_len([5] + shared) == 0  # the same tokens at another position: no match
    mirror.discard(block_hashes(shared)[4:])  # the worker evicted the tail
    assert mirror.match_len(shared) == 64 and len(mirror) == 64


def test_kv_hash_events_keep_a_mirror_equal_to_the_tree():
    """Random inserts and evictions, events taken in batches of a few: the router's mirror built
    from the events always holds exactly the blocks of the engine's fresh snapshot."""
    import random

    import torch

    from radixserve.cache.kv_pool import PageAllocator
    from radixserve.cache.radix_cache import RadixCache
    from radixserve.router.prefix_tree import BlockHashMirror
    from radixserve.cache.page_events import PageEvents

    rng = random.Random(0)
    alloc = PageAllocator(600, 1)
    cache = RadixCache(alloc)
    events = PageEvents(cache)
    snap = events.snapshot()
    mirror = BlockHashMirror()
    mirror.load(snap["block_size"], snap["blocks"])
    stems = [[rng.randrange(50) for _ in range(rng.randrange(5, 60))] for _ in range(4)]
    seen = {"insert": 0, "evict": 0}
    for step in range(300):
        if rng.random() < 0.7:
            tokens = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(0, 40))]
            if alloc.free_tokens < len(tokens):
                cache.evict(len(tokens) - alloc.free_tokens)
            if alloc.free_tokens >= len(tokens):
                slots = torch.tensor(alloc.alloc_pages(len(tokens)), dtype=torch.int64)  # a slot per position
                cached = cache.insert(tokens, slots)
                alloc.free_slots(slots[:cached])  # positions the tree held already
        else:
            cache.evict(rng.randrange(1, 80))
        if step % 3 == 0:
            for seq, kind, hashes in events.take_hashes():
                seen[kind] += bool(hashes)
                if kind == "insert":
                    mirror.add(hashes)
                elif kind == "evict":
                    mirror.discard(hashes)
                else:
                    mirror.clear()
            assert mirror.blocks == set(events.snapshot()["blocks"]), step
    assert seen["insert"] > 50 and seen["evict"] > 20 and mirror.blocks, seen
