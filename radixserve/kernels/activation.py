"""SiLU(gate) * up over the fused gate|up projection output, in one pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels.launch import FastKernel


@triton.jit
def _silu_and_mul_kernel(X, Y, stride_x, stride_y, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1) * BLOCK
    offs = col0 + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=mask)


_silu_and_mul = FastKernel(_silu_and_mul_kernel)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [..., 2I] (gate first, then up) -> silu(gate) * up [..., I], computed in float32."""
    n2 = gate_up.shape[-1]
    assert n2 % 2 == 0, "the last dimension must hold gate and up halves"
    n = n2 // 2
    x = gate_up.reshape(-1, n2)
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((x.shape[0], n), dtype=gate_up.dtype, device=gate_up.device) if out is None else out.view(-1, n)
    if x.shape[0]:
        block = min(4096, triton.next_power_of_2(n))
        _silu_and_mul[(x.shape[0], triton.cdiv(n, block))](x, y, x.stride(0), y.stride(0), n, BLOCK=block,
                                                           num_warps=4 if block <= 1024 else 8)
    return y.view(*gate_up.shape[:-1], n)
