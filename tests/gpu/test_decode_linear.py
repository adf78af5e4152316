"""The decode-row GEMM (radixserve.kernels.decode_linear) against a float64 reference.

Runs on a CUDA GPU; skipped elsewhere (TRITON_INTERPRET=1 runs it on the CPU in fp16).
"""

from __future__ import annotations

import pytest
import torch

from triton_device import DEVICE  # skips this module without a GPU or the Triton interpreter

pytestmark = pytest.mark.gpu

from radixserve.kernels.decode_linear import decode_linear  # noqa: E402
from radixserve.kernels.decode_linear_config import DecodeLinearConfig, supported  # noqa: E402

LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("m", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("n,k", [(4608, 3584), (896, 4864), (200, 256)])
@pytest.mark.parametrize("split", [1, 3, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(m, n, k, split, bias):
    g = torch.Generator(device=DEVICE).manual_seed(m * 7919 + n + k + split)
    x = torch.randn(m, k, device=DEVICE, generator=g).to(LOW)
    w = (torch.randn(n, k, device=DEVICE, generator=g) * 0.02).to(LOW)
    b = torch.randn(n, device=DEVICE, generator=g).to(LOW) if bias else None
    cfg = DecodeLinearConfig(block_n=64, block_k=128, split=split)
    assert supported(w, cfg)
    out = torch.full((m, n), float("nan"), dtype=LOW, device=DEVICE)  # every element must be written
    partial = torch.full((split * m * n,), float("nan"), dtype=torch.float32, device=DEVICE)
    decode_linear(x, w, b, cfg, out=out, partial=partial)
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("inter,k", [(18944, 3584), (4864, 896), (100, 128)])
@pytest.mark.parametrize("split", [1, 4])
def test_silu_mul_matches_unfused(m, inter, k, split):
    """gate|up weight -> silu(gate) * up, against the GEMM rounded to the activation dtype and then
    silu * up in float64 (what the unfused path computes)."""
    g = torch.Generator(device=DEVICE).manual_seed(m + inter + k + split)
    x = torch.randn(m, k, device=DEVICE, generator=g).to(LOW)
    w = (torch.randn(2 * inter, k, device=DEVICE, generator=g) * 0.05).to(LOW)
    cfg = DecodeLinearConfig(block_n=64, block_k=128, split=split)
    out = torch.full((m, inter), float("nan"), dtype=LOW, device=DEVICE)
    decode_linear(x, w, None, cfg, out=out, silu_mul=True)
    gate_up = (x.double() @ w.double().T).to(LOW).double()
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    ref = gate * torch.sigmoid(gate) * up
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 1e-2


def test_deterministic_and_graph_replay():
    """Split sums in a fixed order: bit-identical across calls, and inside a CUDA graph."""
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs")
    x = torch.randn(16, 3584, device=DEVICE).to(LOW)
    w = (torch.randn(4608, 3584, device=DEVICE) * 0.02).to(LOW)
    cfg = DecodeLinearConfig(block_n=64, block_k=128, split=4)
    partial = torch.empty(4 * 16 * 4608, dtype=torch.float32, device=DEVICE)
    out = torch.empty(16, 4608, dtype=LOW, device=DEVICE)
    first = decode_linear(x, w, None, cfg, partial=partial).clone()
    decode_linear(x, w, None, cfg, out=out, partial=partial)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_linear(x, w, None, cfg, out=out, partial=partial)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, x.double() @ w.double().T) < 1e-2
    assert torch.equal(decode_linear(x, w, None, cfg, partial=partial), out)
    assert not torch.equal(first, out)


def test_rejects_what_it_cannot_tile():
    w = torch.zeros(64, 100, dtype=LOW, device=DEVICE)
    with pytest.raises(ValueError):
        decode_linear(torch.zeros(1, 100, dtype=LOW, device=DEVICE), w, None, DecodeLinearConfig())
    w = torch.zeros(65, 128, dtype=LOW, device=DEVICE)  # no gate|up halves
    with pytest.raises(ValueError):
        decode_linear(torch.zeros(1, 128, dtype=LOW, device=DEVICE), w, None, DecodeLinearConfig(), silu_mul=True)
