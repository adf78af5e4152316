"""Tensor parallelism on 2 GPUs over NCCL: greedy tokens with --tp-size 2 equal transformers' in fp32
with and without CUDA graphs (the all-reduces and the logits' all-gather captured inside them), with
NCCL's all-reduce and with the symmetric-memory one, and bf16 gives the same tokens with graphs on
and off; a step rank 0 cannot allocate for is given up on both ranks and the engine goes on.
Skipped with fewer than 2 GPUs.
"""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-tp-gpu"), num_heads=4, num_kv_heads=2))


def tp_greedy(path: str, dtype: str, batch: list[list[int]], **settings) -> tuple[list[list[int]], int]:
    with Engine(path, device="cuda", dtype=dtype, tp_size=2, max_total_tokens=8192, cuda_graph_max_bs=16,
                **settings) as engine:
        out = [r["output_ids"] for r in engine.generate(input_ids=batch, sampling_params=GREEDY)]
        engine.check_invariants()
        return out, engine.core.runner.num_graph_steps


@pytest.mark.parametrize("all_reduce", ["nccl", "symm-mem"])
@pytest.mark.parametrize("graphs", [True, False])
def test_tp2_fp32_greedy_equals_hf(tiny_dir, graphs, all_reduce):
    batch = prompts(5, 500, seed=3)
    ours, graph_steps = tp_greedy(tiny_dir, "float32", batch, disable_cuda_graph=not graphs,
                                  tp_all_reduce=all_reduce)
    assert (graph_steps > 0) == graphs
    assert ours == hf_greedy(tiny_dir, torch.float32, batch)


def test_tp2_bf16_graphs_on_off_same_tokens(tiny_dir):
    batch = prompts(4, 500, seed=7)
    on, graph_steps = tp_greedy(tiny_dir, "bfloat16", batch)
    off, _ = tp_greedy(tiny_dir, "bfloat16", batch, disable_cuda_graph=True)
    assert graph_steps > 0 and on == off


class FailOnce:
    """Raises OutOfMemoryError instead of calling `inner` the first `times` times `condition` holds."""

    def __init__(self, inner, condition, times: int):
        self.inner, self.condition, self.left = inner, condition, times

    def __call__(self, *args, **kwargs):
        if self.left > 0 and self.condition(args):
            self.left -= 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("all_reduce", ["nccl", "symm-mem"])
@pytest.mark.parametrize("site", ["mid-forward", "sampling"])
def test_tp2_a_step_rank0_cannot_allocate_is_given_up_on_both_ranks(tiny_dir, site, all_reduce):
    """NCCL: rank 1's kernels wait in the abandoned step's all-reduce (or ids broadcast); both
    ranks abort the communicator, join a new group, capture their graphs again, and the tokens
    equal an engine that never failed."""
    batch = prompts(6, 500, seed=5)
    settings = dict(device="cuda", dtype="float32", tp_size=2, max_total_tokens=8192, cuda_graph_max_bs=16,
                    tp_all_reduce=all_reduce, chunked_prefill_size=1024)
    params = {**GREEDY, "repetition_penalty": 1.1}  # the penalty pass runs on rank 0 before the ids broadcast
    with Engine(tiny_dir, **settings) as engine:
        expected = [r["output_ids"] for r in engine.generate(input_ids=batch, sampling_params=params)]
    with Engine(tiny_dir, **settings) as engine:
        if site == "mid-forward":
            mlp = engine.core.model.model.layers[-1].mlp
            mlp.forward = FailOnce(mlp.forward, lambda args: args[0].shape[0] > 256, 2)
        else:
            runner = engine.core.runner
            runner.process_logits = FailOnce(runner.process_logits, lambda args: args[0].shape[0] > 2, 2)
        got = [r["output_ids"] for r in engine.generate(input_ids=batch, sampling_params=params)]
        engine.check_invariants()
        assert engine.cache_stats()["alloc_failures"] == 2
        assert engine.core.ranks.tp.generation == 2
        assert got == expected
        assert engine.core.runner.num_graph_steps > 0  # the graphs captured again replay
