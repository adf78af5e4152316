"""The printed report (SGLang's bench_serving layout) and the experiment's Markdown table."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from radixserve.bench.metrics import BenchMetrics

WIDTH = 50


def _fmt(value: Optional[float], digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def format_report(m: BenchMetrics, *, backend: str, request_rate: float, max_concurrency: Optional[int],
                  dataset: str) -> str:
    lines = []

    def title(text: str, fill: str = "=") -> None:
        lines.append(f"{text:{fill}^{WIDTH}}")

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<40}{value:>10}")

    title(" Serving Benchmark Result ")
    row("Backend:", backend)
    row("Dataset:", dataset)
    row("Traffic request rate:", "inf" if request_rate == float("inf") else _fmt(request_rate))
    row("Max request concurrency:", max_concurrency if max_concurrency else "not set")
    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Benchmark duration (s):", _fmt(m.duration_s))
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", _fmt(m.request_throughput))
    row("Input token throughput (tok/s):", _fmt(m.input_throughput))
    row("Output token throughput (tok/s):", _fmt(m.output_throughput))
    row("Total token throughput (tok/s):", _fmt(m.total_throughput))
    row("Concurrency:", _fmt(m.concurrency))
    row("Client loop stalls / max lag (ms):", f"{m.client_loop_stalls} / {m.client_loop_max_lag_ms:.0f}")
    for name, dist in (("End-to-End Latency", m.e2e_latency_ms), ("Time to First Token", m.ttft_ms),
                       ("Time per Output Token (excl. 1st token)", m.tpot_ms), ("Inter-Token Latency", m.itl_ms)):
        title(f" {name} ", "-")
        short = {"End-to-End Latency": "E2E Latency", "Time to First Token": "TTFT",
                 "Time per Output Token (excl. 1st token)": "TPOT", "Inter-Token Latency": "ITL"}[name]
        row(f"Mean {short} (ms):", _fmt(dist.mean))
        row(f"Median {short} (ms):", _fmt(dist.median))
        row(f"P90 {short} (ms):", _fmt(dist.p90))
        row(f"P99 {short} (ms):", _fmt(dist.p99))
    title(" Prefix Cache ", "-")
    row("Cached prompt tokens:", m.cached_tokens if m.cached_tokens is not None else "n/a")
    row("Hit rate (responses):", _fmt(m.hit_rate, 4))
    row("Hit rate (/metrics delta):", _fmt(m.metrics_hit_rate, 4))
    if m.metrics_host_hit_rate:
        row("  of which from the host tier:", _fmt(m.metrics_host_hit_rate, 4))
    row("Responses agree with /metrics:",
        "n/a" if m.hit_rate_matches_metrics is None else ("yes" if m.hit_rate_matches_metrics else "NO"))
    row("Oracle hit rate (unlimited):", _fmt(m.oracle_hit_rate, 4))
    pool = f"{m.oracle_capacity_tokens} tok" if m.oracle_capacity_tokens else "capacity"
    row(f"Belady bound ({pool}, send order):", _fmt(m.oracle_belady_hit_rate, 4))
    row(f"LRU at capacity ({pool}):", _fmt(m.oracle_hit_rate_capacity, 4))
    row("Achieved / oracle (unlimited):", _fmt(m.achieved_over_oracle, 3))
    row("Achieved / Belady bound:", _fmt(m.achieved_over_belady, 3))
    row("Achieved / LRU at capacity:", _fmt(m.achieved_over_oracle_capacity, 3))
    if m.later_turns:
        row("Later turns that lost the previous prompt:",
            f"{m.turns_that_lost_the_previous_prompt} of {m.later_turns} ({m.lost_prompt_tokens} tokens)")
    if m.failure_reasons:
        title(" Failures ", "-")
        for reason, count in sorted(m.failure_reasons.items(), key=lambda kv: -kv[1]):
            lines.append(f"{count:>6}  {reason}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


# The seed's table. The hit rate is compared with a bound: Belady's MIN at the server's pool when
# the records carry it, else the unlimited oracle; the LRU replay at the pool is a reference only.
_TIMING_COLUMNS = ("configuration", "throughput (tok/s)", "P50 latency (s)", "P99 latency (s)", "TTFT P50 (ms)",
                   "TTFT P99 (ms)", "hit rate")
EXPERIMENT_COLUMNS = (*_TIMING_COLUMNS, "oracle (unlimited)", "achieved/oracle", "LRU at capacity", "failed")
BELADY_COLUMNS = (*_TIMING_COLUMNS, "Belady bound", "achieved/Belady", "LRU at capacity", "failed")


def experiment_columns(records: Sequence[Optional[dict[str, Any]]]) -> tuple[str, ...]:
    """The Belady columns when any record has the Belady bound, else the unlimited oracle's."""
    if any(r is not None and r.get("oracle_belady_hit_rate") is not None for r in records):
        return BELADY_COLUMNS
    return EXPERIMENT_COLUMNS


def experiment_row(name: str, m: Optional[dict[str, Any]], error: Optional[str] = None,
                   columns: Sequence[str] = EXPERIMENT_COLUMNS) -> list[str]:
    if m is None:
        return [name] + ["-"] * (len(columns) - 2) + [error or "did not run"]

    def g(key: str, sub: Optional[str] = None, scale: float = 1.0, digits: int = 2) -> str:
        v = m.get(key)
        if sub is not None and v is not None:
            v = v.get(sub)
        return "n/a" if v is None else f"{v * scale:.{digits}f}"

    bound = ["oracle_belady_hit_rate", "achieved_over_belady"] if "Belady bound" in columns else \
        ["oracle_hit_rate", "achieved_over_oracle"]
    return [name, g("total_throughput", digits=0), g("e2e_latency_ms", "median", 1e-3),
            g("e2e_latency_ms", "p99", 1e-3), g("ttft_ms", "median", digits=0), g("ttft_ms", "p99", digits=0),
            g("hit_rate", digits=3), g(bound[0], digits=3), g(bound[1], digits=2),
            g("oracle_hit_rate_capacity", digits=3), str(m.get("failed", 0))]


def markdown_table(rows: Sequence[Sequence[str]], header: Sequence[str] = EXPERIMENT_COLUMNS) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def console_table(rows: Sequence[Sequence[str]], header: Sequence[str] = EXPERIMENT_COLUMNS) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join([line, sep, *body])
