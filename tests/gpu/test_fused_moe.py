"""The fused MoE kernels (radixserve.kernels.fused_moe) against the torch reference at small shapes:
the router's top-k, the alignment (sorted by expert, padded to BLOCK_M), the grouped GEMMs with
SiLU-and-mul and routing weights fused, FP8 experts per channel and per block.

Runs on a CUDA GPU; skipped elsewhere (TRITON_INTERPRET=1 runs it on the CPU in fp16/fp32). The
model's shapes (Qwen3-30B-A3B, Qwen2-57B-A14B) and timings: tests/gpu/test_fused_moe_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from triton_device import DEVICE  # skips this module without a GPU or the Triton interpreter

pytestmark = pytest.mark.gpu

from radixserve.kernels.fused_moe import fused_moe, moe_align, topk_softmax  # noqa: E402
from radixserve.kernels.fused_moe_config import FusedMoeConfig, default_config, max_padded_rows  # noqa: E402
from radixserve.model.layers.fp8 import FP8_DTYPE, quantize_rows  # noqa: E402
from radixserve.model.layers.fp8_block import dequantize_blocks, quantize_blocks  # noqa: E402
from radixserve.model.layers.moe import experts_reference, route_reference  # noqa: E402

LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def routed(t: int, e: int, k: int, seed: int, dtype=torch.float32):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = torch.randn(t, e, device=DEVICE, generator=g).to(dtype)
    weights, ids = route_reference(logits, k, True)
    return weights, ids.to(torch.int32)


def reference(x, w13, w2, weights, ids):
    """transformers' expert loop in float64 (weights as given: dequantize FP8 first)."""
    def expert(e):
        return w13[e].double(), w2[e].double()
    return experts_reference(x.double(), weights.double(), ids.long(), w13.shape[0], expert)


@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (5, 16, 4), (33, 128, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax_matches_the_router_reference(t, e, k, renormalize):
    g = torch.Generator(device=DEVICE).manual_seed(t * e + k)
    logits = torch.randn(t, e, device=DEVICE, generator=g)
    ref_w, ref_ids = route_reference(logits, k, renormalize)
    weights, ids = topk_softmax(logits, k, renormalize)
    assert torch.equal(ids.long(), ref_ids)
    assert torch.allclose(weights, ref_w, rtol=1e-5, atol=1e-6)
    low_w, low_ids = topk_softmax(logits.to(LOW), k, renormalize)  # the model dtype in, the same dtype out
    assert low_w.dtype == LOW and low_ids.dtype == torch.int32


@pytest.mark.parametrize("t,e,k,block_m", [(1, 8, 2, 16), (7, 4, 2, 16), (40, 16, 4, 32), (0, 8, 2, 16)])
def test_align_sorts_pairs_by_expert_padded_to_the_block(t, e, k, block_m):
    _, ids = routed(t, e, k, seed=t + e)
    sorted_ids, expert_ids, total = moe_align(ids, e, block_m)
    slots = t * k
    assert sorted_ids.numel() >= max_padded_rows(slots, e, block_m)
    counts = torch.bincount(ids.flatten().long().cpu(), minlength=e)
    padded = (counts + block_m - 1) // block_m * block_m
    assert int(total.item()) == int(padded.sum())
    s, ex = sorted_ids.cpu(), expert_ids.cpu()
    flat = ids.flatten().cpu()
    start = 0
    for expert in range(e):
        run = s[start:start + int(padded[expert])]
        real = run[run < slots]
        assert sorted(real.tolist()) == sorted(torch.nonzero(flat == expert).flatten().tolist())
        assert (run[len(real):] == slots).all()  # the padding's sentinel, after the real pairs
        blocks = ex[start // block_m:(start + int(padded[expert])) // block_m]
        assert (blocks == expert).all()
        start += int(padded[expert])
    assert (s[start:] == slots).all()


@pytest.mark.parametrize("t,e,k,h,inter", [(1, 8, 2, 64, 32), (9, 8, 2, 64, 48), (50, 16, 4, 128, 64)])
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("dtype", [LOW, torch.float32])
def test_fused_moe_matches_the_expert_loop(t, e, k, h, inter, block_m, dtype):
    """float32 multiplies in IEEE float32 (not TF32): within float32 rounding of the loop."""
    g = torch.Generator(device=DEVICE).manual_seed(t + e + h + block_m)
    x = torch.randn(t, h, device=DEVICE, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, device=DEVICE, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(e, h, inter, device=DEVICE, generator=g) * 0.1).to(dtype)
    weights, ids = routed(t, e, k, seed=t * 3 + e)
    c13 = FusedMoeConfig(block_m, 32, 32)
    c2 = FusedMoeConfig(block_m, 32, 16)  # K = inter: several K tiles, 48 leaves a partial one
    out = fused_moe(x, w13, w2, weights.to(dtype), ids, c13, c2)
    ref = reference(x, w13, w2, weights.to(dtype), ids)
    assert out.shape == (t, h) and out.dtype == dtype and not torch.isnan(out).any()
    assert rel_err(out, ref) < (2e-2 if dtype != torch.float32 else 1e-5)


def test_default_configs_run():
    t, e, k, h, inter = 3, 8, 2, 64, 32
    g = torch.Generator(device=DEVICE).manual_seed(11)
    x = torch.randn(t, h, device=DEVICE, generator=g).to(LOW)
    w13 = (torch.randn(e, 2 * inter, h, device=DEVICE, generator=g) * 0.1).to(LOW)
    w2 = (torch.randn(e, h, inter, device=DEVICE, generator=g) * 0.1).to(LOW)
    weights, ids = routed(t, e, k, seed=12)
    c13, c2 = default_config(e, 2 * inter, h, t, k), default_config(e, h, inter, t, k)
    out = fused_moe(x, w13, w2, weights.to(LOW), ids, c13, c2)
    assert rel_err(out, reference(x, w13, w2, weights.to(LOW), ids)) < 2e-2


@pytest.mark.parametrize("layout", ["channel", "block"])
def test_fp8_experts_match_their_dequantized_reference(layout):
    t, e, k, h, inter = 12, 8, 2, 64, 32
    block = (16, 32)
    g = torch.Generator(device=DEVICE).manual_seed(21)
    x = torch.randn(t, h, device=DEVICE, generator=g).to(LOW)
    q13, q2, d13, d2, s13, s2 = [], [], [], [], [], []
    for _ in range(e):
        w13 = torch.randn(2 * inter, h, device=DEVICE, generator=g) * 0.1
        w2 = torch.randn(h, inter, device=DEVICE, generator=g) * 0.1
        for w, qs, ds, ss in ((w13, q13, d13, s13), (w2, q2, d2, s2)):
            if layout == "block":
                wq, scale = quantize_blocks(w, block)
                deq = dequantize_blocks(wq, scale, block)
            else:
                wq, scale = quantize_rows(w)
                deq = wq.float() * scale[:, None]
            qs.append(wq)
            ds.append(deq)
            ss.append(scale)
    q13, q2 = torch.stack(q13), torch.stack(q2)
    assert q13.dtype == FP8_DTYPE
    weights, ids = routed(t, e, k, seed=22)
    c13, c2 = FusedMoeConfig(16, 32, 32), FusedMoeConfig(16, 32, 32)
    extra = dict(scale_block=block) if layout == "block" else {}
    out = fused_moe(x, q13, q2, weights.to(LOW), ids, c13, c2, w13_scale=torch.stack(s13),
                    w2_scale=torch.stack(s2), **extra)
    ref = reference(x, torch.stack(d13), torch.stack(d2), weights.to(LOW), ids)
    assert rel_err(out, ref) < 2e-2


def test_rejects_what_it_cannot_run():
    x = torch.zeros(2, 64, dtype=LOW, device=DEVICE)
    w13 = torch.zeros(4, 64, 64, dtype=LOW, device=DEVICE)
    w2 = torch.zeros(4, 64, 32, dtype=LOW, device=DEVICE)
    weights, ids = routed(2, 4, 2, seed=1)
    with pytest.raises(ValueError, match="block_m"):
        fused_moe(x, w13, w2, weights.to(LOW), ids, FusedMoeConfig(16), FusedMoeConfig(32))
    with pytest.raises(ValueError, match="weight_scale"):
        fused_moe(x, w13.to(FP8_DTYPE), w2, weights.to(LOW), ids, FusedMoeConfig(16), FusedMoeConfig(16))
    with pytest.raises(ValueError, match="top_k"):
        topk_softmax(torch.zeros(2, 4, device=DEVICE), 5, True)


@pytest.mark.parametrize("t,k,h", [(1, 8, 2048), (5, 2, 64), (0, 2, 64)])
def test_topk_sum_adds_each_tokens_rows(t, k, h):
    from radixserve.kernels.fused_moe import topk_sum

    rows = torch.randn(t * k, h, device=DEVICE).to(LOW)
    out = topk_sum(rows, t, k)
    assert out.shape == (t, h) and out.dtype == LOW
    assert rel_err(out, rows.double().view(t, k, h).sum(dim=1)) < 1e-2 or t == 0
