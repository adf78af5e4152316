"""Compare routing policies on an agent-like multi-turn workload over running workers.

    python -m radixserve.router.bench_routing --worker-urls http://127.0.0.1:31001 http://127.0.0.1:31002 \\
        --policies round_robin cache_aware kv_aware

For each policy it starts a router process over the same workers, flushes the workers' caches,
and runs the same workload: `--sessions` agent conversations, each with one of `--agent-types`
long system prompts (tool descriptions and instructions) shared by its type, each `--turns` long; every turn sends the whole
conversation so far (previous answers included) to `/v1/chat/completions`, `--concurrency`
sessions at a time. It reports the aggregated prefix hit rate (the sum of every response's
`usage.prompt_tokens_details.cached_tokens` over the sum of `usage.prompt_tokens`), throughput,
latency percentiles, how requests spread over workers, and failures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import httpx

WORDS = ("the river mill grain book number sun bridge water wheel stone server request prompt token cache "
         "tree prefix worker queue batch memory model answer question tool search file read write list "
         "call result error retry plan step check value table row column index").split()


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@dataclass
class Workload:
    sessions: int = 16
    turns: int = 5
    concurrency: int = 8
    agent_types: int = 4
    system_words: int = 200
    user_words: int = 25
    max_tokens: int = 16
    seed: int = 0


@dataclass
class RunResult:
    policy: str
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    per_worker: dict[str, int] = field(default_factory=dict)
    decisions: dict[str, float] = field(default_factory=dict)
    first_error: Optional[str] = None

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> dict:
        lat = sorted(self.latencies)

        def pct(p: float) -> float:
            return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else 0.0

        d = asdict(self)
        d.pop("latencies")
        d.update(hit_rate=round(self.hit_rate, 4), throughput_tok_s=round(
            (self.prompt_tokens + self.completion_tokens) / self.seconds, 1) if self.seconds else 0.0,
            output_tok_s=round(self.completion_tokens / self.seconds, 1) if self.seconds else 0.0,
            p50_latency_s=round(pct(0.5), 4), p99_latency_s=round(pct(0.99), 4))
        return d


async def run_workload(url: str, workload: Workload, policy: str = "", headers: Optional[dict] = None) -> RunResult:
    rng = random.Random(workload.seed)
    systems = [f"You are agent {a}. Your tools: " + _text(rng, workload.system_words)
               for a in range(workload.agent_types)]
    plans = [[_text(rng, workload.user_words) for _ in range(workload.turns)] for _ in range(workload.sessions)]
    result = RunResult(policy=policy)
    sem = asyncio.Semaphore(workload.concurrency)

    async def session(client: httpx.AsyncClient, s: int) -> None:
        async with sem:
            messages = [{"role": "system", "content": systems[s % len(systems)]}]
            for turn in plans[s]:
                messages.append({"role": "user", "content": f"[session {s}] {turn}"})
                start = time.perf_counter()
                try:
                    r = await client.post("/v1/chat/completions", json={
                        "messages": messages, "max_tokens": workload.max_tokens, "temperature": 0.0,
                        "ignore_eos": True})
                except httpx.HTTPError as e:
                    result.failed += 1
                    result.first_error = result.first_error or f"{type(e).__name__}: {e}"
                    return
                result.requests += 1
                if r.status_code != 200:
                    result.failed += 1
                    result.first_error = result.first_error or f"{r.status_code}: {r.text[:300]}"
                    return
                result.latencies.append(time.perf_counter() - start)
                body = r.json()
                usage = body["usage"]
                result.prompt_tokens += usage["prompt_tokens"]
                result.completion_tokens += usage["completion_tokens"]
                result.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, headers=headers or {}, timeout=300.0) as client:
        await asyncio.gather(*(session(client, s) for s in range(workload.sessions)))
    result.seconds = time.perf_counter() - start
    return result


def scrape_router(url: str, headers: Optional[dict] = None) -> tuple[dict[str, int], dict[str, float]]:
    text = httpx.get(url + "/metrics", headers=headers or {}, timeout=10.0).text
    per_worker: dict[str, int] = {}
    decisions: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("radixserve:router_requests_total{"):
            worker = line.split('worker="')[1].split('"')[0]
            per_worker[worker] = int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("radixserve:router_routing_decisions_total{"):
            decision = line.split('decision="')[1].split('"')[0]
            decisions[decision] = float(line.rsplit(" ", 1)[1])
    return per_worker, decisions


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_router(worker_urls: list[str], policy: str, extra: Optional[list[str]] = None,
                 log_path: Optional[str] = None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "radixserve.launch_router", "--worker-urls", *worker_urls, "--policy", policy,
           "--port", str(port), "--log-level", "warning", *(extra or [])]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("router did not become healthy")


def flush_workers(worker_urls: list[str], headers: Optional[dict] = None) -> None:
    for url in worker_urls:
        for _ in range(50):
            if httpx.post(url + "/flush_cache", headers=headers or {}, timeout=30.0).status_code == 200:
                break
            time.sleep(0.2)


def compare(worker_urls: list[str], policies: list[str], workload: Workload,
            log_path: Optional[str] = None) -> list[RunResult]:
    results = []
    for policy in policies:
        flush_workers(worker_urls)
        proc, url = start_router(worker_urls, policy, log_path=log_path)
        try:
            result = asyncio.run(run_workload(url, workload, policy))
            result.per_worker, result.decisions = scrape_router(url)
        finally:
            proc.terminate()
            proc.wait(30)
        results.append(result)
    return results


def main(argv: Optional[list[str]] = None) -> int:
    d = Workload()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker-urls", nargs="+", required=True)
    p.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware", "kv_aware"])
    for name, value in asdict(d).items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=value)
    p.add_argument("--output", help="Also write the results as JSON here.")
    args = p.parse_args(argv)
    workload = Workload(**{k: getattr(args, k) for k in asdict(d)})
    results = compare(args.worker_urls, args.policies, workload)
    rows = [r.summary() for r in results]
    print(f"{'policy':<13} {'hit rate':>8} {'tok/s':>8} {'p50 s':>7} {'p99 s':>7} {'failed':>6}  per worker / decisions")
    for r in rows:
        print(f"{r['policy']:<13} {r['hit_rate']:>8.3f} {r['throughput_tok_s']:>8.1f} {r['p50_latency_s']:>7.3f} "
              f"{r['p99_latency_s']:>7.3f} {r['failed']:>6}  {r['per_worker']} {r['decisions']}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"workload": asdict(workload), "results": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
