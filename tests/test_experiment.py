"""The experiment end to end on the CPU: servers started by it, table, JSON and plots."""

from __future__ import annotations

import json

import pytest

from radixserve.experiment import main


def test_experiment_end_to_end(server_model_dir, tmp_path, capsys):
    out = tmp_path / "exp"
    code = main(["--model-path", str(server_model_dir), "--output-dir", str(out),
                 "--configs", "lpm,no-radix,lpm-small-pool", "--num-prompts", "12", "--agent-turns", "3",
                 "--agent-output-len", "4", "--agent-think-time", "0.02", "--request-rate", "inf",
                 "--disable-tqdm"])
    assert code == 0
    text = capsys.readouterr().out
    assert "configuration" in text and "achieved/oracle" in text and "lpm-small-pool" in text
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
    assert (out / "server-lpm.log").exists()


@pytest.mark.parametrize("argv, message", [
    (["--configs", "lpm,bogus"], "unknown configuration(s) bogus"),
    (["--port", "8000"], "--port is chosen by the experiment itself"),
    (["--model-path", "/nonexistent/model"], "no such directory"),
    (["--request-rate", "-1"], "--request-rate must be > 0"),
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
