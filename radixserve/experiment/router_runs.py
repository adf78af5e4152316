"""The router rows: workers started once (or given), a router per policy over them."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Optional

from radixserve.experiment.configs import ROUTER_WORKER_ARGS, Config
from radixserve.experiment.processes import Server, flush_caches, start_workers
from radixserve.experiment.runs import ConfigResult, bench_into, print_done


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
            print_done(label, res)
    finally:
        for w in workers:
            w.stop()
    return results


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
