"""The closed-loop agent workload against a real server: each turn extends what the server returned,
so a later turn hits the cache for the previous turn's prompt and output."""

from __future__ import annotations

import asyncio

import pytest

from radixserve.bench_serving import BenchError, build_parser, run_benchmark, validate_args

CLOSED = ["--dataset-name", "agent", "--agent-closed-loop", "--num-prompts", "12", "--agent-turns", "3",
          "--agent-num-system-prompts", "2", "--agent-output-len", "8", "--agent-think-time", "0",
          "--request-rate", "inf", "--flush-cache"]


def bench(server, *argv):
    args = build_parser().parse_args([*argv, "--base-url", server.base_url, "--disable-tqdm"])
    return asyncio.run(run_benchmark(args, quiet=True))


def test_closed_loop_turns_extend_the_returned_tokens_and_hit_them(server):
    out = bench(server, *CLOSED)
    m = out.metrics
    assert m.completed == 12 and m.failed == 0, m.failure_reasons
    by_index = {r.index: r for r in out.results}
    by_turn = {(q.session_id, q.turn): i for i, q in enumerate(out.requests)}
    for i, req in enumerate(out.requests):
        res = by_index[i]
        assert res.prompt_len == req.prompt_len  # the server counted the ids we sent
        if req.turn == 0:
            continue
        j = by_turn[(req.session_id, req.turn - 1)]
        prev, prev_res = out.requests[j], by_index[j]
        assert len(prev_res.output_ids) == 8
        # an exact token extension of what the server computed
        assert req.prompt_ids == prev.prompt_ids + prev_res.output_ids + req.turn_suffix_ids
        # the whole previous prompt and its output, except the last output token (never fed back,
        # so it has no KV), are cached
        assert res.cached_tokens >= prev.prompt_len + len(prev_res.output_ids) - 1, (i, res.cached_tokens)
    # the oracles ran over the prompts as sent: a pool far larger than the workload reaches the
    # unlimited oracle, and the server cannot beat it
    assert m.oracle_belady_hit_rate == pytest.approx(m.oracle_hit_rate)
    assert m.hit_rate <= m.oracle_hit_rate + 1e-9
    assert m.achieved_over_belady > 0.9
    assert out.record["dataset"]["prompt_tokens"] == sum(q.prompt_len for q in out.requests)


def test_closed_loop_refuses_what_it_cannot_do():
    for argv, why in ((["--agent-closed-loop"], "needs --dataset-name agent"),
                      (["--dataset-name", "agent", "--agent-closed-loop", "--backend", "openai-chat"],
                       "openai-chat")):
        with pytest.raises(BenchError, match=why):
            validate_args(build_parser().parse_args(argv))
