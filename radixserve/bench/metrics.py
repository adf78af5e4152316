"""Figures of a benchmark run, computed from per-request results."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from radixserve.bench.client import RequestResult


@dataclass
class Dist:
    mean: float = 0.0
    median: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0

    @classmethod
    def of(cls, values: Sequence[float], scale: float = 1000.0) -> "Dist":
        if len(values) == 0:
            return cls()
        a = np.asarray(values, dtype=np.float64) * scale
        return cls(mean=float(a.mean()), median=float(np.percentile(a, 50)), p90=float(np.percentile(a, 90)),
                   p99=float(np.percentile(a, 99)), max=float(a.max()))


@dataclass
class BenchMetrics:
    duration_s: float
    completed: int
    failed: int
    failure_reasons: dict[str, int]
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    concurrency: float
    e2e_latency_ms: Dist
    ttft_ms: Dist
    tpot_ms: Dist
    itl_ms: Dist
    cached_tokens: Optional[int]
    hit_rate: Optional[float]  # from responses: cached prompt tokens / prompt tokens
    metrics_prompt_tokens: Optional[float] = None  # /metrics deltas over the run
    metrics_cached_tokens: Optional[float] = None
    metrics_hit_rate: Optional[float] = None
    metrics_host_hit_rate: Optional[float] = None  # of the prompt tokens, those copied back from a host tier
    metrics_source: Optional[str] = None
    request_metrics_hit_rate: Optional[float] = None  # from usage counters of finished requests
    hit_rate_matches_metrics: Optional[bool] = None
    oracle_hit_rate: Optional[float] = None
    oracle_hit_rate_capacity: Optional[float] = None
    oracle_capacity_tokens: Optional[int] = None
    achieved_over_oracle: Optional[float] = None
    achieved_over_oracle_capacity: Optional[float] = None  # over the LRU reference at capacity
    # Belady's MIN at capacity over the send order (radixserve/bench/belady.py): the bound
    oracle_belady_hit_rate: Optional[float] = None
    achieved_over_belady: Optional[float] = None
    oracle_page_size: Optional[int] = None
    oracle_running: Optional[int] = None
    # Multi-turn sessions: later turns whose cached tokens fell short of the previous turn's whole
    # prompt (by more than LOST_SLACK_TOKENS), i.e. whose conversation was evicted between turns.
    later_turns: Optional[int] = None
    turns_that_lost_the_previous_prompt: Optional[int] = None
    lost_prompt_tokens: Optional[int] = None
    # The client's own event-loop stalls (over LAG_THRESHOLD_S) and worst lag while the requests ran:
    # a stalled client reads its own pause as the server's latency.
    client_loop_stalls: int = 0
    client_loop_max_lag_ms: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compute_metrics(results: Sequence[RequestResult], duration_s: float) -> BenchMetrics:
    ok = [r for r in results if r.success]
    bad = [r for r in results if not r.success]
    reasons = Counter(r.error or "unknown" for r in bad)
    inputs = sum(r.prompt_len for r in ok)
    outputs = sum(r.output_len for r in ok)
    dur = max(duration_s, 1e-9)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itls = [x for r in ok for x in r.itl]
    with_cache = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens for r in with_cache) if with_cache else None
    cached_prompt = sum(r.prompt_len for r in with_cache)
    return BenchMetrics(
        duration_s=duration_s, completed=len(ok), failed=len(bad), failure_reasons=dict(reasons),
        total_input_tokens=inputs, total_output_tokens=outputs,
        request_throughput=len(ok) / dur, input_throughput=inputs / dur, output_throughput=outputs / dur,
        total_throughput=(inputs + outputs) / dur, concurrency=sum(r.latency for r in ok) / dur,
        e2e_latency_ms=Dist.of([r.latency for r in ok]), ttft_ms=Dist.of([r.ttft for r in ok]),
        tpot_ms=Dist.of(tpots), itl_ms=Dist.of(itls),
        cached_tokens=cached, hit_rate=(cached / cached_prompt if with_cache and cached_prompt else None),
    )


# A later turn may fall short of its previous prompt by a partial last page and the tokens a
# template renders differently at the end of a turn; more than this is a lost conversation.
LOST_SLACK_TOKENS = 64


def lost_previous_prompts(sessions: Sequence[tuple[Optional[int], int]], results: Sequence[RequestResult]
                          ) -> Optional[tuple[int, int, int]]:
    """(later turns, turns that lost the previous turn's prompt, tokens lost) over requests that
    carry (session id, turn), index-aligned with `sessions`; None without multi-turn sessions.

    The scheduler simulator (radixserve/bench/scheduler_sim.py) reports the same count, so a real
    run and its simulation can be compared on what the cache kept, not only on the hit rate."""
    by_turn = {sessions[r.index]: r for r in results
               if r.success and r.cached_tokens is not None and sessions[r.index][0] is not None}
    later = lost_turns = lost_tokens = 0
    for (sid, turn), r in by_turn.items():
        previous = by_turn.get((sid, turn - 1)) if turn else None
        if previous is None:
            continue
        later += 1
        lost = previous.prompt_len - 1 - r.cached_tokens
        lost_turns += lost > LOST_SLACK_TOKENS
        lost_tokens += max(lost, 0)
    return (later, lost_turns, lost_tokens) if later else None


def hit_rate_over_time(results: Sequence[RequestResult], t0: float) -> list[tuple[float, float]]:
    """(seconds since t0, cumulative hit rate) at each finished request, in finish order."""
    points = []
    prompt = cached = 0
    for r in sorted((r for r in results if r.success and r.cached_tokens is not None), key=lambda r: r.end):
        prompt += r.prompt_len
        cached += r.cached_tokens
        points.append((r.end - t0, cached / prompt if prompt else 0.0))
    return points
