"""Process lifecycle: startup checks fail fast before anything loads, 'serving' is said once the engine is
ready, engine death ends the server within seconds, SIGTERM drains, exits 0 and leaves nothing behind."""

from __future__ import annotations

import csv
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import REPO_ROOT, ServerProcess, free_port, seed_launch_args

from radixserve.engine import step_trace

pytestmark = pytest.mark.timeout(300)


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return out


def wait_until(predicate, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)
    return time.monotonic() - start


def launch(argv: list[str], cache_dir: Path) -> subprocess.CompletedProcess:
    """`python -m radixserve.launch_server argv` run to its end, with an empty tiny-model cache."""
    env = {**os.environ, "RADIXSERVE_CACHE": str(cache_dir)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "radixserve.launch_server", "--device", "cpu", *argv],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)


def assert_failed_before_loading(run: subprocess.CompletedProcess, cache_dir: Path, message: str) -> None:
    # One line, the reason, and nothing loaded or built: no engine process, an empty model cache.
    assert run.returncode == 1
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert len(lines) == 1 and "server failed: " in lines[0] and message in lines[0], lines
    assert not cache_dir.exists() or not any(cache_dir.iterdir())


def test_missing_model_path_fails_before_loading(tmp_path):
    run = launch(["--model-path", str(tmp_path / "no-such-model"), "--port", str(free_port())], tmp_path / "cache")
    assert_failed_before_loading(run, tmp_path / "cache", "no-such-model': no such directory")
    (tmp_path / "empty").mkdir()
    run = launch(["--model-path", str(tmp_path / "empty"), "--port", str(free_port())], tmp_path / "cache")
    assert_failed_before_loading(run, tmp_path / "cache", "no config.json in it")


@pytest.mark.parametrize("config,found", [
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "unsupported architecture LlamaForCausalLM"),
    ({"model_type": "mistral"}, "unsupported architecture model_type='mistral'"),
])
def test_unsupported_architecture_is_one_line_on_stderr(tmp_path, server_model_dir, config, found):
    """A config.json of a model radixserve does not run: one line on stderr naming it and the
    supported ones, exit 1, before any engine starts (no traceback)."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(server_model_dir, model)
    data = json.loads((model / "config.json").read_text())
    data.pop("architectures")
    (model / "config.json").write_text(json.dumps({**data, **config}))
    run = launch(["--model-path", str(model), "--port", str(free_port())], tmp_path / "cache")
    assert_failed_before_loading(run, tmp_path / "cache", found)
    assert run.stdout == "" and "Qwen2ForCausalLM" in run.stderr and "Traceback" not in run.stderr


def test_engine_that_fails_to_start_is_one_server_line_without_traceback(tmp_path, server_model_dir):
    """A failure only the engine finds (here: no weights) ends the server with one `server failed`
    line and exit 1, not uvicorn's lifespan traceback and exit 3."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(server_model_dir, model)
    for weights in model.glob("*.safetensors"):
        weights.unlink()
    run = launch(["--model-path", str(model), "--port", str(free_port())], tmp_path / "cache")
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert run.returncode == 1, lines
    assert "Traceback" not in run.stderr and "server failed: " in lines[-1] and "no safetensors" in lines[-1], lines


def test_missing_chat_template_fails_before_loading(tmp_path):
    run = launch(["--chat-template", str(tmp_path / "no-such.jinja"), "--port", str(free_port())], tmp_path / "cache")
    assert_failed_before_loading(run, tmp_path / "cache", "no-such.jinja': no such file")


def test_busy_port_fails_before_loading(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run = launch(["--port", str(port)], tmp_path / "cache")  # the default model: nothing may be built
    assert_failed_before_loading(run, tmp_path / "cache", f"--port {port}: 127.0.0.1:{port} is already in use")


@pytest.mark.parametrize("port", [99999, 0, -1])
def test_port_outside_tcp_range_fails_before_loading(tmp_path, port):
    # The socket layer would take 99999 modulo 65536 and listen on 34463 while the log said 99999.
    run = launch(["--port", str(port)], tmp_path / "cache")
    assert_failed_before_loading(run, tmp_path / "cache", f"--port {port}: a TCP port is 1-65535")


def test_router_port_outside_tcp_range_is_one_line_exit_1():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    run = subprocess.run([sys.executable, "-m", "radixserve.launch_router", "--port", "99999"], cwd=REPO_ROOT,
                         env=env, capture_output=True, text=True, timeout=60)
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert run.returncode == 1
    assert lines == ["router failed: --port 99999: a TCP port is 1-65535"], lines


def test_context_length_beyond_the_model_fails_before_loading(tmp_path, server_model_dir):
    run = launch(["--context-length", "100000", "--port", str(free_port())], tmp_path / "cache")
    assert_failed_before_loading(run, tmp_path / "cache", "context_length 100000 is more than the model's "
                                 "max_position_embeddings 32768 (the built-in tiny model)")
    run = launch(["--model-path", str(server_model_dir), "--context-length", "5000", "--port", str(free_port())],
                 tmp_path / "cache")
    assert_failed_before_loading(run, tmp_path / "cache", "max_position_embeddings 4096")
    assert "--allow-longer-context-length" in run.stderr


def test_served_name_as_model_path_hints_at_the_default(tmp_path):
    run = launch(["--model-path", "tiny-qwen2", "--port", str(free_port())], tmp_path / "cache")
    assert_failed_before_loading(run, tmp_path / "cache", "leave --model-path out to serve the built-in tiny model")


def test_host_tier_beyond_host_memory_fails_before_loading(tmp_path):
    run = launch(["--hicache-size", "100000", "--port", str(free_port())], tmp_path / "cache")
    assert_failed_before_loading(run, tmp_path / "cache", "--hicache-size 100000 needs 100000.0 GB of host memory;")


def test_engine_that_cannot_start_never_says_serving(tmp_path):
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text("{}")  # no architecture, no weights: the engine fails to load it
    run = launch(["--model-path", str(model), "--port", str(free_port())], tmp_path / "cache")
    output = run.stdout + run.stderr
    assert run.returncode != 0
    assert " serving " not in output and "engine ready" not in output


def test_serving_line_after_engine_ready_and_clean_sigterm(server_model_dir, server_workdir):
    log_file = server_workdir / "lifecycle.log"
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--log-file", str(log_file)],
                         server_workdir).wait_ready()
    try:
        models = httpx.get(f"{proc.base_url}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == [server_model_dir.name]  # the directory's name, not its path
        proc.proc.send_signal(signal.SIGTERM)
        code = proc.proc.wait(60)
    finally:
        proc.stop()
    lines = log_file.read_text().splitlines()
    ready = next(i for i, line in enumerate(lines) if "engine process" in line and " ready: " in line)
    serving = [i for i, line in enumerate(lines) if f"] serving {server_model_dir} on http://127.0.0.1:{proc.port}" in line]
    assert len(serving) == 1 and serving[0] > ready
    assert code == 0
    assert lines[-1].endswith("server shut down on SIGTERM"), lines[-3:]


def test_engine_death_answers_503_and_exits_nonzero(server_model_dir, server_workdir):
    # Started through the console script's entry point: `radixserve serve <the seed's flags>`.
    proc = ServerProcess(["serve", *seed_launch_args(server_model_dir), "--device", "cpu"],
                         server_workdir, module="radixserve.cli").wait_ready()
    try:
        info = proc.server_info()
        engine_pid, ipc_dir = info["engine_pid"], info["ipc_dir"]
        assert children_of(proc.proc.pid) == [engine_pid]
        assert os.path.isdir(ipc_dir)
        with httpx.Client(base_url=proc.base_url, timeout=30) as http:
            body = {"text": "The weather today is sunny", "stream": True,
                    "sampling_params": {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}}
            with http.stream("POST", "/generate", json=body) as stream:
                lines = stream.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                os.kill(engine_pid, signal.SIGKILL)
                killed_at = time.monotonic()
                tail = [line for line in lines if line.startswith("data: ")]  # ends, does not hang
            assert tail[-1] == "data: [DONE]" and '"engine_unavailable"' in tail[-2]
        # The server does not linger answering 503: it exits non-zero, for its supervisor to restart it.
        code = proc.proc.wait(10)
        assert time.monotonic() - killed_at < 5.0
    finally:
        proc.stop(timeout_s=20)
    assert code == 1
    assert "the engine process" in proc.output_path.read_text() and "restarts it" in proc.output_path.read_text()
    assert not pid_alive(engine_pid) and not os.path.exists(ipc_dir)


def test_sigterm_drains_in_flight_requests(server_model_dir, server_workdir):
    trace = server_workdir / "steps.csv"
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--step-trace-file", str(trace),
                          "--graceful-shutdown-timeout", "300"],
                         server_workdir).wait_ready()
    info = proc.server_info()
    engine_pid, ipc_dir = info["engine_pid"], info["ipc_dir"]
    result: dict = {}

    def long_request():
        body = {"prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
        result["response"] = httpx.post(f"{proc.base_url}/v1/completions", json=body, timeout=240)

    worker = threading.Thread(target=long_request)
    worker.start()
    try:
        wait_until(lambda: proc.server_info()["stats"]["running_requests"] == 1, 10.0, "the request runs")
        proc.proc.send_signal(signal.SIGTERM)
        # The drain waits for the request however slow a busy machine makes its 1,500 tokens.
        worker.join(240)
        assert proc.proc.wait(60) == 0
    finally:
        proc.stop()
    response = result["response"]
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1500  # finished, not cut
    assert not pid_alive(engine_pid), "the engine process outlived the server"
    assert not os.path.exists(ipc_dir), "socket files left behind"
    # The step trace was written out through the SIGTERM: one prefill, then a decode step per token.
    with open(trace, newline="") as f:
        rows = list(csv.DictReader(f))
    kinds = [r["kind"] for r in rows if r["kind"] != "collect"]
    assert kinds[0] == "mixed" and int(rows[0]["new_tokens"]) > 0
    assert kinds.count("decode") >= 1498 and set(kinds) == {"mixed", "decode"}
    assert all(float(r["step_ms"]) > 0 and float(r["gap_ms"]) >= 0 for r in rows)
    # The wait for the device's tokens is part of the step (on the CPU there is no event to wait on).
    assert all(0 <= float(r["wait_ms"]) <= float(r["step_ms"]) for r in rows)
    summary = step_trace.summarize(str(trace))
    assert "decode" in summary and "mixed" in summary


def test_long_garbage_collections_are_logged(caplog):
    """Every collection at or over the threshold is logged with its generation (here: all of them)."""
    import gc
    import logging

    from radixserve.process.gc_tuning import log_long_collections

    callback = log_long_collections("test-process", threshold_s=0.0)
    try:
        assert callback is not None and log_long_collections("test-process", threshold_s=0.0) is None
        with caplog.at_level(logging.WARNING, logger="radixserve"):
            gc.collect()
    finally:
        gc.callbacks.remove(callback)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("test-process:")]
    assert any("generation 2" in line for line in lines), lines


def test_full_collection_governor_collects_fully_only_when_idle_or_after_max_busy(caplog):
    """Automatic full collections are off while installed: a cycle that reached the oldest
    generation waits for the governor's full collection, made when idle (not before the idle
    interval), or when busy only after max_busy_s. Young cycles are still collected at once."""
    import gc
    import weakref

    import logging

    from radixserve.process.gc_tuning import FullCollectionGovernor, log_long_collections

    class Node:
        pass

    def old_cycle() -> weakref.ref:
        a, b = Node(), Node()
        a.other, b.other = b, a
        gc.collect(1)  # both survive into the oldest generation
        return weakref.ref(a)  # a and b are garbage once this returns

    def churn() -> None:  # enough allocations for many automatic young collections, no full one
        for _ in range(50):
            [Node() for _ in range(gc.get_threshold()[0] + 1)]

    now = [0.0]
    saved = gc.get_threshold()
    gc.collect()
    governor = FullCollectionGovernor("test-process", idle_interval_s=30.0, max_busy_s=300.0,
                                      clock=lambda: now[0]).install()
    try:
        assert gc.get_threshold()[2] == FullCollectionGovernor.NEVER
        young = Node()
        young.self = young
        young_ref = weakref.ref(young)
        del young
        gc.collect(0)
        assert young_ref() is None  # young cycles: collected as ever
        cycle = old_cycle()
        churn()
        assert cycle() is not None  # no automatic full collection reached it
        assert not governor.maybe_collect(idle=False)  # busy, within max_busy_s
        assert not governor.maybe_collect(idle=True)  # idle, but the idle interval has not passed
        now[0] = 31.0
        warn_all = log_long_collections("test-governor", threshold_s=0.0)
        try:
            with caplog.at_level(logging.INFO, logger="radixserve"):
                assert governor.maybe_collect(idle=True)
        finally:
            gc.callbacks.remove(warn_all)
        assert cycle() is None and governor.complete_collections == 1
        lines = [r.getMessage() for r in caplog.records]
        assert any(line.startswith("test-process: full garbage collection (idle)") for line in lines), lines
        assert not any(line.startswith("test-governor:") for line in lines), lines  # not a stall
        now[0] = 62.0
        assert not governor.maybe_collect(idle=True)  # nothing reached the oldest generation since
        cycle = old_cycle()
        now[0] = 100.0
        assert not governor.maybe_collect(idle=False)
        now[0] = 31.0 + 300.0
        assert governor.maybe_collect(idle=False) and cycle() is None
    finally:
        governor.uninstall()
    assert gc.get_threshold() == saved


def test_event_loop_stall_is_logged_and_counted(caplog):
    """A synchronous pause inside the loop is seen as lag by the watch (logged over the threshold);
    short awaits are not."""
    import asyncio
    import logging

    from radixserve.http_common.loop_lag import watch_loop_lag

    async def scenario():
        async with watch_loop_lag("test-loop", threshold_s=0.15, interval_s=0.01) as watch:
            await asyncio.sleep(0.1)  # awaiting is not a stall
            assert watch.stalls == 0
            time.sleep(0.4)  # holds the loop
            await asyncio.sleep(0.05)
        return watch

    with caplog.at_level(logging.WARNING, logger="radixserve"):
        watch = asyncio.run(scenario())
    assert watch.stalls == 1 and 0.35 <= watch.max_lag_s < 2.0, (watch.stalls, watch.max_lag_s)
    assert any(r.getMessage().startswith("test-loop: event loop stalled for") for r in caplog.records)


def test_sigterm_during_a_grammar_compile_is_quiet(server_model_dir, server_workdir):
    """SIGTERM while a large schema compiles: the request gets its 503 (a 200 if the compile was
    already done), the server exits 0 with its shutdown line and no traceback, and quickly (the
    engine process exits without joining the compile thread)."""
    # Within every grammar limit but slow to compile (15 objects of 128 optional bounded strings:
    # ~0.5 s on 2 quiet cores, longer on busy ones); a larger schema is refused before compiling.
    schema = {"type": "object", "properties": {f"o{j}": {"type": "object", "properties": {
        f"p{i}": {"type": "string", "maxLength": 5} for i in range(128)}} for j in range(15)}}
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu",
                          "--graceful-shutdown-timeout", "1"], server_workdir).wait_ready()
    answers = []

    def send() -> None:
        try:
            answers.append(httpx.post(f"{proc.base_url}/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}}))
        except httpx.HTTPError as e:
            answers.append(e)

    client = threading.Thread(target=send)
    client.start()
    time.sleep(0.3)  # the compile is under way (unless a fast machine already finished it: then a 200)
    proc.proc.send_signal(signal.SIGTERM)
    code = proc.proc.wait(90)
    client.join(30)
    output = proc.output()
    proc.stop()
    assert code == 0 and "server shut down on SIGTERM" in output, output[-3000:]
    assert "Traceback" not in output and "Exception ignored" not in output, output[-3000:]
    assert answers and isinstance(answers[0], httpx.Response) and answers[0].status_code in (200, 503), answers
