"""`python -m radixserve.experiment`: the flags, their checks, and the run from first server to table."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Optional

from radixserve.experiment.configs import (BENCH_DEFAULTS, Config, all_configs, auto_small_pool,
                                           parse_router_policies, pool_arg, router_configs)
from radixserve.experiment.router_runs import run_router_configs
from radixserve.experiment.runs import ConfigResult, print_done, run_config
from radixserve.experiment.tables import write_outputs

DESCRIPTION = ("The seed's experiment in one command: LPM vs FCFS, radix cache on vs off, LRU vs FIFO "
               "eviction under cache pressure, each against a fresh server, with one table and plots.")


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                epilog="Any other flag is passed to the benchmark (python -m radixserve.bench_serving "
                                       "--help), e.g. --num-prompts 64; the default workload is: "
                                       + " ".join(BENCH_DEFAULTS))
    p.add_argument("--model-path", default=None, help="Model directory (default: the built-in tiny Qwen2).")
    p.add_argument("--load-format", default=None, choices=("auto", "safetensors", "dummy"),
                   help="Passed to every server (default: the server's, auto).")
    p.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"),
                   help="Passed to every server (default: cpu).")
    p.add_argument("--output-dir", default=None, help="Where the results go (default: runs/experiment-<timestamp>).")
    p.add_argument("--configs", default=None,
                   help="Comma-separated subset of: " + ", ".join(c.name for c in all_configs())
                        + " ('none': only the router configurations; default: all).")
    p.add_argument("--small-pool-tokens", type=int, default=0,
                   help="KV pool of the small-pool configurations (default 0: a third of the workload's distinct "
                        "tokens, at least 4 of its longest requests).")
    p.add_argument("--server-arg", action="append", default=[],
                   help="Extra flag for every server, e.g. --server-arg=--chunked-prefill-size=256 (repeatable).")
    p.add_argument("--server-start-timeout", type=float, default=300.0,
                   help="Seconds a server may take to become healthy (default: 300).")
    p.add_argument("--disable-plots", action="store_true", help="Write no PNG plots.")
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
    g.add_argument("--router-pool-tokens", type=pool_arg, default=0, metavar="N|full",
                   help="Each worker's KV pool (--max-total-tokens): 0 (default) = the small-pool size "
                        "(--small-pool-tokens or auto, so one worker is under cache pressure and the workers "
                        "together hold twice as much); 'full' = the server's default pool.")
    g.add_argument("--worker-urls", nargs="+", default=[], metavar="URL",
                   help="Use these running servers as the workers instead of starting --router-workers.")
    g.add_argument("--router-arg", action="append", default=[],
                   help="Extra flag for every router, e.g. --router-arg=--cache-threshold=0.5 (repeatable).")
    return p


@dataclass
class Plan:
    """What a run does, after every flag was checked."""
    args: argparse.Namespace
    bench_argv: list[str]
    configs: list[Config]
    router_configs: list[Config]
    policies: list[str]
    out_dir: Path
    base_server_args: list[str]


def _check_bench_args(parser: argparse.ArgumentParser, bench_rest: list[str]) -> list[str]:
    from radixserve.bench_serving import BenchError, build_parser as bench_parser, validate_args

    for bad in ("--base-url", "--host", "--port", "--output-file", "--metrics-url"):
        if any(a == bad or a.startswith(bad + "=") for a in bench_rest):
            parser.error(f"{bad} is chosen by the experiment itself")
    bench_argv = [*BENCH_DEFAULTS, *bench_rest]
    try:
        validate_args(bench_parser(prog=parser.prog).parse_args(bench_argv))
    except BenchError as e:
        parser.error(str(e))
    return bench_argv


def _chosen_configs(parser: argparse.ArgumentParser, args: argparse.Namespace, policies: list[str]) -> list[Config]:
    configs = all_configs()
    if args.configs:
        wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
        known = {c.name: c for c in configs}
        unknown = [w for w in wanted if w not in known]
        if wanted == ["none"] and policies:
            return []
        if unknown or not wanted:
            parser.error(f"unknown configuration(s) {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(known)}" + ("" if policies else " (or 'none' with --router-policies)"))
        configs = [known[w] for w in wanted]
    if not args.small_pool_tokens and configs:
        # Without a given size the first configuration's workload decides the small pool, so a
        # small-pool configuration must not run first.
        configs = [c for c in configs if not c.small_pool] + [c for c in configs if c.small_pool]
        if configs[0].small_pool:
            # No run can size the pool for the others, and a guessed size for the first alone
            # would compare unequal pools.
            parser.error("these configurations all use the small KV pool: give its size with --small-pool-tokens")
    return configs


def _check_router_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    from radixserve.router.workers import normalize_url

    try:
        policies = parse_router_policies(args.router_policies)
    except ValueError as e:
        parser.error(str(e))
    if args.router_workers < 1:
        parser.error(f"--router-workers must be >= 1, got {args.router_workers}")
    for url in args.worker_urls:
        try:
            normalize_url(url)
        except ValueError as e:
            parser.error(f"--worker-urls: {e}")
    if args.worker_urls and not policies:
        parser.error("--worker-urls is for router configurations: give --router-policies too")
    return policies


def make_plan(parser: argparse.ArgumentParser, argv: Optional[list[str]]) -> Plan:
    args, bench_rest = parser.parse_known_args(argv)
    bench_argv = _check_bench_args(parser, bench_rest)
    if args.small_pool_tokens < 0:
        parser.error(f"--small-pool-tokens must be >= 0, got {args.small_pool_tokens}")
    if args.model_path and not os.path.isdir(args.model_path):
        parser.error(f"--model-path {args.model_path!r}: no such directory")
    policies = _check_router_args(parser, args)
    configs = _chosen_configs(parser, args, policies)
    rconfigs = router_configs(policies, len(args.worker_urls) or args.router_workers)
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
    return Plan(args, bench_argv, configs, rconfigs, policies, out_dir, base_server_args)


def run_plan(plan: Plan) -> tuple[list[ConfigResult], int]:
    """Every configuration in order; returns the results and the small pool's size."""
    args = plan.args
    results: list[ConfigResult] = []
    small_pool = args.small_pool_tokens
    total = len(plan.configs) + len(plan.router_configs)
    for i, cfg in enumerate(plan.configs):
        label = f"[{i + 1}/{total}]"
        res, outcome = run_config(cfg, plan.base_server_args, plan.bench_argv, plan.out_dir, small_pool,
                                  args.server_start_timeout, label)
        if outcome is not None and not args.small_pool_tokens and i == 0:
            small_pool = auto_small_pool(outcome.requests)
        results.append(res)
        print_done(label, res)
    if plan.router_configs:
        router_pool = args.router_pool_tokens if args.router_pool_tokens != 0 else small_pool
        if router_pool == 0 and not args.worker_urls:
            why = "no size for the workers' KV pool: the first configuration did not run; give --router-pool-tokens"
            print(f"experiment: router configurations FAILED: {why}", flush=True)
            results += [ConfigResult(c, error=why) for c in plan.router_configs]
        else:
            results += run_router_configs(plan.router_configs, args, plan.base_server_args, plan.bench_argv,
                                          plan.out_dir, router_pool, len(plan.configs), total)
    return results, small_pool


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser(prog="radixserve experiment" if argv is not None else "python -m radixserve.experiment")
    plan = make_plan(parser, argv)
    print(f"experiment: {len(plan.configs) + len(plan.router_configs)} configurations, workload: "
          f"{' '.join(plan.bench_argv)}", flush=True)
    print(f"experiment: writing to {plan.out_dir}", flush=True)
    started = time.monotonic()
    results, small_pool = run_plan(plan)
    command = " ".join(["python -m radixserve.experiment", *(argv if argv is not None else sys.argv[1:])])
    write_outputs(results, plan.out_dir, command=command, bench_argv=plan.bench_argv,
                  server_args=plan.base_server_args, small_pool=small_pool, policies=plan.policies,
                  wall_s=time.monotonic() - started, plots=not plan.args.disable_plots)
    return 0 if any(r.record is not None for r in results) else 1
