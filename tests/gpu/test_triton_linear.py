"""The weight-streaming decode GEMM (radixserve.kernels.linear) against torch on random inputs.

Runs on a CUDA GPU; skipped elsewhere (TRITON_INTERPRET=1 runs it on the CPU in fp16/fp32).
"""

from __future__ import annotations

import pytest
import torch

from triton_device import DEVICE  # skips this module without a GPU or the Triton interpreter

pytestmark = pytest.mark.gpu

from radixserve.kernels.linear import SkinnyConfig, SkinnyWorkspace, skinny_linear  # noqa: E402

LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("m,n,k", [(1, 4608, 3584), (16, 896, 4864), (5, 1000, 320), (64, 300, 1152), (33, 48, 128)])
@pytest.mark.parametrize("split_k", [1, 3, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_torch(m, n, k, split_k, bias):
    if DEVICE == "cpu" and n * k > 1 << 20:
        pytest.skip("too slow under the interpreter")
    torch.manual_seed(m * 7 + n + split_k)
    x = torch.randn(m, k, device=DEVICE).to(LOW)
    w = (torch.randn(n, k, device=DEVICE) * k ** -0.5).to(LOW)
    b = torch.randn(n, device=DEVICE).to(LOW) if bias else None
    ws = SkinnyWorkspace(DEVICE, partial_numel=8 * 64 * 4608, counters=4096)
    block_m = 16 if m <= 16 else 64
    cfg = SkinnyConfig(block_m, 32, 128, split_k)
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=LOW)
    skinny_linear(x, w, b, cfg, ws, out=out)
    ref = x.float() @ w.float().T + (b.float() if bias else 0)
    assert not torch.isnan(out).any(), "every output written"
    assert rel_err(out, ref) < 1e-2
    assert int(ws.counter.count_nonzero()) == 0, "the arrival counters reset themselves"
    again = skinny_linear(x, w, b, cfg, ws)
    assert torch.equal(again, out), "fixed summation order: the same bits every time"


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_skinny_linear_replays_in_a_graph():
    torch.manual_seed(0)
    m, n, k = 16, 3584, 18944
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    ws = SkinnyWorkspace("cuda")
    cfg = SkinnyConfig(16, 32, 128, 8)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    skinny_linear(x, w, None, cfg, ws, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_linear(x, w, None, cfg, ws, out=out)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, x.float() @ w.float().T) < 1e-2
    assert int(ws.counter.count_nonzero()) == 0
