"""The seed's experiment, one command: `python -m radixserve.experiment` (or `radixserve experiment`).

For each configuration it starts a fresh server (a `radixserve.launch_server` subprocess on a
free port), runs the same benchmark workload with the same seed against it, and stops it. Then it
writes into `--output-dir`:

- `results.json`: every configuration's full benchmark record plus per-request TTFT/latency and the
  hit rate over time;
- `table.md`: the seed's table (throughput, P50/P99 latency, TTFT, hit rate against its bound) and
  the sentence saying what the rows show;
- `throughput_p99.png`, `ttft_cdf.png`, `hit_rate_over_time.png`;
- `server-<config>.log`: each server's log.

Configurations: LPM vs FCFS, radix cache on vs off, and, with a KV pool small enough to force
evictions, LPM vs FCFS and LRU vs FIFO eviction (eviction order only matters under pressure).
With `--router-policies` (opt-in), also a cluster: `--router-workers` servers started once (or
running ones given by `--worker-urls`), and for each policy a router over them, the workers'
caches flushed, the same workload sent through the router; the hit rate is then the aggregate
over every worker (the responses' cached tokens, and the workers' /metrics summed).

Modules: `configs` (the rows and the default workload), `processes` (servers on free ports),
`runs` (one configuration's run), `router_runs` (the router rows), `tables` and `plots` (the
outputs), `cli` (the flags and the whole run).
"""

from radixserve.experiment.cli import build_parser, main

__all__ = ["build_parser", "main"]
