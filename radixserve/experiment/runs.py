"""One configuration's run: a fresh server, the benchmark against it, its figures."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from radixserve.experiment.configs import Config
from radixserve.experiment.processes import Server


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


def print_done(label: str, res: ConfigResult) -> None:
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
