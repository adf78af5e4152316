"""Routers in front of the same two workers, on the agent workload: radixserve's own router
(`radixserve.launch_router`) against SGLang's model gateway (`smg`, PyPI) with its cache-aware
policy and with round robin.

    python scripts/gateway_compare.py [--repeats 3] [--configs radixserve:cache_aware smg:cache_aware ...]

Two workers are started once (the built-in tiny random Qwen2 on the CPU unless --model-path is
given; one torch thread each on a 2-core machine), each with a KV pool of --pool tokens. Each run
flushes both workers' caches, starts one router over them, sends bench_serving's `agent` workload
through it (text prompts to /v1/completions, so every router sees the same requests), reads the
requests each worker finished from the worker's own /metrics, and stops the router. The
configurations alternate (each repeat starts one further along the list), so a machine that gets
busier or quieter over the runs does not favour one of them. It prints, per configuration, the
mean and the range over the repeats of the hit rate (the workers' own counters), the total
throughput and the requests per worker, and writes every run's record to --out/runs.jsonl and the
table to --out/table.md.

The workload (defaults): 24 conversations of 4 turns over 4 system prompts of 256 tokens, 64-token
user messages and replies, 16 tokens out per turn, all sessions started at once with 0.2 s mean
think time between turns: about 13k distinct tokens against a pool of 8,192 per worker, so the
two pools hold it only when each conversation stays on one worker.

Needs smg for its configurations (`pip install -e '.[cluster]'`); configurations named
`radixserve:POLICY` take any of launch_router's policies, `smg:POLICY` any of smg's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Optional

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from radixserve.experiment.processes import Server, flush_caches, free_port, start_workers  # noqa: E402

DEFAULT_CONFIGS = ("radixserve:cache_aware", "smg:cache_aware", "smg:round_robin")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-path", default=None, help="Model directory (default: the built-in tiny random Qwen2).")
    p.add_argument("--device", default="cpu")
    p.add_argument("--pool", type=int, default=8192, help="--max-total-tokens of each worker.")
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), metavar="ROUTER:POLICY",
                   help="radixserve:<launch_router policy> or smg:<smg policy>.")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-prompt-len", type=int, default=256)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--assistant-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--think-time", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=None, help="Output folder (default: runs/gateway-compare-<timestamp>).")
    p.add_argument("--start-timeout", type=float, default=300.0, help="Seconds a worker may take to start.")
    return p


def parse_config(spec: str) -> tuple[str, str]:
    router, sep, policy = spec.partition(":")
    if not sep or router not in ("radixserve", "smg") or not policy:
        raise SystemExit(f"--configs: {spec!r} is not radixserve:POLICY or smg:POLICY")
    return router, policy


def finished_requests(url: str) -> int:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("radixserve:requests_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


@contextlib.contextmanager
def smg_gateway(urls: list[str], policy: str, log_path: Path) -> Iterator[str]:
    """`smg launch` over the workers, on loopback; yields its URL once both workers are ready."""
    port = free_port()
    cmd = [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *urls, "--policy", policy, "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(free_port()), "--log-level", "warn"]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"smg exited with {proc.returncode}; see {log_path}")
                with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                    workers = httpx.get(base + "/workers", timeout=5).json()["workers"]
                    if {w["url"] for w in workers if w.get("status") == "ready"} == set(urls):
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"smg did not register the workers in 60 s; see {log_path}")
                time.sleep(0.25)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def our_router(urls: list[str], policy: str, log_path: Path, tokenizer: str) -> Iterator[str]:
    router = Server(["--worker-urls", *urls, "--policy", policy, "--tokenizer-path", tokenizer,
                     "--log-level", "warning"], log_path, module="radixserve.launch_router")
    try:
        router.wait_ready(120)
        yield router.base_url
    finally:
        router.stop()


def bench_argv(args: argparse.Namespace, base_url: str, tokenizer: str, urls: list[str]) -> list[str]:
    argv = ["--base-url", base_url, "--backend", "openai", "--tokenizer", tokenizer, "--dataset-name", "agent",
            "--num-prompts", str(args.sessions * args.turns), "--agent-num-sessions", str(args.sessions),
            "--agent-turns", str(args.turns), "--agent-num-system-prompts", str(args.system_prompts),
            "--agent-system-prompt-len", str(args.system_prompt_len), "--agent-user-len", str(args.user_len),
            "--agent-assistant-len", str(args.assistant_len), "--agent-output-len", str(args.output_len),
            "--agent-think-time", str(args.think_time), "--request-rate", "inf", "--seed", str(args.seed),
            # one cache of both pools: the oracle every configuration is measured against
            "--oracle-capacity", str(2 * args.pool), "--disable-tqdm"]
    for url in urls:
        argv += ["--metrics-url", url]
    return argv


def run_one(args: argparse.Namespace, spec: str, urls: list[str], tokenizer: str, out: Path, rep: int) -> dict:
    from radixserve.bench_serving import build_parser as bench_parser, run_benchmark

    router, policy = parse_config(spec)
    flush_caches(urls)
    log_path = out / f"{router}-{policy}-{rep}.log"
    started = our_router(urls, policy, log_path, tokenizer) if router == "radixserve" else \
        smg_gateway(urls, policy, log_path)
    before = [finished_requests(u) for u in urls]
    with started as base_url:
        outcome = asyncio.run(run_benchmark(bench_parser().parse_args(bench_argv(args, base_url, tokenizer, urls)),
                                            quiet=True))
    per_worker = [finished_requests(u) - b for u, b in zip(urls, before)]
    rec = outcome.record
    row = {"config": spec, "repeat": rep, "requests_per_worker": per_worker,
           **{k: rec.get(k) for k in ("completed", "failed", "duration_s", "hit_rate", "metrics_hit_rate",
                                      "oracle_hit_rate", "oracle_hit_rate_capacity", "total_throughput",
                                      "output_throughput", "request_throughput")},
           "ttft_p50_ms": rec["ttft_ms"]["median"], "ttft_p99_ms": rec["ttft_ms"]["p99"],
           "e2e_p99_ms": rec["e2e_latency_ms"]["p99"], "dataset": rec.get("dataset")}
    with open(out / "runs.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def mean_range(values: list[Optional[float]], digits: int) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "n/a"
    return f"{statistics.fmean(vals):.{digits}f} ({min(vals):.{digits}f}-{max(vals):.{digits}f})"


def table(rows: list[dict], configs: list[str]) -> str:
    lines = ["| configuration | runs | hit rate, workers' /metrics: mean (range) | hit rate, responses | "
             "total tok/s: mean (range) | TTFT p50 ms | E2E p99 s | requests per worker (each run) | failed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for spec in configs:
        rs = [r for r in rows if r["config"] == spec]
        if not rs:
            continue
        spread = ", ".join("/".join(str(n) for n in r["requests_per_worker"]) for r in rs)
        lines.append(
            f"| {spec} | {len(rs)} | {mean_range([r['metrics_hit_rate'] for r in rs], 3)} | "
            f"{mean_range([r['hit_rate'] for r in rs], 3)} | {mean_range([r['total_throughput'] for r in rs], 0)} | "
            f"{mean_range([r['ttft_p50_ms'] for r in rs], 0)} | "
            f"{mean_range([r['e2e_p99_ms'] / 1000 for r in rs], 2)} | {spread} | "
            f"{sum(r['failed'] or 0 for r in rs)} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    configs = list(args.configs)
    for spec in configs:
        parse_config(spec)
    if any(spec.startswith("smg:") for spec in configs):
        try:
            import smg.smg_rs  # noqa: F401
        except ImportError:
            raise SystemExit("smg is not installed: pip install -e '.[cluster]'") from None
    out = Path(args.out or REPO_ROOT / "runs" / f"gateway-compare-{datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    from radixserve.default_model import ensure_model_path

    model = ensure_model_path(args.model_path)
    server_args = ["--model-path", model, "--device", args.device, "--max-total-tokens", str(args.pool),
                   "--log-level", "warning"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    print(f"gateway_compare: commit {commit}, {platform.node()}, {os.cpu_count()} cores, model {model}, "
          f"pool {args.pool} per worker; results in {out}", flush=True)
    workers = start_workers(2, server_args, args.device, out, args.start_timeout)
    urls = [w.base_url for w in workers]
    rows: list[dict[str, Any]] = []
    try:
        for rep in range(args.repeats):
            order = configs[rep % len(configs):] + configs[:rep % len(configs)]
            for spec in order:
                t0 = time.monotonic()
                row = run_one(args, spec, urls, model, out, rep)
                rows.append(row)
                print(f"[{rep + 1}/{args.repeats}] {spec}: hit rate {row['metrics_hit_rate']:.3f} (responses "
                      f"{row['hit_rate']:.3f}), {row['total_throughput']:.0f} tok/s, per worker "
                      f"{'/'.join(map(str, row['requests_per_worker']))}, {row['failed']} failed "
                      f"({time.monotonic() - t0:.0f} s)", flush=True)
    finally:
        for w in workers:
            w.stop()
    d = rows[0]["dataset"] if rows else {}
    header = (f"Agent workload: {args.sessions} sessions x {args.turns} turns, {d.get('prompt_tokens', 0):,} prompt "
              f"tokens; KV pool {args.pool:,} tokens per worker; oracle hit rate (one unlimited cache) "
              f"{rows[0]['oracle_hit_rate']:.3f}, (one LRU cache of both pools) "
              f"{rows[0]['oracle_hit_rate_capacity']:.3f}.\n" if rows else "")
    text = header + "\n" + table(rows, configs) + "\n"
    (out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
