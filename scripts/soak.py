"""Soak benchmark: mixed traffic against a real server for a while, then what it leaked.

    python scripts/soak.py --duration 600 [--model-path DIR] [--output soak.json]

Starts a CPU server (the built-in tiny random Qwen2 unless --model-path is given) with a small KV
pool (so the cache evicts) and a queue limit, then runs, concurrently until the duration is up:
completions and chat completions, streams read to the end, streams and plain requests dropped
mid-way, bad inputs (each must be a 4xx), cache flushes, and every minute a burst of requests
over the queue limit. At the end it reports requests served, errors by kind, 5xx answers other
than the queue limit's 503 (target 0), KV slots leaked once idle (target 0), the API and engine
processes' RSS at start and end (target: flat within 5%), and the API event loop's stalls over
100 ms (target 0; the server logs each). The client watches its own event loop the same way: its
stalls mean the machine was busy, and the server's then likely came from the machine too.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import httpx

from radixserve.http_common.loop_lag import LoopLagWatch

PREFIXES = [("You are a careful assistant. " * 8), ("Summarise the following report. " * 6),
            ("Translate into French: " * 4), ""]
BAD_INPUTS: list[tuple[str, Any]] = [
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "x", "max_tokens": "10"}),
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}'),  # a lone surrogate (raw JSON)
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}),
    ("/v1/completions", {"prompt": "x", "temperature": -3}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": []}),
    ("/generate", {"text": "a", "rid": "x\nRequest finished. id: forged"}),
    ("/generate", {"text": "a", "rid": "r" * 500}),
    ("/generate", {"input_ids": [10 ** 9]}),
    ("/generate", "{not json"),
]


def rss_kb(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except FileNotFoundError:
        return None
    return None


class Tally:
    def __init__(self) -> None:
        self.served = 0
        self.dropped = 0
        self.errors: collections.Counter = collections.Counter()
        self.unexpected: list[str] = []

    def answer(self, r: httpx.Response, expect_4xx: bool = False) -> None:
        if r.status_code == 200 and not expect_4xx:
            self.served += 1
            return
        try:
            code = r.json()["error"].get("code")
        except (ValueError, KeyError, TypeError, AttributeError):
            code = None
        self.errors[f"{r.status_code} {code}"] += 1
        if r.status_code >= 500 and code != "queue_full" or (expect_4xx and not 400 <= r.status_code < 500):
            self.unexpected.append(f"{r.request.url.path} -> {r.status_code} {r.text[:200]}")

    def failure(self, what: str, e: BaseException) -> None:
        self.errors[f"client {type(e).__name__}"] += 1
        self.unexpected.append(f"{what}: {type(e).__name__} {e}")


def prompt(rng: random.Random) -> str:
    return rng.choice(PREFIXES) + f"Request {rng.randrange(10 ** 6)}: " + "word " * rng.randrange(1, 60)


async def one_request(http: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    kind = rng.choices(["completion", "chat_stream", "drop_stream", "drop_plain", "bad"], [4, 3, 2, 1, 1])[0]
    max_tokens = rng.randrange(4, 64)
    try:
        if kind == "completion":
            tally.answer(await http.post("/v1/completions", json={"prompt": prompt(rng), "max_tokens": max_tokens}))
        elif kind in ("chat_stream", "drop_stream"):
            body = {"messages": [{"role": "user", "content": prompt(rng)}], "max_tokens": max_tokens * 4,
                    "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    tally.answer(r)
                    return
                chunks = 0
                async for line in r.aiter_lines():
                    chunks += line.startswith("data: ")
                    if kind == "drop_stream" and chunks >= 3:
                        tally.dropped += 1
                        return
                    if line.startswith("data: ") and '"error"' in line:
                        tally.unexpected.append(f"stream error event: {line[:200]}")
                tally.served += 1
        elif kind == "drop_plain":
            try:
                await http.post("/v1/completions", json={"prompt": prompt(rng), "max_tokens": 500,
                                                         "ignore_eos": True}, timeout=httpx.Timeout(30, read=0.3))
            except httpx.ReadTimeout:
                tally.dropped += 1
        else:
            path, body = rng.choice(BAD_INPUTS)
            if isinstance(body, str):
                r = await http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = await http.post(path, json=body)
            tally.answer(r, expect_4xx=True)
    except Exception as e:  # noted as unexpected, never the end of the run
        tally.failure(kind, e)


async def burst(http: httpx.AsyncClient, size: int, tally: Tally) -> None:
    body = {"prompt": "A burst of requests over the queue limit. " * 4, "max_tokens": 32, "ignore_eos": True}
    responses = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(size)),
                                     return_exceptions=True)
    for r in responses:
        if isinstance(r, BaseException):
            tally.failure("burst", r)
        else:
            tally.answer(r)


async def traffic(base: str, duration_s: float, concurrency: int, burst_size: int, seed: int) -> dict[str, Any]:
    tally = Tally()
    flushes: collections.Counter = collections.Counter()
    deadline = time.monotonic() + duration_s
    watch = LoopLagWatch("soak client", log=False)
    watcher = asyncio.create_task(watch.run())
    limits = httpx.Limits(max_connections=concurrency + burst_size + 8)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as http:
        async def worker(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < deadline:
                await one_request(http, rng, tally)

        async def operator() -> None:
            next_burst = time.monotonic() + 30
            while time.monotonic() < deadline:
                await asyncio.sleep(15)
                r = await http.post("/flush_cache")
                flushes[r.status_code] += 1
                if time.monotonic() >= next_burst and time.monotonic() < deadline:
                    next_burst += 60
                    await burst(http, burst_size, tally)

        await asyncio.gather(operator(), *(worker(i) for i in range(concurrency)))
    watcher.cancel()
    return {"served": tally.served, "dropped_on_purpose": tally.dropped, "errors_by_kind": dict(tally.errors),
            "unexpected": tally.unexpected[:50], "unexpected_count": len(tally.unexpected),
            "flushes": {str(k): v for k, v in flushes.items()},
            "client_loop_stalls_over_100ms": watch.stalls, "client_max_loop_lag_ms": round(watch.max_lag_s * 1000)}


def wait_idle(http: httpx.Client, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = http.get("/server_info").json()["stats"]
        if stats["running_requests"] == 0 and stats["queued_requests"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not go idle: {stats}")
        time.sleep(0.5)


def start_server(args, workdir: Path, log_file: Path, port: int) -> subprocess.Popen:
    model = args.model_path
    if model is None:
        from radixserve.testing.tiny_model import build_tiny_model

        model = str(build_tiny_model(workdir / "tiny-qwen2"))
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--model-path", model, "--device", "cpu",
           "--port", str(port), "--max-total-tokens", str(args.max_total_tokens),
           "--max-running-requests", str(args.max_running), "--max-queued-requests", str(args.max_queued),
           "--log-file", str(log_file)]
    out = open(workdir / "server.out", "wb")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="Seconds of traffic (default: 600).")
    p.add_argument("--model-path", default=None, help="Model directory (default: the built-in tiny Qwen2).")
    p.add_argument("--concurrency", type=int, default=12, help="Clients sending one request after another.")
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--max-queued", type=int, default=16)
    p.add_argument("--burst", type=int, default=80, help="Requests of each burst (over the queue limit).")
    p.add_argument("--max-total-tokens", type=int, default=8192, help="KV pool (small: the cache evicts).")
    p.add_argument("--port", type=int, default=30123)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="Write the report as JSON here too.")
    args = p.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="radixserve-soak-"))
    log_file = workdir / "server.log"
    base = f"http://127.0.0.1:{args.port}"
    server = start_server(args, workdir, log_file, args.port)
    http = httpx.Client(base_url=base, timeout=60)
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited ({server.returncode}); see {workdir / 'server.out'}")
            try:
                if http.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.5)
        info = http.get("/server_info").json()
        api_pid, engine_pid = info["api_pid"], info["engine_pid"]
        asyncio.run(traffic(base, 20, args.concurrency, 0, args.seed + 1))  # warm-up: allocator and caches
        wait_idle(http)
        rss_start = {"api_kb": rss_kb(api_pid), "engine_kb": rss_kb(engine_pid)}
        stalls_before = log_file.read_text(errors="replace").count("api: event loop stalled")
        started = time.time()
        result = asyncio.run(traffic(base, args.duration, args.concurrency, args.burst, args.seed))
        idle = wait_idle(http)
        rss_end = {"api_kb": rss_kb(api_pid), "engine_kb": rss_kb(engine_pid)}
        log = log_file.read_text(errors="replace")
        stall_ms = [int(m) for m in re.findall(r"api: event loop stalled for (\d+) ms", log)]
        pool = idle["pool_tokens"]
        leaked = pool - idle["free_tokens"] - idle["evictable_tokens"]
        flushed = http.post("/flush_cache").status_code
        after_flush = http.get("/server_info").json()["stats"]
        report = {
            "duration_s": args.duration, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
            **result,
            "5xx_other_than_queue_full": sum(v for k, v in result["errors_by_kind"].items()
                                             if k.startswith("5") and not k.endswith("queue_full")),
            "leaked_slots_idle": leaked, "held_by_running_idle": idle["held_by_running_tokens"],
            "protected_idle": idle["protected_tokens"], "pool_tokens": pool,
            "free_after_flush": after_flush["free_tokens"] if flushed == 200 else None,
            "rss_start": rss_start, "rss_end": rss_end,
            "rss_change_pct": {k: round(100.0 * (rss_end[k] - rss_start[k]) / rss_start[k], 1)
                               for k in rss_start if rss_start[k] and rss_end[k]},
            "api_loop_stalls_over_100ms": len(stall_ms[stalls_before:]),
            "api_max_stall_ms": max(stall_ms[stalls_before:], default=0),
            "engine_alive": http.get("/server_info").json()["engine_alive"],
            "server_log": str(log_file),
        }
    finally:
        http.close()
        if server.poll() is None:
            server.terminate()
            server.wait(60)
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    ok = (report["5xx_other_than_queue_full"] == 0 and report["leaked_slots_idle"] == 0
          and report["unexpected_count"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
