"""FP8 weights with tensor parallelism on 2 GPUs over NCCL. Skipped with fewer than 2 GPUs.

Each rank's per-token activation scales cover only its slice of o_proj's and down_proj's inputs,
so those round a little differently from tp 1: the reference (test_fp8_gpu.hf_fp8_reference with
2 slices) rounds them the way the ranks see them, and the engine's greedy tokens and their log
probabilities are checked against it teacher-forced, as in test_fp8_gpu (greedy agreement between
different roundings measures where the random model's first near-tie falls, not closeness).
float32 activations take the reference FP8 GEMM at every position: the reference rounds every
position, and what is left is float32 order flipping an e4m3 rounding now and then (measured with
the CPU engine: at tp 1 |delta| up to 0.074, mean under 2e-3; at tp 2 against this reference none,
against the unsliced one a mean of 0.036, which F32_MEAN_TOL rejects); quantizing the plain
checkpoint at load gives the same tokens as its per-channel FP8 twin. bf16 (the FP8 decode-row
GEMM and cuBLASLt's FP8 GEMM on each rank's shard): graphs on and off give the same tokens, and
the reference follows within bf16's tolerance, rounding the prefill's positions, and every
position of o_proj (32 input columns per rank, which the decode-row GEMM cannot tile, so decode
steps take cuBLASLt's FP8 GEMM there too).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)
pytest.importorskip("triton")

from test_fp8_gpu import (BF16_MAX_TOL, BF16_MEAN_TOL, MAX_NEW, check_teacher_forced,  # noqa: E402
                          hf_fp8_reference, prompts)

from radixserve import Engine  # noqa: E402
from radixserve.testing.fp8_checkpoint import write_fp8_checkpoint  # noqa: E402
from radixserve.testing.tiny_model import build_tiny_model  # noqa: E402

GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "return_logprob": True}
# float32 against the reference, in nats: the largest |delta| (and best minus ours), and the means.
F32_MAX_TOL, F32_MEAN_TOL = 0.3, 0.02


@pytest.fixture(scope="module")
def fp8_tp_ckpt(tmp_path_factory):
    """(the plain tiny model, its per-channel FP8 twin)."""
    src = build_tiny_model(tmp_path_factory.mktemp("tiny-fp8-tp-src"), num_heads=4, num_kv_heads=2)
    return src, write_fp8_checkpoint(src, tmp_path_factory.mktemp("fp8-tp") / "tiny-ct", fmt="compressed-tensors",
                                     per_channel=True)


def greedy(path, dtype: str, batch: list[list[int]], tp_size: int = 2, **settings
           ) -> tuple[list[list[int]], list[list[float]], int]:
    """Greedy tokens, their log probabilities and the number of decode steps replayed from graphs."""
    with Engine(str(path), device="cuda", dtype=dtype, tp_size=tp_size, max_total_tokens=8192, cuda_graph_max_bs=16,
                **settings) as engine:
        res = engine.generate(input_ids=batch, sampling_params=GREEDY)
        engine.check_invariants()
        logprobs = [[lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]] for r in res]
        return [r["output_ids"] for r in res], logprobs, engine.core.runner.num_graph_steps


@pytest.mark.parametrize("graphs", [True, False])
def test_fp8_tp2_fp32_follows_the_per_rank_reference(fp8_tp_ckpt, graphs):
    source, ckpt = fp8_tp_ckpt
    batch = prompts(4, 500, seed=21)
    ours, logprobs, graph_steps = greedy(ckpt.path, "float32", batch, disable_cuda_graph=not graphs)
    assert (graph_steps > 0) == graphs
    check_teacher_forced(hf_fp8_reference(ckpt.dequantized, slices=2), batch, ours, logprobs,
                         max_tol=F32_MAX_TOL, mean_tol=F32_MEAN_TOL)
    if graphs:  # the same e4m3 weights and scales, so the same tokens
        at_load, _, _ = greedy(source, "float32", batch, quantization="fp8")
        assert at_load == ours


def test_fp8_tp2_bf16_graphs_on_off_and_close_to_the_per_rank_reference(fp8_tp_ckpt):
    path = fp8_tp_ckpt[1].path
    batch = prompts(6, 500, seed=22)
    on, logprobs, graph_steps = greedy(path, "bfloat16", batch)
    off, _, _ = greedy(path, "bfloat16", batch, disable_cuda_graph=True)
    assert graph_steps > 0 and on == off
    check_teacher_forced(hf_fp8_reference(fp8_tp_ckpt[1].dequantized, slices=2), batch, on, logprobs,
                         max_tol=BF16_MAX_TOL, mean_tol=BF16_MEAN_TOL)
