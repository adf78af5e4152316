"""Benchmark a running server: `python -m radixserve.bench_serving` (or `radixserve bench`).

The seed article's command works as written with the package name swapped:

    python -m radixserve.bench_serving --backend radixserve --model /path/to/Qwen2-7B-Instruct \\
        --num-prompts 1000 --request-rate 5 --random-input 1024 --random-output 512 \\
        --host 127.0.0.1 --port 8000

It prints SGLang's report (throughput, latency / TTFT / TPOT / ITL percentiles) plus the prefix
cache: the hit rate measured from the responses, the same from the server's `/metrics` counters
before and after the run, and the oracles over the prompts as sent: unlimited capacity
(radixserve/bench/oracle.py), Belady's MIN in the server's KV pool (radixserve/bench/belady.py: the
best any eviction order reaches with the requests in send order) and LRU in that pool, with
achieved / each.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Optional

from radixserve.bench.client import (BACKENDS, FailFast, RequestResult, ServerUnreachable, api_path, build_payload,
                                     check_reachable, encode_payload, fetch_json, fetch_metrics, fetch_tokenizer_dir,
                                     open_connections, send_request)
from radixserve.bench.datasets import (DATASETS, WORDS, BenchRequest, DatasetArgs, DatasetError, build_dataset,
                                       dataset_summary)
from radixserve.bench.belady import belady_hit_rate
from radixserve.bench.closed_loop import extend_turn
from radixserve.bench.metrics import BenchMetrics, compute_metrics, lost_previous_prompts
from radixserve.bench.oracle import OracleRequest, oracle_hit_rate
from radixserve.bench.report import format_report
from radixserve.http_common.loop_lag import watch_loop_lag
from radixserve.process import tokenizer as process_tokenizer


KEEPALIVE_S = 4.0


class BenchError(RuntimeError):
    """A run that cannot start: the message says why, without a traceback."""


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Benchmark the online serving throughput, latency and "
                                "prefix-cache hit rate of a running server.")
    p.add_argument("--backend", default="radixserve", choices=BACKENDS,
                   help="radixserve/sglang: POST /generate; vllm/openai: /v1/completions; openai-chat: "
                        "/v1/chat/completions (default: radixserve).")
    p.add_argument("--base-url", default=None, help="Server URL (overrides --host/--port).")
    p.add_argument("--host", default="127.0.0.1", help="Server host when --base-url is not given (default: 127.0.0.1).")
    p.add_argument("--port", type=int, default=None, help="Default 30000 (radixserve/sglang) or 8000.")
    p.add_argument("--model", default=None, help="Model name sent to OpenAI endpoints (default: the served one).")
    p.add_argument("--tokenizer", default=None,
                   help="Local tokenizer directory (default: fetched from the server's /tokenizer).")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or None,
                   help="Sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY).")
    p.add_argument("--dataset-name", default="random", choices=DATASETS,
                   help="The workload (default: random); see docs/experiment.md for each.")
    p.add_argument("--dataset-path", default=None, help="Local ShareGPT JSON file for --dataset-name sharegpt.")
    p.add_argument("--prompt-ids", action="store_true",
                   help="Send every prompt as token ids (the local tokenizer's), not text; random-ids always does.")
    p.add_argument("--num-prompts", type=int, default=1000,
                   help="Requests to send (default: 1000); for agent, sessions x turns.")
    p.add_argument("--random-input-len", "--random-input", dest="random_input_len", type=int, default=1024,
                   help="random/random-ids: prompt tokens per request (default: 1024).")
    p.add_argument("--random-output-len", "--random-output", dest="random_output_len", type=int, default=512,
                   help="random/random-ids: output tokens per request (default: 512).")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random/random-ids: lengths drawn uniformly from [len * (1 - ratio), len] (default: 0).")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: output tokens per request (default: the recorded reply's length).")
    p.add_argument("--gsp-num-groups", type=int, default=64,
                   help="generated-shared-prefix: groups, each with its own system prompt (default: 64).")
    p.add_argument("--gsp-prompts-per-group", type=int, default=16,
                   help="generated-shared-prefix: questions per group (default: 16).")
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048,
                   help="generated-shared-prefix: tokens of each group's system prompt (default: 2048).")
    p.add_argument("--gsp-question-len", type=int, default=128,
                   help="generated-shared-prefix: tokens of each question (default: 128).")
    p.add_argument("--gsp-output-len", type=int, default=256,
                   help="generated-shared-prefix: output tokens per request (default: 256).")
    p.add_argument("--agent-num-sessions", type=int, default=0,
                   help="agent: conversations (default 0: num-prompts / agent-turns).")
    p.add_argument("--agent-turns", type=int, default=4, help="agent: turns per conversation (default: 4).")
    p.add_argument("--agent-num-system-prompts", type=int, default=3,
                   help="agent: distinct system prompts the conversations share (default: 3).")
    p.add_argument("--agent-system-prompt-len", type=int, default=160,
                   help="agent: tokens of each system prompt (default: 160).")
    p.add_argument("--agent-user-len", type=int, default=24, help="agent: tokens of each user message (default: 24).")
    p.add_argument("--agent-assistant-len", type=int, default=24,
                   help="agent: tokens of each earlier assistant reply carried in the history (default: 24).")
    p.add_argument("--agent-output-len", type=int, default=16,
                   help="agent: output tokens generated per turn (default: 16).")
    p.add_argument("--agent-think-time", dest="agent_think_time_s", type=float, default=0.5,
                   help="agent: mean seconds (exponential) a session waits after a turn finished (default: 0.5).")
    p.add_argument("--agent-closed-loop", action="store_true",
                   help="agent: each turn's prompt is, in token ids, the previous prompt + the tokens the server "
                        "returned + the new user message (not the dataset's fixed reply), so decoded tokens "
                        "can be cached as for a real multi-turn client.")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second; inf sends everything at once (default: inf).")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="Most requests in flight at once (default: no limit).")
    p.add_argument("--seed", type=int, default=1,
                   help="Seed of the dataset and the arrival times (default: 1).")
    p.add_argument("--warmup-requests", type=int, default=1,
                   help="Short requests before the run, on prompts unrelated to the workload (default: 1).")
    p.add_argument("--flush-cache", action="store_true", help="POST /flush_cache after warm-up.")
    p.add_argument("--request-timeout", type=float, default=600.0, help="Seconds one request may take (default: 600).")
    p.add_argument("--oracle-capacity", type=int, default=None,
                   help="KV tokens for the oracles at capacity, Belady's bound and the LRU reference "
                        "(default: the server's pool size).")
    p.add_argument("--oracle-page-size", type=int, default=None,
                   help="Page size of the Belady bound (default: the server's page size, else 1).")
    p.add_argument("--oracle-running", type=int, default=1,
                   help="Requests the Belady bound runs at once, each holding its prompt + output "
                        "(default 1: a bound for any server serving the requests in send order).")
    p.add_argument("--metrics-url", action="append", default=[], metavar="URL",
                   help="Read the prefix-cache counters from this server's /metrics instead of the benchmarked "
                        "one's; repeatable, summed. Through a router, give each of its workers.")
    p.add_argument("--output-file", default=None, help="Append one JSON record per run (JSON lines).")
    p.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    return p


def validate_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise BenchError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if math.isnan(args.request_rate) or args.request_rate <= 0:
        raise BenchError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.warmup_requests < 0:
        raise BenchError(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    if args.request_timeout <= 0:
        raise BenchError(f"--request-timeout must be > 0, got {args.request_timeout}")
    if args.oracle_capacity is not None and args.oracle_capacity < 0:
        raise BenchError(f"--oracle-capacity must be >= 0, got {args.oracle_capacity}")
    if args.oracle_page_size is not None and args.oracle_page_size < 1:
        raise BenchError(f"--oracle-page-size must be >= 1, got {args.oracle_page_size}")
    if args.oracle_running < 1:
        raise BenchError(f"--oracle-running must be >= 1, got {args.oracle_running}")
    if args.port is not None and not 0 < args.port < 65536:
        raise BenchError(f"--port must be in 1..65535, got {args.port}")
    if args.tokenizer and not os.path.isdir(args.tokenizer):
        raise BenchError(f"--tokenizer {args.tokenizer!r}: no such directory")
    if args.agent_closed_loop and args.dataset_name != "agent":
        raise BenchError("--agent-closed-loop needs --dataset-name agent")
    if args.agent_closed_loop and args.backend == "openai-chat":
        raise BenchError("--agent-closed-loop sends token ids, which openai-chat cannot take")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        raise BenchError("--dataset-name sharegpt needs --dataset-path (a local ShareGPT JSON file)")
    if args.dataset_path and not os.path.isfile(args.dataset_path):
        raise BenchError(f"--dataset-path {args.dataset_path!r}: no such file")
    dataset_args(args).validate()


def dataset_args(args: argparse.Namespace) -> DatasetArgs:
    return DatasetArgs(
        name=args.dataset_name, num_prompts=args.num_prompts, seed=args.seed,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_range_ratio=args.random_range_ratio, dataset_path=args.dataset_path,
        sharegpt_output_len=args.sharegpt_output_len, gsp_num_groups=args.gsp_num_groups,
        gsp_prompts_per_group=args.gsp_prompts_per_group, gsp_system_prompt_len=args.gsp_system_prompt_len,
        gsp_question_len=args.gsp_question_len, gsp_output_len=args.gsp_output_len,
        agent_num_sessions=args.agent_num_sessions, agent_turns=args.agent_turns,
        agent_num_system_prompts=args.agent_num_system_prompts,
        agent_system_prompt_len=args.agent_system_prompt_len, agent_user_len=args.agent_user_len,
        agent_assistant_len=args.agent_assistant_len, agent_output_len=args.agent_output_len,
        agent_think_time_s=args.agent_think_time_s)


def base_url_of(args: argparse.Namespace) -> str:
    if args.base_url:
        return args.base_url.rstrip("/")
    port = args.port if args.port is not None else (30000 if args.backend in ("radixserve", "sglang") else 8000)
    return f"http://{args.host}:{port}"


@dataclass
class BenchOutcome:
    record: dict[str, Any]
    metrics: BenchMetrics
    results: list[RequestResult]
    requests: list[BenchRequest]
    t0: float
    report: str = ""
    oracle_per_request: dict[str, list[int]] = field(default_factory=dict)


def load_tokenizer(path: str):
    try:
        return process_tokenizer.load_tokenizer(path, required=True)
    except ValueError as e:  # a directory without usable tokenizer files
        raise BenchError(str(e)) from None


async def _issue_all(session, url: str, args: argparse.Namespace, requests: list[BenchRequest], bodies: list[bytes],
                     model: Optional[str], use_ids: bool, headers: dict[str, str], progress,
                     tokenizer=None, on_result: Optional[Callable[[RequestResult], None]] = None
                     ) -> tuple[list[RequestResult], float]:
    rng = random.Random(args.seed)
    gaps = [0.0 if math.isinf(args.request_rate) else rng.expovariate(args.request_rate) for _ in requests]
    slots = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()
    finished: dict[tuple[int, int], asyncio.Event] = {}
    for r in requests:
        if r.session_id is not None:
            finished[(r.session_id, r.turn)] = asyncio.Event()
    results: list[Optional[RequestResult]] = [None] * len(requests)
    closed_loop = getattr(args, "agent_closed_loop", False)
    index_of = {(r.session_id, r.turn): i for i, r in enumerate(requests) if r.session_id is not None}
    t0 = time.perf_counter()

    async def one(i: int, req: BenchRequest, at: float) -> None:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if req.session_id is not None and req.turn > 0:
            prev = finished.get((req.session_id, req.turn - 1))
            if prev is not None:
                await prev.wait()
            if closed_loop:  # the prompt extends what the server returned (bench/closed_loop.py)
                j = index_of[(req.session_id, req.turn - 1)]
                extend_turn(req, requests[j], results[j], tokenizer)
                bodies[i] = encode_payload(build_payload(args.backend, req, model, use_ids))
            if req.think_time_s > 0:
                await asyncio.sleep(req.think_time_s)
        try:
            async with slots:
                res = await send_request(session, url, args.backend, req, i, model, use_ids, headers, body=bodies[i])
            results[i] = res  # before the session's next turn wakes up: it reads this result
        finally:
            if req.session_id is not None:
                finished[(req.session_id, req.turn)].set()
        if progress is not None:
            progress.update(1)
        if on_result is not None:
            on_result(res)
        if fail_fast.add(res):
            for task in tasks:
                if task is not asyncio.current_task():
                    task.cancel()

    fail_fast = FailFast(len(requests))
    at = 0.0
    tasks: list[asyncio.Task] = []
    for i, req in enumerate(requests):
        at += gaps[i]
        tasks.append(asyncio.create_task(one(i, req, at)))
    await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:  # anything but a cancellation by the fail-fast rule is a bug: raise it
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()
    if any(task.cancelled() for task in tasks):
        raise BenchError(fail_fast.message())
    return [r for r in results if r is not None], t0


def _opening_burst(args: argparse.Namespace, requests: list[BenchRequest]) -> int:
    """How many requests are sent at the start, at once: with --request-rate inf every request that
    waits for no earlier turn, up to --max-concurrency; at a finite rate they come one by one."""
    if not math.isinf(args.request_rate):
        return 0
    n = sum(1 for r in requests if r.session_id is None or r.turn == 0)
    return min(n, args.max_concurrency) if args.max_concurrency else n


def _oracle(requests: list[BenchRequest], results: list[RequestResult], capacity: Optional[int], tokenizer,
            page_size: int = 1, running: int = 1) -> dict[str, Any]:
    """The oracles over the prompts as sent: unlimited, Belady's MIN and LRU at capacity."""
    by_index = {r.index: r for r in results}
    seq = []
    for i, req in enumerate(requests):
        res = by_index.get(i)
        output: list[int] = []
        if res is not None and res.success:
            if res.output_ids is not None:
                output = list(res.output_ids)
            elif tokenizer is not None and res.output_text:
                output = list(tokenizer.encode(res.output_text, add_special_tokens=False))
        seq.append(OracleRequest(prompt=req.prompt_ids, output=output))
    counted = [i for i in range(len(requests)) if i in by_index and by_index[i].success]

    def rate(hits: list[int]) -> Optional[float]:
        total = sum(requests[i].prompt_len for i in counted)
        return sum(hits[i] for i in counted) / total if total else None

    unlimited = oracle_hit_rate(seq)
    lru = oracle_hit_rate(seq, capacity=capacity) if capacity else None
    belady = belady_hit_rate(seq, capacity, page_size=page_size, running=running) if capacity else None
    return {"unlimited": rate(unlimited.per_request_hits),
            "lru": rate(lru.per_request_hits) if lru else None,
            "belady": rate(belady.per_request_hits) if belady else None,
            "per_request": {"unlimited": unlimited.per_request_hits,
                            "capacity": lru.per_request_hits if lru else [],
                            "belady": belady.per_request_hits if belady else []}}


async def run_benchmark(args: argparse.Namespace, *, quiet: bool = False, progress_desc: str = "requests",
                        on_result: Optional[Callable[[RequestResult], None]] = None) -> BenchOutcome:
    """One run against a server; raises BenchError when it cannot start, or when its first
    requests all fail the same way. `on_result` is called with each request's result as it ends."""
    import aiohttp

    validate_args(args)
    base_url = base_url_of(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    timeout = aiohttp.ClientTimeout(total=args.request_timeout, sock_connect=10)
    # Idle connections are closed before a server's keep-alive ends (uvicorn's default is 5 s): else
    # the first request after a pause (building the dataset with a large tokenizer takes longer)
    # may go out on a connection the server is closing and fail as "connection lost".
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    tokenizer_dir = None
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, trust_env=False) as session:
        try:
            await check_reachable(session, base_url, headers)
        except ServerUnreachable as e:
            raise BenchError(str(e)) from None
        info = await fetch_json(session, base_url + "/server_info", headers) or \
            await fetch_json(session, base_url + "/get_server_info", headers) or {}
        vocab_size = info.get("vocab_size")
        capacity = args.oracle_capacity if args.oracle_capacity is not None else \
            info.get("pool_size") or info.get("max_total_num_tokens")
        model = args.model
        if args.backend in ("vllm", "openai", "openai-chat") and model is None:
            models = await fetch_json(session, base_url + "/v1/models", headers) or {}
            data = models.get("data") or []
            model = data[0].get("id") if data else None
        # The tokenizer: a local path, else the served one.
        tokenizer = None
        if args.tokenizer:
            tokenizer = load_tokenizer(args.tokenizer)
        else:
            tokenizer_dir = await fetch_tokenizer_dir(session, base_url, headers)
            if tokenizer_dir:
                tokenizer = load_tokenizer(tokenizer_dir)
        try:
            try:
                requests = build_dataset(dataset_args(args), tokenizer, vocab_size)
            except DatasetError as e:
                raise BenchError(str(e)) from None
            summary = dataset_summary(requests)
            use_ids = args.dataset_name == "random-ids" or args.prompt_ids or args.agent_closed_loop
            if use_ids and args.backend == "openai-chat":
                raise BenchError("token-id prompts (random-ids, --prompt-ids) cannot be sent to openai-chat")
            url = base_url + api_path(args.backend)
            say(f"#requests: {len(requests)}  prompt tokens: {summary['prompt_tokens']}  "
                f"system-prompt share: {summary['system_prompt_fraction']:.3f}  server: {base_url}")
            tokenizer_agrees = await _warmup(session, url, args, requests, model, headers, vocab_size,
                                             tokenizer, say)
            if args.flush_cache:
                try:
                    async with session.post(base_url + "/flush_cache", headers=headers) as resp:
                        if resp.status != 200:
                            say(f"warning: /flush_cache answered HTTP {resp.status}; the cache was not flushed")
                except aiohttp.ClientError as e:
                    say(f"warning: /flush_cache failed: {e}")
            # Before the clock starts, every body is encoded and the connections the opening burst
            # needs are open: inside the run both held the client's loop (with 1,024 prompts of
            # ~2,000 ids, 0.4-0.6 s, a tenth of a 0.5B gsp run), the first requests' tokens
            # waiting in their sockets meanwhile, read as server latency.
            bodies = [encode_payload(build_payload(args.backend, r, model, use_ids)) for r in requests]
            await open_connections(session, base_url, headers, _opening_burst(args, requests))
            metrics_urls = [u.rstrip("/") for u in args.metrics_url] or [base_url]
            before = await _fetch_counters(session, metrics_urls, headers)
            progress = None
            if not args.disable_tqdm and not quiet:
                from tqdm.auto import tqdm

                progress = tqdm(total=len(requests), desc=progress_desc, unit="req")
            start = time.perf_counter()
            try:
                async with watch_loop_lag("bench client", log=False) as lag:
                    results, t0 = await _issue_all(session, url, args, requests, bodies, model, use_ids, headers,
                                                   progress, tokenizer=tokenizer, on_result=on_result)
            finally:
                if progress is not None:
                    progress.close()
            duration = time.perf_counter() - start
            metrics = compute_metrics(results, duration)
            metrics.client_loop_stalls, metrics.client_loop_max_lag_ms = lag.stalls, lag.max_lag_s * 1000
            after = await _settled_metrics(session, metrics_urls, headers, before, metrics)
        finally:
            if tokenizer_dir:
                shutil.rmtree(tokenizer_dir, ignore_errors=True)
    _fill_metrics_delta(metrics, before, after)
    page_size = args.oracle_page_size or (info.get("settings") or {}).get("page_size") or info.get("page_size") or 1
    oracles = _oracle(requests, results, capacity, tokenizer, page_size, args.oracle_running)
    per_request = oracles["per_request"]
    metrics.oracle_hit_rate = oracles["unlimited"]
    metrics.oracle_hit_rate_capacity = oracles["lru"]
    metrics.oracle_belady_hit_rate = oracles["belady"]
    metrics.oracle_capacity_tokens = capacity
    metrics.oracle_page_size, metrics.oracle_running = page_size, args.oracle_running
    lost = lost_previous_prompts([(r.session_id, r.turn) for r in requests], results)
    if lost is not None:
        metrics.later_turns, metrics.turns_that_lost_the_previous_prompt, metrics.lost_prompt_tokens = lost
    if metrics.hit_rate is not None:
        ratio = lambda bound: metrics.hit_rate / bound if bound else None  # noqa: E731
        metrics.achieved_over_oracle = ratio(oracles["unlimited"])
        metrics.achieved_over_oracle_capacity = ratio(oracles["lru"])
        metrics.achieved_over_belady = ratio(oracles["belady"])
    settings = {k: (None if isinstance(v, float) and math.isinf(v) and k != "request_rate" else v)
                for k, v in vars(args).items() if k != "api_key"}
    settings["request_rate"] = "inf" if math.isinf(args.request_rate) else args.request_rate
    record = {"timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"), "base_url": base_url,
              "settings": settings,
              # closed loop: the prompts as sent (each turn's grew by what the server returned)
              "dataset": dataset_summary(requests) if args.agent_closed_loop else summary,
              "server": {k: info.get(k) for k in ("pool_size", "context_length", "max_running_requests", "device",
                                                  "dtype", "model_path", "served_model_name", "version")},
              "server_settings": info.get("settings"), "tokenizer_matches_server": tokenizer_agrees,
              **metrics.to_dict()}
    report = format_report(metrics, backend=args.backend, request_rate=args.request_rate,
                           max_concurrency=args.max_concurrency, dataset=args.dataset_name)
    if args.output_file:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(args.output_file)), exist_ok=True)
            with open(args.output_file, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            raise BenchError(f"cannot write --output-file {args.output_file!r}: {e}") from None
    return BenchOutcome(record=record, metrics=metrics, results=results, requests=requests, t0=t0,
                        report=report, oracle_per_request=per_request)


async def _warmup(session, url, args, requests, model, headers, vocab_size, tokenizer, say) -> Optional[bool]:
    """Short requests unrelated to the workload (they leave nothing it could reuse).

    With a tokenizer and a text backend, the warm-up is text, and the server's prompt token count
    is compared with ours: returns whether they agree (None when not checked).
    """
    if args.warmup_requests == 0:
        return None
    rng = random.Random(args.seed + 7919)
    check_text = tokenizer is not None and args.backend != "openai-chat" and args.dataset_name != "random-ids" \
        and not args.prompt_ids
    special = set(getattr(tokenizer, "all_special_ids", []) or []) if tokenizer is not None else set()
    vocab = vocab_size or (len(tokenizer) if tokenizer is not None else 256)
    ids = [t for t in range(vocab) if t not in special]
    failures, agree = [], None
    for i in range(args.warmup_requests):
        if check_text or args.backend == "openai-chat":
            text = f"warm-up {rng.randrange(10**9)}: " + " ".join(rng.choice(WORDS) for _ in range(12))
            prompt = list(tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else [0]
        else:
            text, prompt = None, [rng.choice(ids) for _ in range(8)]
        req = BenchRequest(prompt_ids=prompt, output_len=2, prompt_text=text,
                           messages=[{"role": "user", "content": text or "hi"}])
        res = await send_request(session, url, args.backend, req, -1, model, text is None, headers)
        if not res.success:
            failures.append(res.error)
        elif check_text:
            same = res.prompt_len == len(prompt)
            agree = same if agree is None else (agree and same)
    if failures:
        say(f"warning: {len(failures)} of {args.warmup_requests} warm-up requests failed: {failures[0]}")
    if agree is False:
        say("warning: the server counts prompt tokens differently from the local tokenizer; prompt lengths and "
            "the oracle use the local count (pass --tokenizer with the served model's directory)")
    return agree


async def _fetch_counters(session, urls: list[str], headers) -> Optional[dict[str, Any]]:
    """The cache counters of each server's /metrics, summed; None when one of them has none."""
    found = await asyncio.gather(*(fetch_metrics(session, u, headers) for u in urls))
    if not found or any(f is None for f in found):
        return None
    if len(found) == 1:
        return found[0]
    out: dict[str, Any] = {}
    for key in found[0]:
        values = [f.get(key) for f in found]
        if key == "source":
            out[key] = values[0] if len(set(values)) == 1 else None
        else:
            out[key] = None if any(v is None for v in values) else sum(values)
    return out


async def _settled_metrics(session, urls: list[str], headers, before, metrics: BenchMetrics):
    """/metrics after the run; engine counters arrive with the engine's stats, so wait for them a little."""
    after = await _fetch_counters(session, urls, headers)
    if before is None or after is None or metrics.cached_tokens is None:
        return after
    want = metrics.total_input_tokens
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        if after and after.get("engine_prompt") is not None and before.get("engine_prompt") is not None \
                and after["engine_prompt"] - before["engine_prompt"] >= want:
            break
        await asyncio.sleep(0.1)
        after = await _fetch_counters(session, urls, headers) or after
    return after


def _fill_metrics_delta(m: BenchMetrics, before, after) -> None:
    if not before or not after:
        return
    if before.get("engine_prompt") is not None and after.get("engine_prompt") is not None:
        m.metrics_prompt_tokens = after["engine_prompt"] - before["engine_prompt"]
        m.metrics_cached_tokens = after["engine_cached"] - before["engine_cached"]
        m.metrics_source = after.get("source")
        if m.metrics_prompt_tokens > 0:
            m.metrics_hit_rate = m.metrics_cached_tokens / m.metrics_prompt_tokens
            if before.get("engine_host_cached") is not None and after.get("engine_host_cached") is not None:
                host = after["engine_host_cached"] - before["engine_host_cached"]
                m.metrics_host_hit_rate = host / m.metrics_prompt_tokens
    if before.get("request_prompt") is not None and after.get("request_prompt") is not None:
        rp = after["request_prompt"] - before["request_prompt"]
        rc = after["request_cached"] - before["request_cached"]
        m.request_metrics_hit_rate = rc / rp if rp > 0 else None
    if m.metrics_hit_rate is not None and m.hit_rate is not None:
        m.hit_rate_matches_metrics = (int(m.metrics_prompt_tokens) == m.total_input_tokens
                                      and int(m.metrics_cached_tokens) == m.cached_tokens)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser(prog="radixserve bench" if argv is not None else "python -m radixserve.bench_serving")
    args = parser.parse_args(argv)
    try:
        validate_args(args)
    except (BenchError, DatasetError) as e:
        parser.error(str(e))
    try:
        outcome = asyncio.run(run_benchmark(args))
    except BenchError as e:
        print(f"bench_serving: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(outcome.report)
    if args.output_file:
        print(f"record appended to {args.output_file}")
    return 0 if outcome.metrics.completed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
