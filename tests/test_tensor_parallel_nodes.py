"""Tensor parallelism across machines, on the CPU: two "nodes" as two process trees on loopback,
each started by `launch_server` as on two machines (`--tp 2 --nnodes 2 --node-rank K
--dist-init-addr 127.0.0.1:PORT`), one rank each, over gloo. Node 0 serves HTTP and schedules;
node 1 runs rank 1 only. The greedy tokens equal tp 1's and Hugging Face's; node 1 ends when node
0 stops the engine; a rank killed on node 1 ends node 0's server with a line naming it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import REPO_ROOT, ServerProcess, free_port
from test_engine import GREEDY, hf_greedy, make_prompts
from test_server_lifecycle import children_of

from radixserve import Engine
from radixserve.launch_server import parse_settings
from radixserve.testing.tiny_model import build_tiny_model

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def gqa2(tmp_path_factory):
    """4 query heads, 2 KV heads: one KV head per rank, one rank per node."""
    path = build_tiny_model(tmp_path_factory.mktemp("nodes-gqa2"), num_heads=4, num_kv_heads=2)
    prompts = make_prompts(512, seed=2)[:8]  # shared prefixes, a one-token prompt, a duplicate
    return path, prompts, hf_greedy(path, prompts)


def _node_args(path: Path, port: int, node_rank: int) -> list[str]:
    return ["--model-path", str(path), "--device", "cpu", "--tp", "2", "--nnodes", "2", "--node-rank",
            str(node_rank), "--dist-init-addr", f"127.0.0.1:{port}", "--max-total-tokens", "4096",
            "--chunked-prefill-size", "7", "--log-level", "info"]


class OtherNode:
    """`launch_server --node-rank 1`: no port of its own, its output in a file."""

    def __init__(self, args: list[str], workdir: Path):
        self.output_path = workdir / f"node1-{time.monotonic_ns()}.out"
        self._out = open(self.output_path, "wb")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([sys.executable, "-m", "radixserve.launch_server", *args], cwd=REPO_ROOT,
                                     env=env, stdout=self._out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        if not self._out.closed:
            self._out.flush()
        return self.output_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


def _generate(base_url: str, prompts: list[list[int]]) -> list[list[int]]:
    r = httpx.post(base_url + "/generate", json={"input_ids": prompts, "sampling_params": GREEDY}, timeout=120)
    assert r.status_code == 200, r.text
    return [o["output_ids"] for o in r.json()]


def test_two_nodes_give_the_tokens_of_one(gqa2, tmp_path):
    path, prompts, expected = gqa2
    with Engine(str(path), max_total_tokens=4096, chunked_prefill_size=7) as single:
        assert [r["output_ids"] for r in single.generate(input_ids=prompts, sampling_params=GREEDY)] == expected
    port = free_port()
    other = OtherNode(_node_args(path, port, 1), tmp_path)  # started first: its rank waits for rank 0
    server = None
    try:
        server = ServerProcess(_node_args(path, port, 0), tmp_path).wait_ready()
        assert _generate(server.base_url, prompts) == expected
        assert _generate(server.base_url, prompts) == expected  # again, over a warm cache on both ranks
        info = server.server_info()
        assert info["settings"]["tp_size"] == 2 and info["settings"]["nnodes"] == 2
        # Node 0's engine process started no rank of its own: rank 1 runs under node 1.
        assert children_of(info["engine_pid"]) == []
        assert other.proc.poll() is None
        assert "serving" not in other.output()
        code = server.stop()
        assert code == 0
        assert other.proc.wait(30) == 0, other.output()[-3000:]
    finally:
        if server is not None:
            server.stop()
        other.stop()
    assert "ranks 1-1 of 2" in other.output() and "its ranks ended with the engine" in other.output()


def test_a_rank_killed_on_the_other_node_ends_the_server(gqa2, tmp_path):
    path, prompts, expected = gqa2
    port = free_port()
    server = ServerProcess(_node_args(path, port, 0), tmp_path)  # node 0 first this time
    other = OtherNode(_node_args(path, port, 1), tmp_path)
    try:
        server.wait_ready()
        assert _generate(server.base_url, prompts[:2]) == expected[:2]
        (rank,) = children_of(other.proc.pid)
        os.kill(rank, signal.SIGKILL)
        code = server.proc.wait(30)
        assert code == 1
        assert other.proc.wait(30) == 1
    finally:
        server.stop()
        other.stop()
    output = server.output_path.read_text()
    assert "tensor-parallel rank 1, on another node, closed its connection" in output, output[-3000:]
    assert "tensor-parallel rank 1 (pid" in other.output() and "killed by signal 9" in other.output()


def test_multi_node_settings_are_checked_by_name():
    from radixserve.settings import ServerSettings

    assert parse_settings(["--tp", "4", "--nnodes", "2", "--node-rank", "1",
                           "--dist-init-addr", "10.0.0.1:29500"]).tp_ranks_per_node == 2
    for kwargs, message in (
            (dict(tp_size=2, nnodes=2), "needs dist_init_addr"),
            (dict(tp_size=3, nnodes=2, dist_init_addr="h:1"), "does not split evenly"),
            (dict(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1"), "node_rank must be in 0..1"),
            (dict(tp_size=2, nnodes=2, dist_init_addr="h"), "HOST:PORT"),
            (dict(tp_size=2, nnodes=2, dist_init_addr="h:1", dp_size=2), "dp_size > 1 with nnodes"),
            (dict(tp_size=2, nnodes=2, dist_init_addr="h:1", tp_all_reduce="symm-mem"), "within one machine"),
            (dict(node_rank=1), "node_rank must be in 0..0")):
        with pytest.raises(ValueError, match=message):
            ServerSettings(**kwargs)
    with pytest.raises(SystemExit):  # the command line says the same and exits 2
        parse_settings(["--tp", "2", "--nnodes", "2"])
