"""One line per engine step, to see where a serving run's time went (`--step-trace-file`).

Columns: t (seconds since the engine loop started, at the step's start), step_ms (the step call:
schedule + launch the next batch + wait for and process the one before it, so with overlap it
tracks the GPU time of the step before), wait_ms (of step_ms, the wait for the device's sampled
tokens: step_ms - wait_ms is the host's work, and a run of steps waiting ~0 ms was host-bound,
its GPU idle part of each step), gap_ms (loop time since the previous step ended:
receiving requests, sending outputs, stats), kind (decode or mixed: any step with prompt
tokens), requests, new_tokens (prompt tokens computed), cached_tokens (prompt tokens read from
the radix cache).

    python -m radixserve.engine.step_trace trace.csv    # per kind: steps, total, mean, p50, p99;
                                                        # and the step time each request waited out
"""

from __future__ import annotations

import csv
import sys
import time
from typing import Optional, TextIO

HEADER = ["t", "step_ms", "wait_ms", "gap_ms", "kind", "requests", "new_tokens", "cached_tokens"]


class StepTrace:
    def __init__(self, path: str):
        self.file: TextIO = open(path, "w", newline="", buffering=1 << 16)
        self.writer = csv.writer(self.file)
        self.writer.writerow(HEADER)
        self.t0 = time.perf_counter()
        self.last_end: Optional[float] = None

    def after_step(self, core) -> None:
        info = core.last_step
        gap = 0.0 if self.last_end is None else info.started - self.last_end
        self.last_end = info.started + info.seconds
        batch = info.batch
        if batch is None:  # a step that only collected the one in flight
            kind, requests, new_tokens, cached_tokens = "collect", 0, 0, 0
        else:
            kind = "decode" if batch.is_decode_only else "mixed"
            requests, new_tokens, cached_tokens = len(batch.reqs), batch.num_new_tokens, batch.num_cached_tokens
        self.writer.writerow([f"{info.started - self.t0:.6f}", f"{info.seconds * 1e3:.3f}", f"{info.waited * 1e3:.3f}",
                              f"{gap * 1e3:.3f}", kind, requests, new_tokens, cached_tokens])

    def close(self) -> None:
        self.file.close()


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summarize(path: str) -> str:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    lines = [f"{'kind':8s} {'steps':>7s} {'total s':>8s} {'mean ms':>8s} {'p50 ms':>7s} {'p99 ms':>7s} "
             f"{'wait mean ms':>12s} {'gap mean ms':>11s} {'requests':>8s} {'new tok':>8s}"]
    for kind in sorted({r["kind"] for r in rows}):
        sel = [r for r in rows if r["kind"] == kind]
        ms = [float(r["step_ms"]) for r in sel]
        gaps = [float(r["gap_ms"]) for r in sel]
        waits = [float(r["wait_ms"]) for r in sel]
        reqs = sum(int(r["requests"]) for r in sel) / len(sel)
        new = sum(int(r["new_tokens"]) for r in sel) / len(sel)
        lines.append(f"{kind:8s} {len(sel):7d} {sum(ms) / 1e3:8.2f} {sum(ms) / len(ms):8.3f} {_quantile(ms, 0.5):7.3f} "
                     f"{_quantile(ms, 0.99):7.3f} {sum(waits) / len(waits):12.3f} {sum(gaps) / len(gaps):11.3f} "
                     f"{reqs:8.1f} {new:8.1f}")
    # Every request in a step waits out the whole step: weighting steps by their requests gives
    # the time per token the engine delivered, close to a client's mean TPOT.
    weight = sum(int(r["requests"]) for r in rows)
    if weight:
        waited = sum(float(r["step_ms"]) * int(r["requests"]) for r in rows) / weight
        lines.append(f"step time per request per step (~ mean TPOT): {waited:.3f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"# {arg}")
        print(summarize(arg))
