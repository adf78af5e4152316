"""Tensor parallelism across "nodes" over NCCL, on one host with 2 GPUs: node 0 is an offline
Engine on GPU 0 (rank 0), node 1 a `launch_server --node-rank 1` process that sees GPU 1 only
(rank 1), NCCL's peer-to-peer and shared-memory transports off so that the two talk as two
machines would (sockets). Greedy fp32 tokens equal transformers' with CUDA graphs on and off
(the collectives inside the graphs cross the "nodes"). Skipped with fewer than 2 GPUs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)
pytest.importorskip("triton")

from test_engine_gpu import MAX_NEW, hf_greedy, prompts  # noqa: E402

from radixserve import Engine  # noqa: E402
from radixserve.testing.tiny_model import build_tiny_model  # noqa: E402

GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
REPO_ROOT = Path(__file__).resolve().parents[2]
AS_TWO_MACHINES = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-nodes-gpu"), num_heads=4, num_kv_heads=2))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("graphs", [True, False])
def test_two_nodes_over_nccl_give_hf_tokens(tiny_dir, graphs, tmp_path, monkeypatch):
    for k, v in AS_TWO_MACHINES.items():
        monkeypatch.setenv(k, v)
    port = _free_port()
    node = ["--tp", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    out = open(tmp_path / "node1.out", "wb")
    other = subprocess.Popen([sys.executable, "-m", "radixserve.launch_server", "--model-path", tiny_dir,
                              "--device", "cuda", "--dtype", "float32", *node, "--node-rank", "1"],
                             cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    batch = prompts(5, 500, seed=3)
    try:
        with Engine(tiny_dir, device="cuda", dtype="float32", tp_size=2, nnodes=2, node_rank=0,
                    dist_init_addr=f"127.0.0.1:{port}", max_total_tokens=8192, cuda_graph_max_bs=16,
                    disable_cuda_graph=not graphs) as engine:
            ours = [r["output_ids"] for r in engine.generate(input_ids=batch, sampling_params=GREEDY)]
            assert (engine.core.runner.num_graph_steps > 0) == graphs
        assert other.wait(60) == 0, (tmp_path / "node1.out").read_text()[-3000:]
    finally:
        if other.poll() is None:
            other.send_signal(signal.SIGTERM)
            other.wait(30)
        out.close()
    assert ours == hf_greedy(tiny_dir, torch.float32, batch)
