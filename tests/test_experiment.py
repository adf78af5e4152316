"""The experiment end to end on the CPU: servers started by it, table, JSON and plots."""

from __future__ import annotations

import json

import pytest

from radixserve.bench.report import BELADY_COLUMNS, EXPERIMENT_COLUMNS, experiment_columns, experiment_row
from radixserve.experiment import main
from radixserve.experiment.configs import all_configs
from radixserve.experiment.plots import bound_lines
from radixserve.experiment.runs import ConfigResult
from radixserve.experiment.tables import TIMING_NOTE, explanation


def test_experiment_end_to_end(server_model_dir, tmp_path, capsys):
    out = tmp_path / "exp"
    code = main(["--model-path", str(server_model_dir), "--output-dir", str(out),
                 "--configs", "lpm,no-radix,lpm-small-pool", "--dataset-name", "agent", "--num-prompts", "12", "--agent-turns", "3",
                 "--agent-output-len", "4", "--agent-think-time", "0.02", "--request-rate", "inf",
                 "--disable-tqdm"])
    assert code == 0
    text = capsys.readouterr().out
    assert "configuration" in text and "achieved/Belady" in text and "lpm-small-pool" in text
    payload = json.loads((out / "results.json").read_text())
    names = [c["name"] for c in payload["configs"]]
    assert names == ["lpm", "no-radix", "lpm-small-pool"]
    recs = {c["name"]: c["record"] for c in payload["configs"]}
    assert all(r is not None and r["completed"] == 12 and r["failed"] == 0 for r in recs.values())
    assert recs["no-radix"]["hit_rate"] == 0
    assert recs["lpm"]["hit_rate"] > 0.3
    # same workload and seed everywhere
    assert len({json.dumps(r["dataset"]) for r in recs.values()}) == 1
    small = payload["meta"]["small_pool_tokens"]
    assert recs["lpm-small-pool"]["oracle_capacity_tokens"] == small
    assert recs["lpm-small-pool"]["server_settings"]["max_total_tokens"] == small
    table = (out / "table.md").read_text()
    assert table.count("\n| ") >= 4 and "| lpm |" in table
    for png in ("throughput_p99.png", "ttft_cdf.png", "hit_rate_over_time.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert (out / "server-lpm.log").exists() and not list(out.glob("*.out"))  # one log per server
    assert "engine ready" in (out / "server-lpm.log").read_text()
    sentence = payload["meta"]["explanation"]
    assert sentence.startswith("Rows: ") and "no-radix recomputes every prompt" in sentence
    assert sentence in text and sentence in table


def test_experiment_router_configurations(server_model_dir, tmp_path, capsys):
    """A full-pool run sizes the small pool; router workers start once with it; one row per policy."""
    out = tmp_path / "exp"
    code = main(["--model-path", str(server_model_dir), "--output-dir", str(out), "--configs", "lpm",
                 "--router-policies", "round_robin,cache_aware", "--dataset-name", "agent", "--num-prompts", "16", "--agent-turns", "4",
                 "--agent-output-len", "4", "--agent-think-time", "0.02", "--request-rate", "inf",
                 "--disable-tqdm", "--disable-plots"])
    assert code == 0
    text = capsys.readouterr().out
    assert "starting 2 router workers" in text and "requests per worker" in text
    payload = json.loads((out / "results.json").read_text())
    assert [c["name"] for c in payload["configs"]] == ["lpm", "router-round_robin", "router-cache_aware"]
    assert payload["meta"]["router_policies"] == ["round_robin", "cache_aware"]
    small = payload["meta"]["small_pool_tokens"]
    by_name = {c["name"]: c for c in payload["configs"]}
    lpm = by_name["lpm"]["record"]
    for name in ("router-round_robin", "router-cache_aware"):
        c = by_name[name]
        rec, router = c["record"], c["router"]
        assert c["error"] is None and rec["completed"] == 16 and rec["failed"] == 0
        assert rec["dataset"] == lpm["dataset"]  # the same workload as the single server's
        assert router["pool_tokens_per_worker"] == [small, small] and router["started_workers"]
        assert "--max-total-tokens" in c["server_args"] and str(small) in c["server_args"]
        # the router's /server_info sums the pools, so the capacity oracle sees the cluster's
        assert rec["server"]["pool_size"] == 2 * small and rec["oracle_capacity_tokens"] == 2 * small
        # aggregated over both workers: the responses' counts equal the workers' /metrics summed (the
        # router's health checks send the engines nothing)
        assert rec["metrics_cached_tokens"] == rec["cached_tokens"], rec
        assert 0 <= rec["metrics_prompt_tokens"] - rec["total_input_tokens"] <= 20, rec
        assert sum(router["requests_per_worker"].values()) == 17  # 16 + the warm-up request
    rr, ca = (by_name[n]["router"] for n in ("router-round_robin", "router-cache_aware"))
    assert sorted(rr["requests_per_worker"].values()) == [8, 9] and rr["decisions"] == {"direct": 17}
    assert ca["decisions"].get("matched", 0) >= 10
    table = (out / "table.md").read_text()
    assert "| router-cache_aware |" in table and "hit rate (workers' /metrics)" in table
    assert (out / "router-cache_aware.log").exists() and not (out / "router-kv_aware.log").exists()
    assert (out / "worker-0.log").exists() and (out / "worker-1.log").exists()


@pytest.mark.parametrize("argv, message", [
    (["--configs", "lpm,bogus"], "unknown configuration(s) bogus"),
    (["--port", "8000"], "--port is chosen by the experiment itself"),
    (["--model-path", "/nonexistent/model"], "no such directory"),
    (["--request-rate", "-1"], "--request-rate must be > 0"),
    (["--router-policies", "round_robin", "bogus"], "unknown router policy 'bogus'"),
    (["--configs", "none"], "(or 'none' with --router-policies)"),
    (["--worker-urls", "http://127.0.0.1:1"], "give --router-policies too"),
    (["--router-policies", "all", "--worker-urls", "127.0.0.1:1"], "must start with http"),
    (["--router-policies", "all", "--configs", "none"], "give --router-pool-tokens"),
    (["--router-policies", "all", "--router-pool-tokens", "-3"], "must be >= 0 or 'full'"),
    (["--router-policies", "all", "--router-workers", "0"], "--router-workers must be >= 1"),
    (["--router-policies", "all", "--metrics-url", "http://x:1"], "--metrics-url is chosen by the experiment"),
])
def test_experiment_bad_arguments(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--output-dir", str(tmp_path / "x")])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_experiment_server_that_cannot_start_is_reported(tmp_path, capsys):
    # a model directory without a model: the server exits, the experiment says so and finishes
    bad = tmp_path / "empty-model"
    bad.mkdir()
    code = main(["--model-path", str(bad), "--output-dir", str(tmp_path / "exp"), "--configs", "lpm",
                 "--num-prompts", "2", "--disable-tqdm", "--server-start-timeout", "60"])
    assert code == 1
    text = capsys.readouterr().out
    assert "FAILED" in text and "the server exited" in text
    payload = json.loads((tmp_path / "exp" / "results.json").read_text())
    assert payload["configs"][0]["error"]


def _record(hit: float, thr: float, p99_ms: float, ttft_p99_ms: float, ttft_p50_ms: float, **extra) -> dict:
    return {"hit_rate": hit, "total_throughput": thr, "e2e_latency_ms": {"median": p99_ms / 2, "p99": p99_ms},
            "ttft_ms": {"median": ttft_p50_ms, "p99": ttft_p99_ms}, "failed": 0, **extra}


def test_sentence_under_the_table_states_only_what_repeats():
    """Hit rates and prompt tokens computed, never a ratio of timings (noise at the default size),
    and no ratio legend for pairs that did not run."""
    configs = {c.name: c for c in all_configs()}
    records = {"lpm": _record(0.88, 3000, 20000, 9000, 400, total_input_tokens=1000, cached_tokens=880),
               "fcfs": _record(0.88, 2950, 9000, 8500, 4000, total_input_tokens=1000, cached_tokens=880),
               "no-radix": _record(0.0, 1000, 60000, 50000, 30000, total_input_tokens=1000, cached_tokens=0),
               "lpm-small-pool": _record(0.80, 2800, 21000, 9000, 500, total_input_tokens=1000, cached_tokens=800),
               "fcfs-small-pool": _record(0.40, 1400, 40000, 30000, 15000, total_input_tokens=1000, cached_tokens=400),
               "lpm-fifo-small-pool": _record(0.70, 2500, 25000, 10000, 600)}
    sentence = explanation([ConfigResult(configs[n], record=r) for n, r in records.items()], small_pool=3000)
    assert sentence.startswith("Rows: under the small pool (3000 tokens) LPM gets hit rate 0.80 vs 0.40, 200 prompt "
                               "tokens computed vs 600 (3.00x fewer than FCFS)")
    assert "with the full pool LPM gets hit rate 0.88 vs 0.88, 120 prompt tokens computed vs 120 (as many as FCFS)" \
        in sentence
    assert "no-radix recomputes every prompt: 1000 prompt tokens computed where lpm computes 120" in sentence
    assert "hit rate 0.70 vs 0.80" in sentence
    for timing in ("throughput 2", "x the throughput", "P99 latency 0", "TTFT P", "ratios:"):
        assert timing not in sentence, timing
    assert sentence.endswith(TIMING_NOTE) and "hit rate is lower" not in sentence
    records["lpm-small-pool"] = _record(0.70, 2800, 30000, 9000, 500, total_input_tokens=1000, cached_tokens=700)
    records["fcfs-small-pool"] = _record(0.75, 2800, 21000, 9000, 500, total_input_tokens=1000, cached_tokens=750)
    sentence = explanation([ConfigResult(configs[n], record=r) for n, r in records.items()], small_pool=3000)
    assert "hit rate 0.70 vs 0.75, 300 prompt tokens computed vs 250 (1.20x more than FCFS)" in sentence
    assert "LPM's hit rate is lower under the small pool because" in sentence
    # Without an FCFS row there is no LPM-over-FCFS comparison and no legend for one.
    alone = explanation([ConfigResult(configs["lpm"], record=records["lpm"]),
                         ConfigResult(configs["no-radix"], record=records["no-radix"])], small_pool=3000)
    assert "FCFS" not in alone and "ratios" not in alone and alone.startswith("Rows: no-radix recomputes")


def test_table_and_plot_use_the_bound_the_records_carry():
    plain = _record(0.5, 1, 1, 1, 1, oracle_hit_rate=0.8, achieved_over_oracle=0.625, oracle_hit_rate_capacity=0.6,
                    oracle_capacity_tokens=3000)
    assert experiment_columns([plain, None]) == EXPERIMENT_COLUMNS
    row = experiment_row("x", plain, columns=EXPERIMENT_COLUMNS)
    assert row[7:] == ["0.800", "0.62", "0.600", "0"]
    full = dict(plain, oracle_capacity_tokens=65536, oracle_hit_rate_capacity=0.8)
    assert bound_lines([full, plain]) == [(0.8, "oracle (unlimited)", "--"), (0.6, "LRU at capacity (3000 tokens)", ":")]
    belady = dict(plain, oracle_belady_hit_rate=0.7, achieved_over_belady=0.5 / 0.7)
    assert experiment_columns([plain, belady]) == BELADY_COLUMNS
    assert experiment_row("x", belady, columns=BELADY_COLUMNS)[7:9] == ["0.700", "0.71"]
    assert bound_lines([belady])[1] == (0.7, "Belady bound (3000 tokens)", ":")
