"""The fused MoE (radixserve.kernels.fused_moe) at the shapes of Qwen3-30B-A3B (128 experts, top-8,
hidden 2048, moe_intermediate 768) and Qwen2-57B-A14B (64 experts, top-8, hidden 3584, 2560) on
CUDA: against the expert loop in float32, bf16 and FP8 (per channel, and 128 x 128 blocks),
inside a CUDA graph, and timed against a dense GEMM of the same total size (printed, not
asserted: run with -s to see them).

Skipped without CUDA (the kernels' small-shape tests, which the interpreter runs too, are
tests/gpu/test_fused_moe.py).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
triton = pytest.importorskip("triton")

pytestmark = pytest.mark.gpu

from radixserve.distributed import SingleRank  # noqa: E402
from radixserve.kernels.fused_moe import fused_moe, moe_align, moe_gemm, topk_softmax  # noqa: E402
from radixserve.kernels.fused_moe_config import config_for  # noqa: E402
from radixserve.model.layers import KernelChoice  # noqa: E402
from radixserve.model.layers.fp8 import quantize_rows  # noqa: E402
from radixserve.model.layers.fp8_block import dequantize_blocks, quantize_blocks  # noqa: E402
from radixserve.model.layers.moe import SparseMoeBlock, experts_reference, route_reference  # noqa: E402

DEVICE = "cuda"
# name: (experts, top_k, hidden, moe_intermediate)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "qwen2-57b-a14b": (64, 8, 3584, 2560)}
TOKENS = [1, 16, 64, 256, 2048]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def experts(e: int, h: int, inter: int, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w13 = (torch.randn(e, 2 * inter, h, device=DEVICE, generator=g) * h ** -0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, device=DEVICE, generator=g) * inter ** -0.5).bfloat16()
    return w13, w2


def routing(t: int, e: int, k: int, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    weights, ids = route_reference(torch.randn(t, e, device=DEVICE, generator=g), k, True)
    return weights.bfloat16(), ids.int()


def reference(x, w13, w2, weights, ids):
    def weights_of(e):
        return w13[e].float(), w2[e].float()
    return experts_reference(x.float(), weights.float(), ids.long(), w13.shape[0], weights_of)


def configs(e, h, inter, t, k, wbytes=2):
    c13 = config_for(e, 2 * inter, h, t, k, wbytes)
    return c13, config_for(e, h, inter, t, k, wbytes)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("t", TOKENS)
def test_matches_the_expert_loop_at_model_shapes(name, t):
    e, k, h, inter = SHAPES[name]
    w13, w2 = experts(e, h, inter, seed=t)
    x = torch.randn(t, h, device=DEVICE).bfloat16()
    weights, ids = routing(t, e, k, seed=t + 1)
    c13, c2 = configs(e, h, inter, t, k)
    if c2.block_m != c13.block_m:
        from dataclasses import replace
        c2 = replace(c2, block_m=c13.block_m)
    out = fused_moe(x, w13, w2, weights, ids, c13, c2)
    ref = reference(x, w13, w2, weights, ids)
    err = rel_err(out, ref)
    print(f"\n{name} T={t}: rel err {err:.2e}, max abs {(out.float() - ref).abs().max().item():.2e} "
          f"(|ref| max {ref.abs().max().item():.2f}); tiles {c13} / {c2}")
    assert err < 1e-2


@pytest.mark.parametrize("layout", ["channel", "block"])
@pytest.mark.parametrize("t", [1, 64, 1024])
def test_fp8_experts_match_their_dequantized_reference(layout, t):
    e, k, h, inter = SHAPES["qwen3-30b-a3b"]
    w13, w2 = experts(e, h, inter, seed=7)
    q, deq, scales = [], [], []
    for w in (w13, w2):
        qs, ds, ss = [], [], []
        for i in range(e):
            if layout == "block":
                wq, s = quantize_blocks(w[i].float(), (128, 128))
                ds.append(dequantize_blocks(wq, s, (128, 128)))
            else:
                wq, s = quantize_rows(w[i].float())
                ds.append(wq.float() * s[:, None])
            qs.append(wq)
            ss.append(s)
        q.append(torch.stack(qs))
        deq.append(torch.stack(ds))
        scales.append(torch.stack(ss))
    x = torch.randn(t, h, device=DEVICE).bfloat16()
    weights, ids = routing(t, e, k, seed=8)
    c13, c2 = configs(e, h, inter, t, k, wbytes=1)
    from dataclasses import replace
    c2 = replace(c2, block_m=c13.block_m)
    extra = dict(scale_block=(128, 128)) if layout == "block" else {}
    out = fused_moe(x, q[0], q[1], weights, ids, c13, c2, w13_scale=scales[0], w2_scale=scales[1], **extra)
    ref = reference(x, deq[0], deq[1], weights, ids)
    err = rel_err(out, ref)
    print(f"\nFP8 {layout} T={t}: rel err {err:.2e}, max abs {(out.float() - ref).abs().max().item():.2e}")
    assert err < 1e-2


@pytest.mark.parametrize("e,k", [(128, 8), (64, 8)])
def test_topk_softmax_at_model_shapes(e, k):
    """bf16 logits tie often (8 mantissa bits): any order of equal probabilities is a right top-k,
    so the check is that the picked experts' probabilities are the k largest."""
    logits = torch.randn(4096, e, device=DEVICE).bfloat16()
    ref_w, _ = route_reference(logits, k, False)
    weights, ids = topk_softmax(logits, k, False)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    picked = probs.gather(1, ids.long())
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all()  # k distinct experts
    assert torch.allclose(picked.sort(dim=1, descending=True).values, ref_w.float(), rtol=1e-2, atol=1e-3)
    assert torch.allclose(weights.float(), picked, rtol=1e-2, atol=1e-3)
    renorm, _ = topk_softmax(logits, k, True)
    assert torch.allclose(renorm.float().sum(dim=1), torch.ones(4096, device=DEVICE), atol=2e-2)


def test_the_moe_block_replays_in_a_cuda_graph():
    e, k, h, inter = SHAPES["qwen3-30b-a3b"]
    kernels = KernelChoice.for_device(DEVICE, torch.bfloat16)
    assert kernels.triton
    block = SparseMoeBlock(h, num_experts=e, top_k=k, moe_intermediate_size=inter, norm_topk_prob=True,
                           dtype=torch.bfloat16, kernels=kernels, tp=SingleRank(DEVICE)).to(DEVICE)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
        x = torch.randn(16, h, device=DEVICE).bfloat16()
        eager = block.forward(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            block.forward(x)  # warm-up (compiles) outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = block.forward(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, block.forward(x))


def _time_us(fn, reps: int = 50) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=reps) * 1e3


@pytest.mark.parametrize("name", list(SHAPES))
def test_grouped_gemm_against_a_dense_gemm_of_the_same_size(name):
    """Printed: per T, the gate|up grouped GEMM (with SiLU) and the down GEMM against one dense
    GEMM of the same total size ([T x top_k, H] x [H, 2I] and [T x top_k, I] x [I, H]), and the
    whole fused MoE's bandwidth over the bytes of the experts the step touches."""
    e, k, h, inter = SHAPES[name]
    w13, w2 = experts(e, h, inter, seed=3)
    dense13 = w13[0].clone()
    dense2 = w2[0].clone()
    print(f"\n{name}: T | gate_up grouped / dense us | down grouped / dense us | fused MoE us, touched experts, GB/s")
    for t in TOKENS:
        x = torch.randn(t, h, device=DEVICE).bfloat16()
        weights, ids = routing(t, e, k, seed=t)
        c13, c2 = configs(e, h, inter, t, k)
        from dataclasses import replace
        c2 = replace(c2, block_m=c13.block_m)
        sorted_ids, expert_ids, total = moe_align(ids, e, c13.block_m)
        inter_buf = torch.empty(t * k, inter, device=DEVICE, dtype=torch.bfloat16)
        down = torch.empty(t * k, h, device=DEVICE, dtype=torch.bfloat16)
        g13 = _time_us(lambda: moe_gemm(x, w13, inter_buf, sorted_ids, expert_ids, total, c13, rows_per_a=k,
                                        gated=True))
        g2 = _time_us(lambda: moe_gemm(inter_buf, w2, down, sorted_ids, expert_ids, total, c2, rows_per_a=1,
                                       gated=False, routed_weights=weights.reshape(-1)))
        rows = torch.randn(t * k, h, device=DEVICE).bfloat16()
        d13 = _time_us(lambda: rows @ dense13.T)
        d2 = _time_us(lambda: inter_buf @ dense2.T)
        whole = _time_us(lambda: fused_moe(x, w13, w2, weights, ids, c13, c2))
        touched = int(torch.unique(ids).numel())
        gbs = touched * 3 * inter * h * 2 / (whole * 1e-6) / 1e9
        print(f"{name}: {t:5d} | {g13:7.1f} / {d13:7.1f} | {g2:7.1f} / {d2:7.1f} | {whole:7.1f}, {touched:3d}, "
              f"{gbs:6.0f}")
