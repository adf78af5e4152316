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
HIT_TIE = 0.01
# Said under the table instead of timing ratios: at the default size the same configuration's
# throughput moved 4.6x within one invocation (18,823 and 85,811 tok/s) and two rows that ran
# identical batches differed 2.7x, so a ratio of timings there is the machine's, not the policies'.
TIMING_NOTE = ("Timings (throughput, latency, TTFT) are not compared: at this size they move more between runs "
               "than between policies on a shared machine; the hit rates and prompt tokens computed repeat.")


def _get(record: dict[str, Any], key: str, sub: Optional[str] = None) -> Optional[float]:
    value = record.get(key)
    if sub is not None and isinstance(value, dict):
        value = value.get(sub)
    return value if isinstance(value, (int, float)) else None


def _computed(record: dict[str, Any]) -> Optional[int]:
    prompt, cached = _get(record, "total_input_tokens"), _get(record, "cached_tokens")
    return None if prompt is None or cached is None else int(prompt - cached)


def _fewer(ours: int, theirs: int, whose: str) -> str:
    """'2.19x fewer than FCFS', or 'as many as FCFS' / 'more than FCFS'."""
    if ours == theirs:
        return f"as many as {whose}"
    if ours > theirs:
        return f"{ours / theirs:.2f}x more than {whose}" if theirs else f"more than {whose}"
    return f"{theirs / ours:.2f}x fewer than {whose}" if ours else f"none where {whose} computed some"


def _pair_clause(lpm: dict[str, Any], fcfs: dict[str, Any], where: str) -> tuple[str, list[str]]:
    """'under the small pool LPM gets hit rate ... than FCFS' (what repeats from run to run: the
    cache's figures) and the measures on which LPM lost."""
    hit_l, hit_f = _get(lpm, "hit_rate"), _get(fcfs, "hit_rate")
    parts = []
    if hit_l is not None and hit_f is not None:
        parts.append(f"hit rate {hit_l:.2f} vs {hit_f:.2f}")
    computed_l, computed_f = _computed(lpm), _computed(fcfs)
    lost = []
    if computed_l is not None and computed_f is not None:
        # The prompt tokens each had to compute: the work the cache saved, independent of the machine.
        parts.append(f"{computed_l} prompt tokens computed vs {computed_f} ({_fewer(computed_l, computed_f, 'FCFS')})")
    if hit_l is not None and hit_f is not None and hit_l < hit_f - HIT_TIE:
        lost.append("hit rate")
    return f"{where} LPM gets {', '.join(parts) or 'no cache figures'}", lost


def explanation(results: list[ConfigResult], small_pool: int) -> str:
    """One sentence on what the rows show that repeats from run to run (hit rates, prompt tokens
    computed), with where LPM's cache does worse and why, and a note that timings are not compared."""
    rec = {r.config.name: r.record for r in results if r.record is not None}
    clauses, lower_hit = [], []
    for lpm, fcfs, where in POLICY_PAIRS:
        if lpm in rec and fcfs in rec:
            clause, lost = _pair_clause(rec[lpm], rec[fcfs], where.replace("small pool", f"small pool ({small_pool} "
                                                                            "tokens)"))
            clauses.append(clause)
            if "hit rate" in lost:
                lower_hit.append(where)
    base = rec.get("lpm")
    if base is not None and "no-radix" in rec:
        work = _computed(base), _computed(rec["no-radix"])
        if None not in work:
            clauses.append(f"no-radix recomputes every prompt: {work[1]} prompt tokens computed where lpm computes "
                           f"{work[0]}")
    if "lpm-small-pool" in rec and "lpm-fifo-small-pool" in rec:
        lru, fifo = _get(rec["lpm-small-pool"], "hit_rate"), _get(rec["lpm-fifo-small-pool"], "hit_rate")
        if lru is not None and fifo is not None:
            clauses.append(f"FIFO eviction instead of LRU gives hit rate {fifo:.2f} vs {lru:.2f}")
    if not clauses:
        return ""
    sentence = "Rows: " + "; ".join(clauses)
    if lower_hit:
        sentence += (f"; LPM's hit rate is lower {' and '.join(lower_hit)} because the order it admitted requests in "
                     "evicted prefixes that waiting requests needed again, where FCFS's order kept them")
    return f"{sentence}. {TIMING_NOTE}"


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
