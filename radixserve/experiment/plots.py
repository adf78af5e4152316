"""The experiment's PNG plots: throughput and P99 latency, TTFT CDF, hit rate over time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from radixserve.experiment.runs import ConfigResult


def _save(fig, out_dir: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return name


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
    files.append(_save(fig, out_dir, "throughput_p99.png"))

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
    files.append(_save(fig, out_dir, "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in done:
        if r.hit_rate_curve:
            xs, ys = zip(*r.hit_rate_curve)
            ax.plot(xs, ys, label=r.config.name)
    for value, label, style in bound_lines([r.record for r in done]):
        ax.axhline(value, color="black", linestyle=style, linewidth=1, label=label)
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("cumulative prefix hit rate")
    ax.set_ylim(0, 1)
    ax.set_title("Prefix hit rate over time")
    ax.grid(alpha=0.3)
    ax.legend()
    files.append(_save(fig, out_dir, "hit_rate_over_time.png"))
    return files


def bound_lines(records: list[dict[str, Any]]) -> list[tuple[float, str, str]]:
    """(hit rate, label, line style) for the unlimited oracle and each smaller pool's bound: Belady's
    MIN when the records carry it, else the LRU replay of that pool (a reference, labelled so)."""
    lines: list[tuple[float, str, str]] = []
    unlimited = next((r["oracle_hit_rate"] for r in records if r.get("oracle_hit_rate") is not None), None)
    if unlimited is not None:
        lines.append((unlimited, "oracle (unlimited)", "--"))
    seen: set[int] = set()
    for r in records:
        pool = r.get("oracle_capacity_tokens")
        belady, lru = r.get("oracle_belady_hit_rate"), r.get("oracle_hit_rate_capacity")
        value, name = (belady, "Belady bound") if belady is not None else (lru, "LRU at capacity")
        if pool is None or pool in seen or value is None or (unlimited is not None and value >= unlimited - 1e-9):
            continue  # a pool that holds the whole workload: its line is the unlimited one
        seen.add(pool)
        lines.append((value, f"{name} ({pool} tokens)", ":"))
    return lines
