"""bench_serving against a real CPU server: records, token counts, hit rate vs /metrics, bad input."""

from __future__ import annotations

import asyncio
import json

import pytest

from radixserve.bench.client import RequestResult
from radixserve.bench.metrics import lost_previous_prompts
from radixserve.bench_serving import BenchError, build_parser, main, run_benchmark
from tests.conftest import ServerProcess, free_port, seed_launch_args

RECORD_KEYS = {
    "timestamp", "settings", "dataset", "server", "duration_s", "completed", "failed", "failure_reasons",
    "total_input_tokens", "total_output_tokens", "request_throughput", "input_throughput", "output_throughput",
    "total_throughput", "concurrency", "e2e_latency_ms", "ttft_ms", "tpot_ms", "itl_ms", "cached_tokens",
    "hit_rate", "metrics_prompt_tokens", "metrics_cached_tokens", "metrics_hit_rate", "hit_rate_matches_metrics",
    "oracle_hit_rate", "oracle_hit_rate_capacity", "oracle_capacity_tokens", "achieved_over_oracle",
    "achieved_over_oracle_capacity", "oracle_belady_hit_rate", "achieved_over_belady", "tokenizer_matches_server",
}


def bench(server, *argv):
    args = build_parser().parse_args([*argv, "--base-url", server.base_url, "--disable-tqdm"])
    return asyncio.run(run_benchmark(args, quiet=True))


AGENT = ["--dataset-name", "agent", "--num-prompts", "16", "--agent-turns", "4", "--agent-output-len", "4",
         "--agent-think-time", "0.02", "--request-rate", "inf", "--flush-cache"]


def test_seed_command_record_and_token_counts(server, tmp_path):
    """The seed's command as written (package swapped), small sizes; the JSON record carries every figure."""
    out = tmp_path / "runs.jsonl"
    code = main(["--backend", "radixserve", "--model", "qwen2", "--num-prompts", "6", "--request-rate", "5",
                 "--random-input", "48", "--random-output", "6", "--host", "127.0.0.1", "--port", str(server.port),
                 "--disable-tqdm", "--output-file", str(out)])
    assert code == 0
    main(["--num-prompts", "3", "--random-input-len", "20", "--random-output-len", "3", "--port", str(server.port),
          "--disable-tqdm", "--output-file", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2
    rec = records[0]
    assert RECORD_KEYS <= set(rec), RECORD_KEYS - set(rec)
    assert rec["completed"] == 6 and rec["failed"] == 0
    # token counts match the server's usage: 6 x 48 in, 6 x 6 out, counted by the server
    assert rec["total_input_tokens"] == 6 * 48 and rec["total_output_tokens"] == 6 * 6
    assert rec["tokenizer_matches_server"] is True
    assert rec["settings"]["random_input_len"] == 48 and rec["settings"]["request_rate"] == 5
    assert rec["server"]["pool_size"] == rec["oracle_capacity_tokens"] > 0
    for key in ("e2e_latency_ms", "ttft_ms", "tpot_ms", "itl_ms"):
        assert set(rec[key]) == {"mean", "median", "p90", "p99", "max"}
        assert rec[key]["p99"] >= rec[key]["median"] > 0
    assert rec["metrics_prompt_tokens"] == rec["total_input_tokens"]


def test_per_request_counts_equal_the_server_usage(server):
    out = bench(server, "--num-prompts", "5", "--random-input-len", "33", "--random-output-len", "7")
    for res, req in zip(sorted(out.results, key=lambda r: r.index), out.requests):
        assert res.success, res.error
        assert res.prompt_len == req.prompt_len == 33
        assert res.output_len == 7 == len(res.output_ids)
        assert len(res.itl) >= 1 and res.ttft > 0 and res.latency >= res.ttft


def test_hit_rate_from_responses_equals_metrics_and_respects_the_oracle(server):
    out = bench(server, *AGENT)
    m = out.metrics
    assert m.completed == 16 and m.failed == 0
    assert m.hit_rate is not None and m.hit_rate > 0.3
    assert m.metrics_prompt_tokens == m.total_input_tokens
    assert m.metrics_cached_tokens == m.cached_tokens
    assert m.metrics_hit_rate == pytest.approx(m.hit_rate, abs=1e-12)
    assert m.request_metrics_hit_rate == pytest.approx(m.hit_rate, abs=1e-12)
    assert m.hit_rate_matches_metrics is True
    # with the cache flushed and a pool far larger than the workload, the server cannot beat the oracle
    assert m.oracle_hit_rate_capacity == pytest.approx(m.oracle_hit_rate)
    assert m.oracle_belady_hit_rate == pytest.approx(m.oracle_hit_rate)
    assert m.achieved_over_belady == pytest.approx(m.hit_rate / m.oracle_belady_hit_rate)
    assert m.hit_rate <= m.oracle_hit_rate + 1e-9
    assert m.achieved_over_oracle == pytest.approx(m.hit_rate / m.oracle_hit_rate)
    assert "Prefix Cache" in out.report and "Oracle hit rate" in out.report
    assert "Belady bound" in out.report and "LRU at capacity" in out.report
    # 4 sessions x 3 later turns, each finding its whole previous prompt in the large pool
    assert (m.later_turns, m.turns_that_lost_the_previous_prompt) == (12, 0)
    line = next(x for x in out.report.splitlines() if x.startswith("Later turns that lost the previous prompt:"))
    assert line.endswith("0 of 12 (0 tokens)")


def test_lost_previous_prompts_counts_turns_whose_conversation_was_evicted():
    sessions = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (None, 0)]
    results = [RequestResult(i, success=True, prompt_len=n, cached_tokens=c)
               for i, (n, c) in enumerate([(300, 0), (400, 299), (500, 100), (300, 200), (380, 230), (50, 0)])]
    # turn (0, 1) kept all 299 reusable tokens; (0, 2) lost 299 of 399; (1, 1) lost 69 (> 64)
    assert lost_previous_prompts(sessions, results) == (3, 2, 299 + 69)
    assert lost_previous_prompts([(None, 0)] * 6, results) is None
    results[1].success = False  # a failed turn is no evidence; the next turn has no previous one
    assert lost_previous_prompts(sessions, results) == (1, 1, 69)


@pytest.mark.parametrize("backend", ["openai", "openai-chat", "sglang"])
def test_other_backends(server, backend):
    out = bench(server, "--backend", backend, *AGENT[:-1], "--num-prompts", "8")
    m = out.metrics
    assert m.completed == 8 and m.failed == 0, m.failure_reasons
    assert m.total_output_tokens == 8 * 4
    assert m.cached_tokens is not None and m.hit_rate_matches_metrics is True
    # the server tokenized the text (or chat messages) itself; the local count agrees
    assert m.total_input_tokens == sum(r.prompt_len for r in out.requests)


def test_random_ids_and_max_concurrency(server):
    out = bench(server, "--dataset-name", "random-ids", "--num-prompts", "6", "--random-input-len", "25",
                "--random-output-len", "3", "--max-concurrency", "2")
    assert out.metrics.completed == 6 and out.metrics.total_input_tokens == 150
    assert out.metrics.concurrency <= 2.05


def test_unreachable_server_says_so(capsys):
    code = main(["--port", str(free_port()), "--num-prompts", "2", "--disable-tqdm"])
    assert code == 2
    err = capsys.readouterr().err
    assert "cannot connect to http://127.0.0.1:" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["--dataset-name", "sharegpt", "--dataset-path", "/nonexistent/sg.json"], "no such file"),
    (["--random-range-ratio", "1.5"], "range-ratio"),
    (["--backend", "tgi"], "invalid choice"),
    (["--request-rate", "fast"], "invalid float value"),
])
def test_bad_arguments(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_malformed_dataset_file(server, tmp_path, capsys):
    path = tmp_path / "sg.json"
    path.write_text("[{\"conversations\": 3}]")
    code = main(["--dataset-name", "sharegpt", "--dataset-path", str(path), "--port", str(server.port),
                 "--num-prompts", "1", "--disable-tqdm"])
    assert code == 2
    assert "no 'conversations' list" in capsys.readouterr().err


def test_requests_the_server_rejects_are_counted_with_reasons(server):
    # prompts longer than the model's context: every request gets a 400, the run still finishes
    out = bench(server, "--dataset-name", "random-ids", "--num-prompts", "3", "--random-input-len", "5000",
                "--random-output-len", "2")
    assert out.metrics.completed == 0 and out.metrics.failed == 3
    (reason, count), = out.metrics.failure_reasons.items()
    assert count == 3 and reason.startswith("HTTP 400") and "context length" in reason
    assert "Failures" in out.report and "HTTP 400" in out.report


def test_first_requests_failing_alike_stop_the_run(server):
    # Prompts longer than the model's context, one request at a time: the first three fail alike,
    # the run stops there with that reason instead of sending the other seventeen.
    seen = []
    args = build_parser().parse_args(["--dataset-name", "random-ids", "--num-prompts", "20", "--random-input-len",
                                      "5000", "--random-output-len", "2", "--max-concurrency", "1",
                                      "--base-url", server.base_url, "--disable-tqdm"])
    with pytest.raises(BenchError) as e:
        asyncio.run(run_benchmark(args, quiet=True, on_result=seen.append))
    assert len(seen) == 3 and not any(r.success for r in seen)
    assert str(e.value).startswith("the first 3 requests all failed with the same error") and "HTTP 400" in str(e.value)


def test_server_dying_mid_run(server_model_dir, tmp_path):
    """The server is killed when the first request completes. With one request in flight at a time,
    every later request meets the dead server, however fast or slow the machine is."""
    proc = ServerProcess([*seed_launch_args(server_model_dir), "--device", "cpu"], tmp_path).wait_ready()

    def kill_after_first_success(result) -> None:
        if result.success and proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait()

    try:
        args = build_parser().parse_args(["--dataset-name", "random-ids", "--num-prompts", "6", "--random-input-len",
                                          "16", "--random-output-len", "8", "--max-concurrency", "1",
                                          "--warmup-requests", "0", "--base-url", proc.base_url, "--disable-tqdm"])
        out = asyncio.run(run_benchmark(args, quiet=True, on_result=kill_after_first_success))
    finally:
        proc.stop()
    m = out.metrics
    assert m.completed == 1 and m.failed == 5
    assert all(r.startswith("connection") for r in m.failure_reasons), m.failure_reasons
    assert m.metrics_hit_rate is None  # /metrics was gone after the run

def test_the_opening_burst_reuses_connections_opened_before_the_clock():
    """open_connections leaves n keep-alive connections in the pool: a burst of n requests right
    after opens none of its own (a real aiohttp server on loopback records each request's port)."""
    import aiohttp
    from aiohttp import web

    from radixserve.bench.client import open_connections

    async def scenario() -> tuple[set, list]:
        ports: list[int] = []

        async def record(request: web.Request) -> web.Response:
            ports.append(request.transport.get_extra_info("peername")[1])
            await asyncio.sleep(0.05)  # all n at once: each needs its own connection
            return web.json_response({"data": []})

        app = web.Application()
        app.router.add_get("/v1/models", record)
        app.router.add_post("/v1/completions", record)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        base = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                await open_connections(session, base, {}, 8)
                opened = set(ports)

                async def post() -> None:
                    async with session.post(base + "/v1/completions", data=b"{}") as resp:
                        await resp.read()

                await asyncio.gather(*(post() for _ in range(8)))
        finally:
            await runner.cleanup()
        return opened, ports[8:]

    opened, burst_ports = asyncio.run(scenario())
    assert len(opened) == 8 and len(burst_ports) == 8
    assert set(burst_ports) == opened


def test_the_opening_burst_is_what_is_sent_at_once():
    from radixserve.bench.datasets import BenchRequest
    from radixserve.bench_serving import _opening_burst

    def args(*argv):
        return build_parser().parse_args(list(argv))

    single = [BenchRequest(prompt_ids=[1, 2], output_len=2) for _ in range(10)]
    turns = [BenchRequest(prompt_ids=[1], output_len=1, session_id=s, turn=t) for s in range(3) for t in range(4)]
    assert _opening_burst(args("--request-rate", "inf"), single) == 10
    assert _opening_burst(args("--request-rate", "inf", "--max-concurrency", "4"), single) == 4
    assert _opening_burst(args("--request-rate", "inf"), turns) == 3  # later turns wait for earlier ones
    assert _opening_burst(args("--request-rate", "5"), single) == 0  # one by one


def test_request_log_lists_the_slowest_requests_of_a_run(server):
    """The server's --log-requests lines, read back: one finished entry per request of the run,
    with its prompt and output tokens, the slowest first."""
    import time

    from radixserve.bench.request_log import parse, report, slowest

    def logged():
        with open(server.log_file) as f:
            return parse(f)

    before = len(logged())
    out = bench(server, "--num-prompts", "6", "--random-input-len", "30", "--random-output-len", "5",
                "--warmup-requests", "0", "--request-rate", "inf")
    deadline = time.monotonic() + 10
    while len(logged()) < before + 6 and time.monotonic() < deadline:
        time.sleep(0.05)  # the log line may trail the stream's end
    run = logged()[before:]
    assert len(run) == 6 and all(r.prompt_tokens == 30 and r.output_tokens == 5 for r in run)
    assert all(r.arrived is not None and r.ttft_s is not None and 0 < r.ttft_s <= r.latency_s for r in run)
    # The server's latency (arrival at the API to the last token) is within the client's.
    assert max(r.latency_s for r in run) <= max(res.latency for res in out.results) + 0.05
    top = slowest(run, 0.5)
    assert [r.latency_s for r in top] == sorted((r.latency_s for r in run), reverse=True)[:3]
    text = report(run, 0.5)
    assert "6 finished requests; the slowest 3" in text and all(r.rid in text for r in top)
