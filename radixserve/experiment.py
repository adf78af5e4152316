"""The seed's experiment, one command: `python -m radixserve.experiment` (or `radixserve experiment`).

For each configuration it starts a fresh server (a `radixserve.launch_server` subprocess on a
free port), runs the same benchmark workload with the same seed against it, and stops it. Then it
writes into `--output-dir`:

- `results.json`: every configuration's full benchmark record plus per-request TTFT/latency and the
  hit rate over time;
- `table.md`: the seed's table (throughput, P50/P99 latency, TTFT, hit rate, achieved / Belady bound);
- `throughput_p99.png`, `ttft_cdf.png`, `hit_rate_over_time.png`;
- `server-<config>.log`: each server's log.

Configurations: LPM vs FCFS, radix cache on vs off, and, with a KV pool small enough to force
evictions, LPM vs FCFS and LRU vs FIFO eviction (eviction order only matters under pressure).
With `--router-policies` (opt-in), also a cluster: `--router-workers` servers started once (or
running ones given by `--worker-urls`), and for each policy a router over them, the workers'
caches flushed, the same workload sent through the router; the hit rate is then the aggregate
over every worker (the responses' cached tokens, and the workers' /metrics summed).
Without `--model-path` the built-in tiny random Qwen2 is served (a CPU demo in a few minutes);
on a GPU give `--model-path` (with `--load-format dummy`, a directory with only config.json and
tokenizer files is enough). Flags not listed here are benchmark flags (see
`python -m radixserve.bench_serving --help`), for example `--dataset-name gsp --num-prompts 1000`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from radixserve.bench.oracle import SimRadixCache
from radixserve.bench.report import console_table, experiment_row, markdown_table

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Config:
    name: str
    server_args: list[str]
    small_pool: bool = False
    description: str = ""
    router_policy: Optional[str] = None  # set: a router with this policy over the router workers


def all_configs() -> list[Config]:
    return [
        Config("lpm", ["--schedule-policy", "lpm", "--radix-eviction-policy", "lru"],
               description="LPM scheduling, radix cache on (LRU)"),
        Config("fcfs", ["--schedule-policy", "fcfs", "--radix-eviction-policy", "lru"],
               description="FCFS scheduling, radix cache on (LRU)"),
        Config("no-radix", ["--schedule-policy", "fcfs", "--disable-radix-cache"],
               description="radix cache off (every prompt computed in full)"),
        Config("lpm-small-pool", ["--schedule-policy", "lpm", "--radix-eviction-policy", "lru"], small_pool=True,
               description="LPM, LRU eviction, small KV pool"),
        Config("fcfs-small-pool", ["--schedule-policy", "fcfs", "--radix-eviction-policy", "lru"], small_pool=True,
               description="FCFS, LRU eviction, small KV pool"),
        Config("lpm-fifo-small-pool", ["--schedule-policy", "lpm", "--radix-eviction-policy", "fifo"],
               small_pool=True, description="LPM, FIFO eviction, small KV pool"),
    ]


# The policies `--router-policies all` compares: issue 6's placement policies.
ROUTER_POLICIES_ALL = ("round_robin", "cache_aware", "kv_aware")
ROUTER_WORKER_ARGS = ["--schedule-policy", "lpm", "--radix-eviction-policy", "lru"]


def router_configs(policies: list[str], n_workers: int) -> list[Config]:
    return [Config(f"router-{p}", [], router_policy=p,
                   description=f"{p} router over {n_workers} workers (each LPM, LRU eviction)") for p in policies]


def _router_policies(values: list[str]) -> list[str]:
    """`a b`, `a,b` or `all` -> policy names (ValueError names the bad ones)."""
    from radixserve.router.policies import POLICIES

    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    out: list[str] = []
    for n in names:
        for p in (ROUTER_POLICIES_ALL if n == "all" else (n,)):
            if p not in POLICIES:
                raise ValueError(f"unknown router policy {p!r}; choose from all, {', '.join(POLICIES)}")
            if p not in out:
                out.append(p)
    return out


def _pool_arg(value: str) -> Optional[int]:
    """--router-pool-tokens: 'full' -> None (the server's default pool), else an int >= 0."""
    if value == "full":
        return None
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or 'full', got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 or 'full', got {n}")
    return n


# Benchmark defaults for the experiment: a small agent workload that runs in minutes on a CPU.
BENCH_DEFAULTS = ["--dataset-name", "agent", "--num-prompts", "120", "--request-rate", "8", "--seed", "1",
                  "--warmup-requests", "1"]


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                epilog="Any other flag is passed to the benchmark (bench_serving).")
    p.add_argument("--model-path", default=None, help="Model directory (default: the built-in tiny Qwen2).")
    p.add_argument("--load-format", default=None, choices=("auto", "safetensors", "dummy"))
    p.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    p.add_argument("--output-dir", default=None, help="Default runs/experiment-<timestamp>.")
    p.add_argument("--configs", default=None,
                   help="Comma-separated subset of: " + ", ".join(c.name for c in all_configs())
                        + " ('none': only the router configurations).")
    p.add_argument("--small-pool-tokens", type=int, default=0,
                   help="KV pool of the small-pool configurations (0: a third of the workload's distinct "
                        "tokens, at least 4 of its longest requests).")
    p.add_argument("--server-arg", action="append", default=[],
                   help="Extra flag for every server, e.g. --server-arg=--chunked-prefill-size=256 (repeatable).")
    p.add_argument("--server-start-timeout", type=float, default=300.0)
    p.add_argument("--disable-plots", action="store_true")
    g = p.add_argument_group(
        "router configurations (opt-in)",
        "Each policy gets a router (radixserve.launch_router) over the same workers, whose caches are flushed "
        "before it; the same workload goes through the router. Workers run LPM with LRU eviction, started "
        "once after the single-server configurations (one GPU each when there are enough, else sharing; on "
        "the CPU each gets cores / workers torch threads unless OMP_NUM_THREADS is set).")
    g.add_argument("--router-policies", nargs="+", default=[], metavar="POLICY",
                   help="Routing policies to compare, e.g. 'round_robin cache_aware kv_aware' ('all': those three); "
                        "rows router-<policy>. Default: none.")
    g.add_argument("--router-workers", type=int, default=2, help="Workers to start (default 2).")
    g.add_argument("--router-pool-tokens", type=_pool_arg, default=0, metavar="N|full",
                   help="Each worker's KV pool (--max-total-tokens): 0 (default) = the small-pool size "
                        "(--small-pool-tokens or auto, so one worker is under cache pressure and the workers "
                        "together hold twice as much); 'full' = the server's default pool.")
    g.add_argument("--worker-urls", nargs="+", default=[], metavar="URL",
                   help="Use these running servers as the workers instead of starting --router-workers.")
    g.add_argument("--router-arg", action="append", default=[],
                   help="Extra flag for every router, e.g. --router-arg=--cache-threshold=0.5 (repeatable).")
    return p


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A launch_server (or launch_router) subprocess on a free port, logging to a file."""

    def __init__(self, args: list[str], log_path: Path, module: str = "radixserve.launch_server",
                 env: Optional[dict[str, str]] = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.what = "router" if module.endswith("launch_router") else "server"
        env = {**os.environ, **(env or {})}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        log_args = ["--log-file", str(log_path)] if module == "radixserve.launch_server" else []
        self.cmd = [sys.executable, "-m", module, *args, "--port", str(self.port), *log_args]
        self._out = open(log_path.with_suffix(".out"), "wb")
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=self._out, stderr=subprocess.STDOUT)

    def tail(self, n: int = 2000) -> str:
        self._out.flush()
        try:
            return self.log_path.with_suffix(".out").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.what} exited with code {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=10.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"the {self.what} was not ready after {timeout_s:.0f} s:\n{self.tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


@dataclass
class ConfigResult:
    config: Config
    record: Optional[dict[str, Any]] = None
    error: Optional[str] = None
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    hit_rate_curve: list[tuple[float, float]] = field(default_factory=list)
    server_args: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    router: Optional[dict[str, Any]] = None  # router configurations: workers, spread, decisions


def auto_small_pool(requests) -> int:
    """A third of the workload's distinct tokens (prompts + outputs), room for 4 of its longest requests."""
    cache = SimRadixCache()
    longest = 0
    for r in requests:
        cache.insert(list(r.prompt_ids) + [-1 - i for i in range(r.output_len)])  # outputs never shared
        longest = max(longest, r.prompt_len + r.output_len)
    return max(4 * longest, cache.size // 3)


def bench_into(result: ConfigResult, bench_argv: list[str], progress_desc: str) -> Any:
    """Run bench_serving with these arguments, keep its record, latencies and hit-rate curve in
    `result`; returns bench_serving's outcome."""
    from radixserve.bench.metrics import hit_rate_over_time
    from radixserve.bench_serving import build_parser as bench_parser, run_benchmark

    outcome = asyncio.run(run_benchmark(bench_parser().parse_args(bench_argv), quiet=False,
                                        progress_desc=progress_desc))
    result.record = outcome.record
    ok = [r for r in outcome.results if r.success]
    result.ttft_s = [r.ttft for r in ok]
    result.latency_s = [r.latency for r in ok]
    result.hit_rate_curve = hit_rate_over_time(outcome.results, outcome.t0)
    return outcome


def run_config(cfg: Config, base_server_args: list[str], bench_argv: list[str], out_dir: Path,
               small_pool: int, start_timeout: float, label: str) -> tuple[ConfigResult, Any]:
    from radixserve.bench_serving import BenchError

    server_args = [*base_server_args, *cfg.server_args]
    if cfg.small_pool:
        server_args += ["--max-total-tokens", str(small_pool)]
    result = ConfigResult(cfg, server_args=server_args)
    t0 = time.monotonic()
    server = Server(server_args, out_dir / f"server-{cfg.name}.log")
    outcome = None
    try:
        print(f"{label} {cfg.name}: starting server ({' '.join(cfg.server_args)}"
              f"{f' --max-total-tokens {small_pool}' if cfg.small_pool else ''})", flush=True)
        server.wait_ready(start_timeout)
        outcome = bench_into(result, [*bench_argv, "--base-url", server.base_url], f"{label} {cfg.name}")
    except (BenchError, RuntimeError) as e:
        result.error = str(e).splitlines()[0][:200]
        print(f"{label} {cfg.name}: FAILED: {e}", flush=True)
    finally:
        server.stop()
        result.wall_s = time.monotonic() - t0
    return result, outcome


# ----------------------------------------------------------------------------- router configurations
def _gpu_ids() -> list[str]:
    """The GPUs a worker may be pinned to (CUDA_VISIBLE_DEVICES entries, else every device)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [v.strip() for v in visible.split(",") if v.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    except Exception:
        return []


def worker_envs(n: int, device: str) -> list[dict[str, str]]:
    """Per-worker environment: one GPU each when there are enough; on the CPU, cores / n torch threads."""
    if device != "cpu":
        gpus = _gpu_ids()
        if len(gpus) >= n:
            return [{"CUDA_VISIBLE_DEVICES": gpus[i]} for i in range(n)]
        if gpus or device == "cuda":
            print(f"experiment: {len(gpus)} GPU(s) for {n} workers: they share", flush=True)
            return [{} for _ in range(n)]
    if "OMP_NUM_THREADS" in os.environ:
        return [{} for _ in range(n)]
    threads = str(max(1, (os.cpu_count() or 1) // n))
    return [{"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads} for _ in range(n)]


def start_workers(n: int, server_args: list[str], device: str, out_dir: Path, timeout_s: float) -> list[Server]:
    """n servers started together (their start-ups overlap); all stopped again if one fails."""
    workers = [Server(server_args, out_dir / f"worker-{i}.log", env=env)
               for i, env in enumerate(worker_envs(n, device))]
    try:
        for w in workers:
            w.wait_ready(timeout_s)
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers


def flush_caches(urls: list[str], timeout_s: float = 60.0) -> None:
    """POST /flush_cache to each worker, retrying while it still has requests (409)."""
    import httpx

    for url in urls:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                r = httpx.post(url + "/flush_cache", timeout=30.0)
                if r.status_code == 200:
                    break
                why = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                raise RuntimeError(f"cannot flush the cache of {url}: {why}")
            time.sleep(0.2)


def router_state(router_url: str) -> dict[str, Any]:
    """Requests per worker and routing decisions, from the router's /workers and /metrics."""
    import httpx

    from radixserve.bench.client import parse_prometheus

    workers = httpx.get(router_url + "/workers", timeout=10.0).json()["workers"]
    decisions: dict[str, int] = {}
    for key, value in parse_prometheus(httpx.get(router_url + "/metrics", timeout=10.0).text).items():
        if key.startswith("radixserve:router_routing_decisions_total{"):
            decision = key.split('decision="', 1)[1].split('"', 1)[0]
            decisions[decision] = decisions.get(decision, 0) + int(value)
    return {"requests_per_worker": {w["url"]: w["requests"] for w in workers}, "decisions": decisions}


def run_router_config(cfg: Config, worker_urls: list[str], bench_argv: list[str], out_dir: Path,
                      router_args: list[str], start_timeout: float, label: str,
                      worker_info: dict[str, Any]) -> tuple[ConfigResult, Any]:
    from radixserve.bench_serving import BenchError

    result = ConfigResult(cfg, server_args=list(worker_info.get("server_args") or []))
    result.router = {"policy": cfg.router_policy, **worker_info}
    t0 = time.monotonic()
    outcome = None
    router = None
    try:
        flush_caches(worker_urls)
        print(f"{label} {cfg.name}: starting a {cfg.router_policy} router over {len(worker_urls)} workers", flush=True)
        router = Server(["--worker-urls", *worker_urls, "--policy", cfg.router_policy, "--log-level", "warning",
                         *router_args], out_dir / f"router-{cfg.router_policy}.log", module="radixserve.launch_router")
        router.wait_ready(min(start_timeout, 120.0))
        metrics_args = [a for u in worker_urls for a in ("--metrics-url", u)]
        outcome = bench_into(result, [*bench_argv, "--base-url", router.base_url, *metrics_args],
                             f"{label} {cfg.name}")
        try:
            result.router.update(router_state(router.base_url))
        except Exception as e:  # the figures above stand without it
            result.router["state_error"] = f"{type(e).__name__}: {e}"
    except (BenchError, RuntimeError) as e:
        result.error = str(e).splitlines()[0][:200]
        print(f"{label} {cfg.name}: FAILED: {e}", flush=True)
    finally:
        if router is not None:
            router.stop()
        result.wall_s = time.monotonic() - t0
    return result, outcome


def run_router_configs(cfgs: list[Config], args: argparse.Namespace, base_server_args: list[str],
                       bench_argv: list[str], out_dir: Path, pool: Optional[int], first_index: int,
                       total: int) -> list[ConfigResult]:
    """Start (or take) the workers, run every router configuration over them, stop them."""
    import httpx

    router_args: list[str] = []
    for extra in args.router_arg:
        router_args += extra.split("=", 1) if extra.startswith("--") and "=" in extra else [extra]
    workers: list[Server] = []
    server_args: Optional[list[str]] = None
    try:
        if args.worker_urls:
            urls = [u.rstrip("/") for u in args.worker_urls]
        else:
            server_args = [*base_server_args, *ROUTER_WORKER_ARGS]
            if pool is not None:
                server_args += ["--max-total-tokens", str(pool)]
            print(f"experiment: starting {args.router_workers} router workers ({' '.join(ROUTER_WORKER_ARGS)}"
                  f"{f' --max-total-tokens {pool}' if pool is not None else ''})", flush=True)
            workers = start_workers(args.router_workers, server_args, args.device, out_dir, args.server_start_timeout)
            urls = [w.base_url for w in workers]
        pools = []
        for url in urls:
            try:
                pools.append(httpx.get(url + "/server_info", timeout=30.0).json().get("pool_size"))
            except (httpx.HTTPError, ValueError) as e:
                raise RuntimeError(f"worker {url} does not answer /server_info: {e}") from None
    except RuntimeError as e:
        for w in workers:
            w.stop()
        why = str(e).splitlines()[0][:200]
        print(f"experiment: router workers FAILED: {e}", flush=True)
        return [ConfigResult(c, error=why) for c in cfgs]
    info = {"worker_urls": urls, "started_workers": not args.worker_urls, "server_args": server_args,
            "pool_tokens_per_worker": pools}
    results = []
    try:
        for i, cfg in enumerate(cfgs):
            label = f"[{first_index + i + 1}/{total}]"
            res, _ = run_router_config(cfg, urls, bench_argv, out_dir, router_args, args.server_start_timeout,
                                       label, info)
            results.append(res)
            _print_done(label, res)
    finally:
        for w in workers:
            w.stop()
    return results


def _print_done(label: str, res: ConfigResult) -> None:
    if res.record is None:
        return
    r = res.record
    spread = ""
    if res.router and res.router.get("requests_per_worker"):
        spread = ", per worker " + "/".join(str(n) for n in res.router["requests_per_worker"].values())
    print(f"{label} {res.config.name}: {r['completed']} ok, {r['failed']} failed, "
          f"{r['total_throughput']:.0f} tok/s, P99 {r['e2e_latency_ms']['p99'] / 1000:.2f} s, "
          f"hit rate {r['hit_rate'] if r['hit_rate'] is not None else float('nan'):.3f}{spread} "
          f"({res.wall_s:.0f} s)", flush=True)


ROUTER_COLUMNS = ("configuration", "workers", "KV pool per worker", "requests per worker", "routing decisions",
                  "hit rate (responses)", "hit rate (workers' /metrics)", "req/s", "output tok/s",
                  "TTFT P99 (ms)", "P99 latency (s)", "failed")


def router_rows(results: list[ConfigResult]) -> list[list[str]]:
    rows = []
    for r in results:
        if r.config.router_policy is None:
            continue
        info = r.router or {}
        pools = info.get("pool_tokens_per_worker") or []
        pool = "/".join(str(p) for p in pools) if len(set(pools)) > 1 else (str(pools[0]) if pools else "-")
        spread = "/".join(str(n) for n in (info.get("requests_per_worker") or {}).values()) or "-"
        decisions = ", ".join(f"{k} {v}" for k, v in sorted((info.get("decisions") or {}).items())) or "-"
        m = r.record
        if m is None:
            rows.append([r.config.name, str(len(info.get("worker_urls") or [])) or "-", pool, "-", "-", "-", "-",
                         "-", "-", "-", "-", r.error or "did not run"])
            continue

        def f(v, d=3):
            return "n/a" if v is None else f"{v:.{d}f}"

        rows.append([r.config.name, str(len(info.get("worker_urls") or [])), pool, spread, decisions,
                     f(m.get("hit_rate")), f(m.get("metrics_hit_rate")), f(m.get("request_throughput"), 2),
                     f(m.get("output_throughput"), 0), f(m["ttft_ms"]["p99"], 0),
                     f(m["e2e_latency_ms"]["p99"] / 1000, 2), str(m.get("failed", 0))])
    return rows


def summary_rows(results: list[ConfigResult]) -> list[list[str]]:
    return [experiment_row(r.config.name, r.record, r.error) for r in results]


def write_plots(results: list[ConfigResult], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    done = [r for r in results if r.record is not None]
    if not done:
        return []
    names = [r.config.name for r in done]
    files = []

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.bar(names, [r.record["total_throughput"] for r in done], color="tab:blue")
    ax1.set_title("Total token throughput (tok/s)")
    ax2.bar(names, [r.record["e2e_latency_ms"]["p99"] / 1000 for r in done], color="tab:red")
    ax2.set_title("P99 end-to-end latency (s)")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=30)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.tight_layout()
    fig.savefig(out_dir / "throughput_p99.png", dpi=110)
    plt.close(fig)
    files.append("throughput_p99.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in done:
        xs = np.sort(np.asarray(r.ttft_s) * 1000)
        if len(xs):
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=r.config.name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "ttft_cdf.png", dpi=110)
    plt.close(fig)
    files.append("ttft_cdf.png")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in done:
        if r.hit_rate_curve:
            xs, ys = zip(*r.hit_rate_curve)
            ax.plot(xs, ys, label=r.config.name)
    oracle = done[0].record.get("oracle_hit_rate")
    if oracle is not None:
        ax.axhline(oracle, color="black", linestyle="--", linewidth=1, label="oracle (unlimited)")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("cumulative prefix hit rate")
    ax.set_ylim(0, 1)
    ax.set_title("Prefix hit rate over time")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "hit_rate_over_time.png", dpi=110)
    plt.close(fig)
    files.append("hit_rate_over_time.png")
    return files


def _pool_text(r: ConfigResult) -> str:
    pools = (r.router or {}).get("pool_tokens_per_worker") or []
    if not pools:
        return "workers did not start"
    same = len(set(pools)) == 1
    return f"KV pool {pools[0] if same else '/'.join(str(p) for p in pools)} tokens per worker"


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser(prog="radixserve experiment" if argv is not None else None)
    args, bench_rest = parser.parse_known_args(argv)
    from radixserve.bench_serving import BenchError, build_parser as bench_parser, validate_args

    for bad in ("--base-url", "--host", "--port", "--output-file", "--metrics-url"):
        if any(a == bad or a.startswith(bad + "=") for a in bench_rest):
            parser.error(f"{bad} is chosen by the experiment itself")
    bench_argv = [*BENCH_DEFAULTS, *bench_rest]
    bp = bench_parser(prog="radixserve experiment")
    try:
        bench_args = bp.parse_args(bench_argv)
        validate_args(bench_args)
    except SystemExit as e:  # argparse already printed the reason
        return int(e.code or 2)
    except BenchError as e:
        parser.error(str(e))
    if args.small_pool_tokens < 0:
        parser.error(f"--small-pool-tokens must be >= 0, got {args.small_pool_tokens}")
    if args.model_path and not os.path.isdir(args.model_path):
        parser.error(f"--model-path {args.model_path!r}: no such directory")
    try:
        policies = _router_policies(args.router_policies)
    except ValueError as e:
        parser.error(str(e))
    if args.router_workers < 1:
        parser.error(f"--router-workers must be >= 1, got {args.router_workers}")
    for url in args.worker_urls:
        from radixserve.router.workers import normalize_url

        try:
            normalize_url(url)
        except ValueError as e:
            parser.error(f"--worker-urls: {e}")
    if args.worker_urls and not policies:
        parser.error("--worker-urls is for router configurations: give --router-policies too")
    configs = all_configs()
    if args.configs:
        wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
        known = {c.name: c for c in configs}
        unknown = [w for w in wanted if w not in known]
        if wanted == ["none"] and policies:
            configs = []
        elif unknown or not wanted:
            parser.error(f"unknown configuration(s) {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(known)}" + ("" if policies else " (or 'none' with --router-policies)"))
        else:
            configs = [known[w] for w in wanted]
    n_router_workers = len(args.worker_urls) or args.router_workers
    rconfigs = router_configs(policies, n_router_workers)
    if rconfigs and not args.worker_urls and args.router_pool_tokens == 0 and not args.small_pool_tokens \
            and not configs:
        parser.error("the router workers' pool is the small pool, and no configuration runs before them to size "
                     "it: give --router-pool-tokens (or --small-pool-tokens)")

    out_dir = Path(args.output_dir or f"runs/experiment-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"cannot create --output-dir {str(out_dir)!r}: {e}")
    base_server_args = ["--device", args.device]
    if args.model_path:
        base_server_args += ["--model-path", args.model_path]
    if args.load_format:
        base_server_args += ["--load-format", args.load_format]
    for extra in args.server_arg:
        base_server_args += extra.split("=", 1) if extra.startswith("--") and "=" in extra else [extra]

    print(f"experiment: {len(configs) + len(rconfigs)} configurations, workload: {' '.join(bench_argv)}",
          flush=True)
    print(f"experiment: writing to {out_dir}", flush=True)
    started = time.monotonic()
    results: list[ConfigResult] = []
    small_pool = args.small_pool_tokens
    # Without a given size, the first configuration's workload decides the small pool, so a
    # small-pool configuration must not run first.
    if not small_pool and configs and configs[0].small_pool:
        configs = [c for c in configs if not c.small_pool] + [c for c in configs if c.small_pool]
    if not small_pool and configs and configs[0].small_pool:
        # Every configuration is a small-pool one: no run can size the pool for the others, and a
        # guessed size for the first alone would compare unequal pools.
        parser.error("these configurations all use the small KV pool: give its size with --small-pool-tokens")
    total = len(configs) + len(rconfigs)
    for i, cfg in enumerate(configs):
        label = f"[{i + 1}/{total}]"
        res, outcome = run_config(cfg, base_server_args, bench_argv, out_dir, small_pool,
                                  args.server_start_timeout, label)
        if outcome is not None and not args.small_pool_tokens and i == 0:
            small_pool = auto_small_pool(outcome.requests)
        results.append(res)
        _print_done(label, res)
    router_pool: Optional[int] = args.router_pool_tokens if args.router_pool_tokens != 0 else small_pool
    if rconfigs:
        if router_pool == 0 and not args.worker_urls:
            why = "no size for the workers' KV pool: the first configuration did not run; give --router-pool-tokens"
            print(f"experiment: router configurations FAILED: {why}", flush=True)
            results += [ConfigResult(c, error=why) for c in rconfigs]
        else:
            results += run_router_configs(rconfigs, args, base_server_args, bench_argv, out_dir, router_pool,
                                          len(configs), total)

    rows = summary_rows(results)
    first = next((r.record for r in results if r.record is not None), None)
    meta = {"command": " ".join(["python -m radixserve.experiment", *(argv if argv is not None else sys.argv[1:])]),
            "bench_argv": bench_argv, "server_args": base_server_args, "small_pool_tokens": small_pool,
            "router_policies": policies,
            "dataset": first.get("dataset") if first else None,
            "oracle_hit_rate": first.get("oracle_hit_rate") if first else None,
            "wall_s": round(time.monotonic() - started, 1)}
    payload = {"meta": meta, "configs": [
        {"name": r.config.name, "description": r.config.description, "server_args": r.server_args,
         "error": r.error, "wall_s": round(r.wall_s, 2), "record": r.record, "ttft_s": r.ttft_s,
         "latency_s": r.latency_s, "hit_rate_curve": r.hit_rate_curve,
         **({"router": r.router} if r.config.router_policy else {})} for r in results]}
    (out_dir / "results.json").write_text(json.dumps(payload, indent=1))
    table = markdown_table(rows)
    legend = "\n".join(f"- `{r.config.name}`: {r.config.description}"
                       + (f" ({small_pool} tokens)" if r.config.small_pool else "")
                       + (f" ({_pool_text(r)})" if r.config.router_policy else "") for r in results)
    dataset = meta["dataset"] or {}
    header = (f"Workload: `{' '.join(bench_argv)}`; {dataset.get('num_requests', '?')} requests, "
              f"{dataset.get('prompt_tokens', '?')} prompt tokens, system-prompt share "
              f"{dataset.get('system_prompt_fraction', '?')}; oracle hit rate (unlimited) "
              f"{meta['oracle_hit_rate'] if meta['oracle_hit_rate'] is None else round(meta['oracle_hit_rate'], 3)}.")
    rrows = router_rows(results)
    router_note = ("Router configurations: the hit rate is the aggregate over all workers; the Belady bound and "
                   "the LRU reference simulate one cache as large as all the workers' pools together.")
    router_md = f"\n{router_note}\n\n{markdown_table(rrows, ROUTER_COLUMNS)}\n" if rrows else ""
    (out_dir / "table.md").write_text(f"{header}\n\n{table}\n\n{legend}\n{router_md}")
    plots = [] if args.disable_plots else write_plots(results, out_dir)

    print()
    print(header)
    print()
    print(console_table(rows))
    print()
    print("latency in s, TTFT in ms; 'Belady bound': the best any eviction order reaches in the server's KV pool with "
          "the requests in send order (achieved/Belady = hit rate / that bound); 'LRU at capacity': LRU in that pool")
    if rrows:
        print()
        print(router_note)
        print()
        print(console_table(rrows, ROUTER_COLUMNS))
    print(f"results: {out_dir / 'results.json'}, table: {out_dir / 'table.md'}"
          + (f", plots: {', '.join(str(out_dir / p) for p in plots)}" if plots else ""))
    print(f"total time {meta['wall_s']:.0f} s")
    return 0 if any(r.record is not None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
