"""Soak benchmark: mixed traffic against a real server for a while, then what it leaked.

    python scripts/soak.py --duration 600 [--model-path DIR] [--output soak.json]

Starts a CPU server (the built-in tiny random Qwen2 unless --model-path is given) with a small KV
pool (so the cache evicts) over a small host-memory tier, and a queue limit, then runs,
concurrently until the duration is up: completions and chat completions, streams read to the end,
streams and plain requests dropped mid-way, tool calls (auto, required, a named function),
structured outputs (`response_format` json_schema, small schemas), log probabilities (with and
without `echo`), penalties with `min_tokens` and `logit_bias`, /v1/tokenize and /v1/detokenize
round trips, bad inputs (each must be a 4xx naming its field), cache flushes, and every minute a
burst of requests over the queue limit. Each answer is checked (a forced call parses and follows
its schema, a finished structured reply validates, log probabilities have one entry per token, a
round trip gives the text back); a failed check is an unexpected answer. At the end it reports
requests served, errors by kind, unexpected answers and 5xx answers other than the queue limit's
503 (target 0 each), KV slots and host-tier slots leaked once idle (target 0), the API and engine
processes' RSS at start and end (target: flat within 5%), and the API event loop's stalls over
100 ms (target 0; the server logs each). The client watches its own event loop the same way: its
stalls mean the machine was busy, and the server's then likely came from the machine too.

With --router the traffic goes through a real router (`launch_router`, kv_aware) in front of two
workers: the real server, named at start with the workers' admin key, and a hostile fake worker
added at run time with the router's admin key (radixserve/testing/hostile_worker.py: it answers
garbage, hangs, resets, 500s, slow-drips event streams, redirects to another loopback address,
and records every Authorization header it and that address receive). The report adds how often
the workers' admin key reached either (target 0), answers the router passed on from the hostile
worker (a 200 it cannot tell from a good one; listed apart), the router's 5xx other than its
documented 503 (target 0), and the real worker's leaked slots once idle (target 0).
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
from radixserve.testing.hostile_worker import MARK, HostileWorker

HOSTILE_MARK = MARK.decode()
# --router: clients hold USER_KEY; the router's admin endpoints take ROUTER_ADMIN_KEY; the workers'
# admin key goes to the real worker only.
USER_KEY = "soak-user-key"
ROUTER_ADMIN_KEY = "soak-router-admin-key"
WORKERS_ADMIN_KEY = "soak-workers-admin-key"

PREFIXES = [("You are a careful assistant. " * 8), ("Summarise the following report. " * 6),
            ("Translate into French: " * 4), ""]
USER = [{"role": "user", "content": "What is the weather like?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
TOOL_SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "maxItems": 3,
                                                                         "items": {"enum": ["a", "b", "c"]}}},
     "required": ["ok", "tags"], "additionalProperties": False},
    {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "integer", "minimum": -5, "maximum": 5}},
]
# (path, body, the `param` the 400 must name; None: any 4xx)
BAD_INPUTS: list[tuple[str, Any, Optional[str]]] = [
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, "max_tokens"),
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),  # a lone surrogate (raw JSON)
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, None),
    ("/v1/completions", {"prompt": "x", "temperature": -3}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, None),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/generate", {"text": "a", "rid": "x\nRequest finished. id: forged"}, "rid"),
    ("/generate", {"text": "a", "rid": "r" * 500}, "rid"),
    ("/generate", {"input_ids": [10 ** 9]}, None),
    ("/generate", "{not json", None),
    ("/generate", {"text": ["a"] * 10000}, "text"),
    ("/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(65)]}, "stop"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"999999": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": USER, "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]}, "tools[0].function.parameters"),
    ("/v1/chat/completions", {"messages": [*USER, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ("/v1/chat/completions", {"messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": "", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[1].tool_calls[0].id"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "u", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format"),
    ("/v1/tokenize", {"prompt": 5}, "prompt"),
    ("/v1/detokenize", {"tokens": [-1]}, None),
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
        self.sent: collections.Counter = collections.Counter()  # requests by kind
        self.unexpected: list[str] = []

    def answer(self, r: httpx.Response, expect_4xx: bool = False, param: Optional[str] = None) -> None:
        """Count `r`; with expect_4xx it must be a 4xx error body naming `param` (when given)."""
        if r.status_code == 200 and not expect_4xx:
            self.served += 1
            if HOSTILE_MARK in r.text:
                self.unexpected.append(f"{r.request.url.path} -> 200 {r.text[:200]}")
            return
        try:
            error = r.json()["error"]
            code, named = error.get("code"), error.get("param")
        except (ValueError, KeyError, TypeError, AttributeError):
            code = named = None
        self.errors[f"{r.status_code} {code}"] += 1
        if r.status_code >= 500 and code != "queue_full" or (expect_4xx and not 400 <= r.status_code < 500) \
                or r.status_code < 400 \
                or (expect_4xx and param is not None and named != param):
            self.unexpected.append(f"{r.request.url.path} -> {r.status_code} {r.text[:200]}")

    def failure(self, what: str, e: BaseException) -> None:
        self.errors[f"client {type(e).__name__}"] += 1
        self.unexpected.append(f"{what}: {type(e).__name__} {e}")


def validates(value: Any, schema: dict) -> bool:
    """Whether `value` follows `schema` (jsonschema when installed, the test extras have it)."""
    try:
        import jsonschema
    except ImportError:
        return True
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def prompt(rng: random.Random) -> str:
    return rng.choice(PREFIXES) + f"Request {rng.randrange(10 ** 6)}: " + "word " * rng.randrange(1, 60)


async def checked(http: httpx.AsyncClient, tally: Tally, path: str, body: dict, check) -> None:
    """POST `body`; a 200 whose JSON `check` finds wrong (it returns why) is an unexpected answer."""
    r = await http.post(path, json=body)
    tally.answer(r)
    if r.status_code == 200:
        try:
            reply = r.json()
        except ValueError:
            tally.unexpected.append(f"{path}: a 200 that is not JSON: {r.text[:300]}")
            return
        why = check(reply)
        if why:
            tally.unexpected.append(f"{path}: {why}: {r.text[:300]}")


def tool_reply_problem(reply: dict, mode: str) -> Optional[str]:
    choice = reply["choices"][0]
    message, finish = choice["message"], choice["finish_reason"]
    calls = message.get("tool_calls") or []
    for call in calls:
        name = call["function"]["name"]
        if name not in TOOL_SCHEMAS:
            return f"a call of an undeclared tool {name!r}"
        try:
            arguments = json.loads(call["function"]["arguments"])
        except json.JSONDecodeError:
            return "arguments that do not parse"
        if mode != "auto" and not validates(arguments, TOOL_SCHEMAS[name]):
            return "forced arguments that break the tool's schema"
    if mode != "auto" and finish == "stop":
        return "a forced call that stopped without a call"
    if mode != "auto" and message.get("content"):
        return "text beside a forced call"
    if calls and finish not in ("tool_calls", "length"):
        return f"calls with finish_reason {finish}"
    return None


def structured_problem(reply: dict, schema: dict) -> Optional[str]:
    choice = reply["choices"][0]
    if choice["finish_reason"] != "stop":
        return None  # cut off by max_tokens: unfinished JSON is expected
    try:
        value = json.loads(choice["message"]["content"])  # strict: no raw control characters
    except json.JSONDecodeError:
        return "a finished structured reply that is not JSON"
    return None if validates(value, schema) else "a finished structured reply that breaks its schema"


def logprobs_problem(reply: dict, k: int, echo: bool) -> Optional[str]:
    choice, usage = reply["choices"][0], reply["usage"]
    lp = choice["logprobs"]
    expected = usage["completion_tokens"] + (usage["prompt_tokens"] if echo else 0)
    if len(lp["tokens"]) != expected or len(lp["token_logprobs"]) != expected:
        return f"{len(lp['tokens'])} log probabilities for {expected} tokens"
    if any(v is not None and v > 1e-4 for v in lp["token_logprobs"]):
        return "a log probability above 0"
    if any(entry is not None and len(entry) > k for entry in lp["top_logprobs"] or []):
        return f"more than {k} top log probabilities"
    return None


async def feature_request(http: httpx.AsyncClient, rng: random.Random, tally: Tally, kind: str) -> None:
    if kind == "tools":
        mode = rng.choice(["auto", "required", "named"])
        choice = {"type": "function", "function": {"name": rng.choice(list(TOOL_SCHEMAS))}} if mode == "named" else mode
        body = {"messages": [{"role": "user", "content": prompt(rng)}], "tools": TOOLS, "tool_choice": choice,
                "parallel_tool_calls": rng.random() < 0.5, "max_tokens": rng.randrange(40, 160),
                "temperature": 1.0, "seed": rng.randrange(1000)}
        await checked(http, tally, "/v1/chat/completions", body, lambda r: tool_reply_problem(r, mode))
    elif kind == "structured":
        schema = rng.choice(SCHEMAS)
        body = {"messages": [{"role": "user", "content": prompt(rng)}], "max_tokens": rng.randrange(30, 120),
                "response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}},
                "temperature": 1.0, "seed": rng.randrange(1000)}
        await checked(http, tally, "/v1/chat/completions", body, lambda r: structured_problem(r, schema))
    elif kind == "logprobs":
        k, echo = rng.randrange(0, 6), rng.random() < 0.5
        body = {"prompt": prompt(rng), "max_tokens": rng.randrange(0 if echo else 1, 24), "logprobs": k, "echo": echo}
        await checked(http, tally, "/v1/completions", body, lambda r: logprobs_problem(r, k, echo))
    elif kind == "penalties":
        max_tokens = rng.randrange(8, 48)
        min_tokens = rng.randrange(0, max_tokens + 1)
        body = {"prompt": prompt(rng), "max_tokens": max_tokens, "min_tokens": min_tokens,
                "presence_penalty": rng.uniform(-2, 2), "frequency_penalty": rng.uniform(-2, 2),
                "repetition_penalty": rng.uniform(0.5, 2),
                "logit_bias": {str(rng.randrange(512)): rng.uniform(-100, 100) for _ in range(rng.randrange(1, 8))},
                "stop": [f"zz{i}" for i in range(rng.randrange(0, 64))] or None}
        await checked(http, tally, "/v1/completions", body, lambda r: None if r["usage"]["completion_tokens"] >= min(
            min_tokens, max_tokens) else "fewer tokens than min_tokens")
    else:  # tokenize: text -> ids -> text
        text = prompt(rng)
        r = await http.post("/v1/tokenize", json={"prompt": text})
        tally.answer(r)
        if r.status_code != 200:
            return
        tokens = r.json()["tokens"]
        if r.json()["count"] != len(tokens):
            tally.unexpected.append(f"/v1/tokenize: count {r.json()['count']} for {len(tokens)} tokens")
        await checked(http, tally, "/v1/detokenize", {"tokens": tokens},
                      lambda d: None if d["prompt"] == text else f"round trip gave {d['prompt'][:80]!r}")


FEATURES = ("tools", "structured", "logprobs", "penalties", "tokenize")


async def one_request(http: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    kinds = ["completion", "chat_stream", "drop_stream", "drop_plain", "bad", *FEATURES]
    kind = rng.choices(kinds, [4, 3, 2, 1, 2, 2, 2, 1, 1, 1])[0]
    max_tokens = rng.randrange(4, 64)
    tally.sent[kind] += 1
    try:
        if kind in FEATURES:
            await feature_request(http, rng, tally, kind)
        elif kind == "completion":
            tally.answer(await http.post("/v1/completions", json={"prompt": prompt(rng), "max_tokens": max_tokens}))
        elif kind in ("chat_stream", "drop_stream"):
            body = {"messages": [{"role": "user", "content": prompt(rng)}], "max_tokens": max_tokens * 4,
                    "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    tally.answer(r)
                    return
                chunks, hostile = 0, False
                async for line in r.aiter_lines():
                    chunks += line.startswith("data: ")
                    hostile = hostile or HOSTILE_MARK in line
                    if kind == "drop_stream" and chunks >= 3:
                        tally.dropped += 1
                        return
                    if line.startswith("data: ") and '"error"' in line:
                        after = f" after {HOSTILE_MARK}'s events" if hostile else ""
                        tally.unexpected.append(f"stream error event{after}: {line[:200]}")
                tally.served += 1
                if hostile:
                    tally.unexpected.append(f"stream of {HOSTILE_MARK} events")
        elif kind == "drop_plain":
            try:
                await http.post("/v1/completions", json={"prompt": prompt(rng), "max_tokens": 500,
                                                         "ignore_eos": True}, timeout=httpx.Timeout(30, read=0.3))
            except httpx.ReadTimeout:
                tally.dropped += 1
        else:
            path, body, param = rng.choice(BAD_INPUTS)
            if isinstance(body, str):
                r = await http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = await http.post(path, json=body)
            tally.answer(r, expect_4xx=True, param=param)
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


async def traffic(base: str, duration_s: float, concurrency: int, burst_size: int, seed: int,
                  headers: Optional[dict[str, str]] = None,
                  admin_headers: Optional[dict[str, str]] = None) -> dict[str, Any]:
    tally = Tally()
    flushes: collections.Counter = collections.Counter()
    deadline = time.monotonic() + duration_s
    watch = LoopLagWatch("soak client", log=False)
    watcher = asyncio.create_task(watch.run())
    limits = httpx.Limits(max_connections=concurrency + burst_size + 8)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits, headers=headers or {}) as http:
        async def worker(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < deadline:
                await one_request(http, rng, tally)

        async def operator() -> None:
            next_burst = time.monotonic() + 30
            while time.monotonic() < deadline:
                await asyncio.sleep(15)
                r = await http.post("/flush_cache", headers=admin_headers)
                flushes[r.status_code] += 1
                if time.monotonic() >= next_burst and time.monotonic() < deadline:
                    next_burst += 60
                    await burst(http, burst_size, tally)

        await asyncio.gather(operator(), *(worker(i) for i in range(concurrency)))
    watcher.cancel()
    hostile = [u for u in tally.unexpected if HOSTILE_MARK in u]
    other = [u for u in tally.unexpected if HOSTILE_MARK not in u]
    return {"served": tally.served, "dropped_on_purpose": tally.dropped, "sent_by_kind": dict(tally.sent),
            "errors_by_kind": dict(tally.errors),
            "unexpected": other[:50], "unexpected_count": len(other),
            "hostile_answers_passed_on": len(hostile), "hostile_answers_sample": hostile[:10],
            "flushes": {str(k): v for k, v in flushes.items()},
            "client_loop_stalls_over_100ms": watch.stalls, "client_max_loop_lag_ms": round(watch.max_lag_s * 1000)}


def wait_healthy(http: httpx.Client, proc: subprocess.Popen, what: str, out: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the {what} exited ({proc.returncode}); see {out}")
        try:
            if http.get("/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {what} did not start; see {out}")
        time.sleep(0.5)


def start_router(workdir: Path, port: int, worker_url: str) -> subprocess.Popen:
    """kv_aware (it follows the real worker's /kv_events with the workers' admin key)."""
    cmd = [sys.executable, "-m", "radixserve.launch_router", "--worker-urls", worker_url, "--policy", "kv_aware",
           "--port", str(port), "--api-key", USER_KEY, "--admin-api-key", ROUTER_ADMIN_KEY,
           "--worker-admin-api-key", WORKERS_ADMIN_KEY, "--health-check-interval", "1",
           "--health-check-timeout", "5"]
    out = open(workdir / "router.out", "wb")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def wait_idle(http: httpx.Client, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = http.get("/server_info").json()["stats"]
        if stats["running_requests"] == 0 and stats["queued_requests"] == 0 and not stats.get("loading_tokens"):
            return stats
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not go idle: {stats}")
        time.sleep(0.5)


def git_commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def start_server(args, workdir: Path, log_file: Path, port: int, keys: tuple[str, ...] = ()) -> subprocess.Popen:
    model = args.model_path
    if model is None:
        from radixserve.testing.tiny_model import build_tiny_model

        model = str(build_tiny_model(workdir / "tiny-qwen2"))
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--model-path", model, "--device", "cpu",
           "--port", str(port), "--max-total-tokens", str(args.max_total_tokens),
           "--max-running-requests", str(args.max_running), "--max-queued-requests", str(args.max_queued),
           "--log-file", str(log_file)]
    if args.hicache_size:
        cmd += ["--hicache-size", str(args.hicache_size)]
    cmd += list(keys)
    out = open(workdir / "server.out", "wb")
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def router_figures(front: str, result: dict, warm: dict, hostile: HostileWorker, workdir: Path) -> dict[str, Any]:
    """What --router adds to the report: where the keys went, what the hostile worker did, the router's state."""
    with httpx.Client(base_url=front, timeout=30, headers={"Authorization": f"Bearer {ROUTER_ADMIN_KEY}"}) as r_http:
        workers = r_http.get("/workers").json()["workers"]
        metrics = r_http.get("/metrics").text
    admin = f"Bearer {WORKERS_ADMIN_KEY}"
    router_admin = f"Bearer {ROUTER_ADMIN_KEY}"
    return {
        "router": {
            "workers": [{k: w.get(k) for k in ("id", "url", "healthy", "trusted", "load", "last_error")}
                        for w in workers],
            "counters": {name: float(value) for name, value in re.findall(
                r"^(\S*router_(?:retries|errors)_total\S*) (\S+)$", metrics, re.M)},
            "log": str(workdir / "router.out")},
        "warmup_unexpected": warm["unexpected_count"],
        "hostile_requests_by_path": dict(hostile.requests),
        "hostile_answers_by_mode": dict(hostile.answered),
        "hostile_authorizations": {("user key" if a == f"Bearer {USER_KEY}" else "workers' admin key" if a == admin
                                    else "router admin key" if a == router_admin else "other"): n
                                   for a, n in hostile.authorizations.items()},
        "workers_admin_key_reached_hostile": hostile.received(admin) + hostile.collector.received(admin),
        "router_admin_key_reached_hostile": hostile.received(router_admin) + hostile.collector.received(router_admin),
        "requests_reaching_redirect_target": sum(hostile.collector.requests.values()),
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="Seconds of traffic (default: 600).")
    p.add_argument("--model-path", default=None, help="Model directory (default: the built-in tiny Qwen2).")
    p.add_argument("--concurrency", type=int, default=12, help="Clients sending one request after another.")
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--max-queued", type=int, default=16)
    p.add_argument("--burst", type=int, default=80, help="Requests of each burst (over the queue limit).")
    p.add_argument("--max-total-tokens", type=int, default=8192, help="KV pool (small: the cache evicts).")
    p.add_argument("--hicache-size", type=float, default=0.002,
                   help="Host-memory tier in GB (default 0.002: ~3,900 tokens of the tiny model, smaller than "
                        "the pool, so it evicts too); 0: none.")
    p.add_argument("--port", type=int, default=30123)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="Write the report as JSON here too.")
    p.add_argument("--router", action="store_true",
                   help="Through a router in front of the server and a hostile fake worker (see above).")
    args = p.parse_args(argv)

    commit = git_commit()  # at the start: the code the server runs
    workdir = Path(tempfile.mkdtemp(prefix="radixserve-soak-"))
    log_file = workdir / "server.log"
    base = f"http://127.0.0.1:{args.port}"
    keys = ("--api-key", USER_KEY, "--admin-api-key", WORKERS_ADMIN_KEY) if args.router else ()
    server = start_server(args, workdir, log_file, args.port, keys)
    client_headers = {"Authorization": f"Bearer {USER_KEY}"} if args.router else {}
    # The server's own figures come from it directly, also behind a router.
    http = httpx.Client(base_url=base, timeout=60, headers=client_headers)
    router: Optional[subprocess.Popen] = None
    hostile: Optional[HostileWorker] = None
    front, admin_headers = base, None
    try:
        wait_healthy(http, server, "server", workdir / "server.out")
        if args.router:
            router_port = args.port + 1
            router = start_router(workdir, router_port, base)
            front = f"http://127.0.0.1:{router_port}"
            admin_headers = {"Authorization": f"Bearer {ROUTER_ADMIN_KEY}"}
            with httpx.Client(base_url=front, timeout=30) as r_http:
                wait_healthy(r_http, router, "router", workdir / "router.out", 120)
                hostile = HostileWorker()
                added = r_http.post("/workers", json={"url": hostile.url}, headers=admin_headers)
                if added.status_code != 201:
                    raise RuntimeError(f"POST /workers answered {added.status_code}: {added.text}")
        info = http.get("/server_info").json()
        api_pid, engine_pid = info["api_pid"], info["engine_pid"]
        warm = asyncio.run(traffic(front, 20, args.concurrency, 0, args.seed + 1, client_headers, admin_headers))
        wait_idle(http)
        rss_start = {"api_kb": rss_kb(api_pid), "engine_kb": rss_kb(engine_pid)}
        stalls_before = log_file.read_text(errors="replace").count("api: event loop stalled")
        started = time.time()
        result = asyncio.run(traffic(front, args.duration, args.concurrency, args.burst, args.seed,
                                     client_headers, admin_headers))
        idle = wait_idle(http)
        rss_end = {"api_kb": rss_kb(api_pid), "engine_kb": rss_kb(engine_pid)}
        log = log_file.read_text(errors="replace")
        stall_ms = [int(m) for m in re.findall(r"api: event loop stalled for (\d+) ms", log)]
        pool = idle["pool_tokens"]
        leaked = pool - idle["free_tokens"] - idle["evictable_tokens"]
        host_pool = idle.get("host_pool_tokens", 0)
        host_leaked = host_pool - idle.get("host_free_tokens", 0) - idle.get("host_cached_tokens", 0)
        if args.router:
            flush_headers = {"Authorization": f"Bearer {WORKERS_ADMIN_KEY}"}
            router_report = router_figures(front, result, warm, hostile, workdir)
        else:
            flush_headers, router_report = {}, {}
        flushed = http.post("/flush_cache", headers=flush_headers).status_code
        after_flush = http.get("/server_info").json()["stats"]
        report = {
            "duration_s": args.duration, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
            **result,
            "5xx_other_than_queue_full": sum(v for k, v in result["errors_by_kind"].items()
                                             if k.startswith("5") and not k.endswith("queue_full")),
            "leaked_slots_idle": leaked, "held_by_running_idle": idle["held_by_running_tokens"],
            "protected_idle": idle["protected_tokens"], "pool_tokens": pool,
            "free_after_flush": after_flush["free_tokens"] if flushed == 200 else None,
            "host_leaked_slots_idle": host_leaked, "host_pool_tokens": host_pool,
            "host_cached_idle": idle.get("host_cached_tokens", 0), "host_hit_rate": idle.get("host_hit_rate"),
            "host_free_after_flush": after_flush.get("host_free_tokens") if flushed == 200 else None,
            "commit": commit,
            "rss_start": rss_start, "rss_end": rss_end,
            "rss_change_pct": {k: round(100.0 * (rss_end[k] - rss_start[k]) / rss_start[k], 1)
                               for k in rss_start if rss_start[k] and rss_end[k]},
            "api_loop_stalls_over_100ms": len(stall_ms[stalls_before:]),
            "api_max_stall_ms": max(stall_ms[stalls_before:], default=0),
            "engine_alive": http.get("/server_info").json()["engine_alive"],
            "server_log": str(log_file),
            **router_report,
        }
    finally:
        http.close()
        if hostile is not None:
            hostile.stop()
        if router is not None and router.poll() is None:
            router.terminate()
            router.wait(60)
        if server.poll() is None:
            server.terminate()
            server.wait(60)
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    ok = (report["5xx_other_than_queue_full"] == 0 and report["leaked_slots_idle"] == 0
          and report["host_leaked_slots_idle"] == 0 and report["unexpected_count"] == 0
          and report.get("workers_admin_key_reached_hostile", 0) == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
