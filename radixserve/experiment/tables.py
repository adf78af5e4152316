"""The experiment's outputs: results.json, table.md, the printed table and the sentence under it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from radixserve.bench.report import console_table, experiment_columns, experiment_row, markdown_table
from radixserve.experiment.router_runs import ROUTER_COLUMNS, router_rows
from radixserve.experiment.runs import ConfigResult

# Pairs whose only difference is the scheduling policy, and what the pair shows.
POLICY_PAIRS = (("lpm-small-pool", "fcfs-small-pool", "under the small pool"),
                ("lpm", "fcfs", "with the full pool"))
TIE = 0.05  # relative differences below this are called even: timings on a shared machine move that much
HIT_TIE = 0.01


def _get(record: dict[str, Any], key: str, sub: Optional[str] = None) -> Optional[float]:
    value = record.get(key)
    if sub is not None and isinstance(value, dict):
        value = value.get(sub)
    return value if isinstance(value, (int, float)) else None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def _computed(record: dict[str, Any]) -> Optional[int]:
    prompt, cached = _get(record, "total_input_tokens"), _get(record, "cached_tokens")
    return None if prompt is None or cached is None else int(prompt - cached)


def _pair_clause(lpm: dict[str, Any], fcfs: dict[str, Any], where: str) -> tuple[str, list[str]]:
    """'under the small pool LPM ... than FCFS' and the measures on which LPM lost."""
    hit_l, hit_f = _get(lpm, "hit_rate"), _get(fcfs, "hit_rate")
    thr = _ratio(_get(lpm, "total_throughput"), _get(fcfs, "total_throughput"))
    measures = {"P99 latency": _ratio(_get(fcfs, "e2e_latency_ms", "p99"), _get(lpm, "e2e_latency_ms", "p99")),
                "TTFT P99": _ratio(_get(fcfs, "ttft_ms", "p99"), _get(lpm, "ttft_ms", "p99")),
                "TTFT P50": _ratio(_get(fcfs, "ttft_ms", "median"), _get(lpm, "ttft_ms", "median"))}
    parts = []
    if hit_l is not None and hit_f is not None:
        parts.append(f"hit rate {hit_l:.2f} vs {hit_f:.2f}")
    computed_l, computed_f = _computed(lpm), _computed(fcfs)
    if computed_l is not None and computed_f is not None:
        # The prompt tokens each had to compute: the work the cache saved, independent of the machine.
        parts.append(f"{computed_l} prompt tokens computed vs {computed_f}")
    if thr is not None:
        parts.append(f"{thr:.2f}x the throughput")
    for name, gain in measures.items():  # gain > 1: LPM's is lower (better)
        if gain is not None:
            parts.append(f"{name} {1 / gain:.2f}x FCFS's")
    lost = [name for name, gain in measures.items() if gain is not None and gain < 1 - TIE]
    if thr is not None and thr < 1 - TIE:
        lost.append("throughput")
    if hit_l is not None and hit_f is not None and hit_l < hit_f - HIT_TIE:
        lost.append("hit rate")
    return f"{where} LPM gets {', '.join(parts)}", lost


def _why(losses: list[tuple[str, str, Optional[bool]]]) -> str:
    """Why LPM lost where it did. A timing loss with no more prompt tokens computed than FCFS is
    not the cache: it is the order (cached prefixes first), LPM's own scheduling work per step, or
    the machine; a hit-rate loss is the evictions its order caused."""
    less_work = [f"{m} {w}" for m, w, no_more_work in losses if m != "hit rate" and no_more_work]
    more_work = [f"{m} {w}" for m, w, no_more_work in losses if m != "hit rate" and no_more_work is False]
    unknown = [f"{m} {w}" for m, w, no_more_work in losses if m != "hit rate" and no_more_work is None]
    cache = [w for m, w, _ in losses if m == "hit rate"]
    out = []
    if less_work:
        out.append(f"LPM is slower on {', '.join(less_work)} while computing no more prompt tokens than FCFS, so the "
                   "time went to the order (cached prefixes first: a request with nothing cached waits, "
                   "--lpm-max-wait-s bounds it), to LPM's own scheduling work each step, or to the machine's "
                   "timing noise (compare runs)")
    if unknown:
        out.append(f"LPM is slower on {', '.join(unknown)}: the order (cached prefixes first: a request with nothing "
                   "cached waits, --lpm-max-wait-s bounds it), LPM's own scheduling work each step, or the "
                   "machine's timing noise (compare runs)")
    if more_work:
        out.append(f"LPM loses on {', '.join(more_work)} because it computed more prompt tokens there")
    if cache:
        out.append(f"LPM's hit rate is lower {' and '.join(cache)} because the order it admitted requests in evicted "
                   "prefixes that waiting requests needed again, where FCFS's order kept them")
    return "; ".join(out)


def explanation(results: list[ConfigResult], small_pool: int) -> str:
    """One sentence on what the rows show, numbers included, with where LPM loses and why."""
    rec = {r.config.name: r.record for r in results if r.record is not None}
    clauses, losses = [], []
    for lpm, fcfs, where in POLICY_PAIRS:
        if lpm in rec and fcfs in rec:
            clause, lost = _pair_clause(rec[lpm], rec[fcfs], where.replace("small pool", f"small pool ({small_pool} "
                                                                            "tokens)"))
            clauses.append(clause)
            work = _computed(rec[lpm]), _computed(rec[fcfs])
            no_more_work = None if None in work else work[0] <= work[1]
            losses += [(m, where, no_more_work) for m in lost]
    base = rec.get("lpm")
    if base is not None and "no-radix" in rec:
        speed = _ratio(_get(base, "total_throughput"), _get(rec["no-radix"], "total_throughput"))
        if speed is not None:
            clauses.append(f"no-radix recomputes every prompt, so lpm has {speed:.2f}x its throughput")
    if "lpm-small-pool" in rec and "lpm-fifo-small-pool" in rec:
        lru, fifo = _get(rec["lpm-small-pool"], "hit_rate"), _get(rec["lpm-fifo-small-pool"], "hit_rate")
        if lru is not None and fifo is not None:
            clauses.append(f"FIFO eviction instead of LRU gives hit rate {fifo:.2f} vs {lru:.2f}")
    if not clauses:
        return ""
    sentence = "Rows: " + "; ".join(clauses)
    if losses:
        sentence += "; " + _why(losses)
    return sentence + " (ratios: LPM over FCFS; latency and TTFT lower is better)."


def _header(bench_argv: list[str], first: Optional[dict[str, Any]]) -> str:
    dataset = (first or {}).get("dataset") or {}
    oracle = (first or {}).get("oracle_hit_rate")
    return (f"Workload: `{' '.join(bench_argv)}`; {dataset.get('num_requests', '?')} requests, "
            f"{dataset.get('prompt_tokens', '?')} prompt tokens, system-prompt share "
            f"{dataset.get('system_prompt_fraction', '?')}; oracle hit rate (unlimited) "
            f"{'n/a' if oracle is None else round(oracle, 3)}.")


def _legend(results: list[ConfigResult], small_pool: int) -> str:
    def pool_text(r: ConfigResult) -> str:
        pools = (r.router or {}).get("pool_tokens_per_worker") or []
        if not pools:
            return "workers did not start"
        same = len(set(pools)) == 1
        return f"KV pool {pools[0] if same else '/'.join(str(p) for p in pools)} tokens per worker"

    return "\n".join(f"- `{r.config.name}`: {r.config.description}"
                     + (f" ({small_pool} tokens)" if r.config.small_pool else "")
                     + (f" ({pool_text(r)})" if r.config.router_policy else "") for r in results)


def columns_note(columns: tuple[str, ...]) -> str:
    if "Belady bound" in columns:
        bound = ("'Belady bound': the most any eviction order can hit in the server's KV pool with the requests "
                 "served in send order (achieved/Belady above 1: the schedule reordered them to find more reuse)")
    else:
        bound = ("'oracle (unlimited)': the hit rate of a cache that never evicts, so achieved/oracle is at most "
                 "about 1 and shows what a pool's size and policy cost")
    return (f"latency in s, TTFT in ms; {bound}; 'LRU at capacity': an LRU cache of the server's pool replayed in "
            "send order, a reference and not a bound (another order or eviction can beat it).")


def write_outputs(results: list[ConfigResult], out_dir: Path, *, command: str, bench_argv: list[str],
                  server_args: list[str], small_pool: int, policies: list[str], wall_s: float, plots: bool) -> None:
    """results.json, table.md and the plots in out_dir; the table and the sentence on stdout."""
    records = [r.record for r in results if r.record is not None]
    first = records[0] if records else None
    meta = {"command": command, "bench_argv": bench_argv, "server_args": server_args,
            "small_pool_tokens": small_pool, "router_policies": policies,
            "dataset": first.get("dataset") if first else None,
            "oracle_hit_rate": first.get("oracle_hit_rate") if first else None, "wall_s": round(wall_s, 1)}
    sentence = explanation(results, small_pool)
    meta["explanation"] = sentence
    payload = {"meta": meta, "configs": [
        {"name": r.config.name, "description": r.config.description, "server_args": r.server_args,
         "error": r.error, "wall_s": round(r.wall_s, 2), "record": r.record, "ttft_s": r.ttft_s,
         "latency_s": r.latency_s, "hit_rate_curve": r.hit_rate_curve,
         **({"router": r.router} if r.config.router_policy else {})} for r in results]}
    (out_dir / "results.json").write_text(json.dumps(payload, indent=1))
    columns = experiment_columns(records)
    rows = [experiment_row(r.config.name, r.record, r.error, columns) for r in results]
    header, note = _header(bench_argv, first), columns_note(columns)
    rrows = router_rows(results)
    router_note = ("Router configurations: the hit rate is the aggregate over all workers; the oracles simulate one "
                   "cache as large as all the workers' pools together.")
    router_md = f"\n{router_note}\n\n{markdown_table(rrows, ROUTER_COLUMNS)}\n" if rrows else ""
    (out_dir / "table.md").write_text(f"{header}\n\n{markdown_table(rows, columns)}\n\n{sentence}\n\n{note}\n\n"
                                      f"{_legend(results, small_pool)}\n{router_md}")
    files = []
    if plots:
        from radixserve.experiment.plots import write_plots

        files = write_plots(results, out_dir)
    print()
    print(header)
    print()
    print(console_table(rows, columns))
    print()
    if sentence:
        print(sentence)
        print()
    print(note)
    if rrows:
        print()
        print(router_note)
        print()
        print(console_table(rrows, ROUTER_COLUMNS))
    print(f"results: {out_dir / 'results.json'}, table: {out_dir / 'table.md'}"
          + (f", plots: {', '.join(str(out_dir / p) for p in files)}" if files else ""))
    print(f"total time {wall_s:.0f} s")
