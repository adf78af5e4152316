"""Who the slowest requests of a run were, from a server log written with `--log-requests`.

The server logs each request's arrival and finish (prompt and cached tokens, TTFT, latency); a
benchmark's P99 says how long the slowest 1% took, this says which requests they were: when they
arrived, how much of their prompt was cached, how long they waited for the first token. Under
cache pressure the answer is usually one kind of request (on the agent workload, later turns whose
conversation was evicted before they arrived).

    python -m radixserve.bench.request_log server.log [--slowest 0.01] [--min-output 2]

`--min-output` leaves out requests with fewer output tokens (default 3: `bench_serving`'s warm-up
requests ask for 2). Arrival times count from the first request kept.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Iterable, Optional

_STAMP = r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) \d+ \w+\] "
_ARRIVED = re.compile(_STAMP + r"Request arrived\. id: (\S+), #prompt-token: (\d+)")
_FINISHED = re.compile(_STAMP + r"Request finished\. id: (\S+), #prompt-token: (\d+), #cached-token: (\d+), "
                       r"#output-token: (\d+), ttft: ([\d.]+s|-), latency: ([\d.]+)s")


@dataclass
class LoggedRequest:
    rid: str
    arrived: Optional[float]  # the log's clock, in seconds (None: its arrival is not in the log)
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: Optional[float]
    latency_s: float


def _seconds(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f").timestamp()


def parse(lines: Iterable[str]) -> list[LoggedRequest]:
    """The finished requests of a `--log-requests` log, in finish order."""
    arrivals: dict[str, float] = {}
    out = []
    for line in lines:
        m = _ARRIVED.match(line)
        if m:
            arrivals[m.group(2)] = _seconds(m.group(1))
            continue
        m = _FINISHED.match(line)
        if m:
            ttft = m.group(6)
            out.append(LoggedRequest(rid=m.group(2), arrived=arrivals.get(m.group(2)), prompt_tokens=int(m.group(3)),
                                     cached_tokens=int(m.group(4)), output_tokens=int(m.group(5)),
                                     ttft_s=None if ttft == "-" else float(ttft[:-1]), latency_s=float(m.group(7))))
    return out


def slowest(requests: list[LoggedRequest], fraction: float) -> list[LoggedRequest]:
    """The slowest `fraction` of the requests by latency (at least one), slowest first: the ones a
    P(1 - fraction) latency is made of."""
    ordered = sorted(requests, key=lambda r: -r.latency_s)
    return ordered[:max(1, round(fraction * len(ordered)))] if ordered else []


def report(requests: list[LoggedRequest], fraction: float) -> str:
    top = slowest(requests, fraction)
    t0 = min((r.arrived for r in requests if r.arrived is not None), default=0.0)
    lines = [f"{len(requests)} finished requests; the slowest {len(top)} ({fraction:.1%}):",
             f"{'latency s':>9} {'ttft s':>7} {'arrived s':>9} {'prompt':>7} {'cached':>7} {'output':>6}  id"]
    for r in top:
        ttft = "-" if r.ttft_s is None else f"{r.ttft_s:.2f}"
        arrived = "-" if r.arrived is None else f"{r.arrived - t0:.2f}"
        lines.append(f"{r.latency_s:9.2f} {ttft:>7} {arrived:>9} {r.prompt_tokens:7d} {r.cached_tokens:7d} "
                     f"{r.output_tokens:6d}  {r.rid}")
    kinds = Counter((r.prompt_tokens, r.cached_tokens) for r in top)
    lines.append("by (prompt, cached) tokens: " + ", ".join(f"{p}/{c}: {n}" for (p, c), n in kinds.most_common()))
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", help="a server log written with --log-requests (--log-file)")
    parser.add_argument("--slowest", type=float, default=0.01, help="the fraction to list (default 0.01)")
    parser.add_argument("--min-output", type=int, default=3,
                        help="leave out requests with fewer output tokens (default 3: warm-ups ask for 2)")
    args = parser.parse_args(argv)
    if not 0 < args.slowest <= 1:
        parser.error(f"--slowest must be in (0, 1], got {args.slowest}")
    with open(args.log, errors="replace") as f:
        requests = [r for r in parse(f) if r.output_tokens >= args.min_output]
    print(report(requests, args.slowest))


if __name__ == "__main__":
    main()
