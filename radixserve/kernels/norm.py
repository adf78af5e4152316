"""RMSNorm, alone or fused with the residual add, one program per row.

Numerics follow Hugging Face's Qwen2RMSNorm: the row is normalised in float32, cast back to the
input dtype, then multiplied by the weight (in the weight's dtype). The fused add rounds
x + residual to the input dtype first (as the unfused `x + residual` does) and normalises that.

`rms_norm_fp8` is the same norm, alone or with the add, writing what the FP8 projection after it
multiplies instead of the row: e4m3 values and one float32 scale per row, bit for bit
`quantize_rows_fp8(rms_norm(...))` (the row is rounded to the input dtype first, as the stored one
is, then quantized by radixserve.kernels.quant_fp8's own helper). Saves that projection's
quantization launch, and the write and read of the row in the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels.launch import FastKernel
from radixserve.kernels.quant_fp8 import store_row_quantized


@triton.jit
def _rms_norm_kernel(X, R, W, Y, R_out, Scale, stride_x, stride_r, stride_y, stride_ro, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, FP8_OUT: tl.constexpr, BLOCK: tl.constexpr):
    """Y = the normed row (FP8_OUT: the row rounded to X's dtype, then quantized into e4m3 Y with
    its scale in Scale[row])."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(R_out + row * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, 0) / n_cols + eps)
    normed = (h * inv).to(X.dtype.element_ty)
    w = tl.load(W + offs, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    if FP8_OUT:
        y = y.to(X.dtype.element_ty).to(tl.float32)  # what the plain norm stores, then quantizes
        tl.store(Scale + row, store_row_quantized(Y + row * stride_y + offs, y, mask))
    else:
        tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=mask)


_rms_norm = FastKernel(_rms_norm_kernel)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out: torch.Tensor, residual_out: torch.Tensor | None, scale: torch.Tensor | None = None) -> None:
    n_rows, n_cols = x.shape
    if n_rows == 0:
        return
    block = triton.next_power_of_2(n_cols)
    num_warps = min(16, max(1, block // 512))
    has_res = residual is not None
    r = residual if has_res else x
    ro = residual_out if has_res else x
    fp8_out = scale is not None
    _rms_norm[(n_rows,)](x, r, weight, out, ro, scale if fp8_out else weight, x.stride(0), r.stride(0),
                         out.stride(0), ro.stride(0), n_cols, eps, HAS_RESIDUAL=has_res, FP8_OUT=fp8_out,
                         BLOCK=block, num_warps=num_warps)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dimension; returns a new tensor of x's shape and dtype."""
    x2 = _as_rows(x)
    y = torch.empty_like(x2) if out is None else out.view(x2.shape)
    _launch(x2, None, weight, eps, y, None)
    return y.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual). `residual` is overwritten with x + residual
    (it must be contiguous); the first result is a new tensor."""
    assert residual.is_contiguous(), "residual is updated in place and must be contiguous"
    x2 = _as_rows(x)
    r2 = residual.view(-1, residual.shape[-1])
    y = torch.empty_like(x2)
    _launch(x2, r2, weight, eps, y, r2)
    return y.view(x.shape), residual


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], float32 scales [M, 1]) of rms_norm(x) over x's rows ([..., K] as M rows), or of
    add_rms_norm(x, residual)'s first result, whose second overwrites `residual` as there.
    Bit for bit quantize_rows_fp8 of those (per token: max |row| / 448)."""
    x2 = _as_rows(x)
    r2 = None
    if residual is not None:
        assert residual.is_contiguous(), "residual is updated in place and must be contiguous"
        r2 = residual.view(-1, residual.shape[-1])
    q = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    _launch(x2, r2, weight, eps, q, r2, scale)
    return q, scale[:, None]
