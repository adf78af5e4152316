"""Activations to e4m3 with one scale per token, in one kernel: the quantization in front of the FP8
tensor-core GEMM (radixserve.model.layers.fp8) for the projections whose input is not an RMSNorm's
(o_proj, down_proj; and every projection with a static input scale). The inputs of q|k|v and
gate|up come out of the RMSNorm already quantized (radixserve.kernels.norm, `rms_norm_fp8`), which
stores its rows through `store_row_quantized` below, so both round alike.

In torch ops the same thing is nine launches, six of them full passes over the activations (abs,
amax, a float32 copy, divide, clamp, cast; the float32 copies twice the size of the input); here
one program per row reads it once (rows of up to 4,096 values stay in registers; longer ones are
read twice, the second time mostly from L2) and writes the e4m3 row once. Bit for bit what
`radixserve.model.layers.fp8.quantize_activations` computes: the scale is max |x| times the
float32 reciprocal of 448 (at least MIN_SCALE), each value x / scale rounded to nearest even and
saturated at +-448. That division is IEEE (`div_rn`), as torch's division of two tensors is;
Triton's `/` on float32 is an approximate one.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from radixserve.kernels.launch import FastKernel

# As radixserve.model.layers.fp8's FP8_MAX and MIN_SCALE (kernels import nothing from the model layer).
FP8_MAX = tl.constexpr(448.0)
MIN_SCALE = tl.constexpr(1e-12)
_INV_FP8_MAX = tl.constexpr(1.0 / 448.0)  # rounded to float32 in the kernel, as torch rounds the scalar
_BLOCK = 4096  # columns a program holds at once (8 warps: 16 values a thread); longer rows loop twice


@triton.jit
def _store_quantized(q_ptrs, x, scales, mask):
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scales), -FP8_MAX), FP8_MAX)
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def store_row_quantized(q_ptrs, x, mask):
    """Store a float32 row held whole in registers (masked-off values 0) as e4m3 with its per-token
    scale (max |x| / 448, at least MIN_SCALE); returns that scale for the caller to store."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) * _INV_FP8_MAX, MIN_SCALE)
    _store_quantized(q_ptrs, x, tl.zeros_like(x) + scale, mask)  # div_rn takes operands of one shape
    return scale


@triton.jit(do_not_specialize=["M"])
def _quantize_rows_kernel(X, Q, Scale, M, K, stride_xm, stride_qm, STATIC: tl.constexpr, ONE_BLOCK: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x_row = X + row.to(tl.int64) * stride_xm
    q_row = Q + row.to(tl.int64) * stride_qm
    if ONE_BLOCK:  # the row in registers: read once
        x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        if STATIC:
            _store_quantized(q_row + cols, x, tl.zeros((BLOCK,), dtype=tl.float32) + tl.load(Scale), cols < K)
        else:
            tl.store(Scale + row, store_row_quantized(q_row + cols, x, cols < K))
    else:
        if STATIC:
            scale = tl.load(Scale)
        else:
            amax = tl.zeros((BLOCK,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.maximum(tl.max(amax, axis=0) * _INV_FP8_MAX, MIN_SCALE)
            tl.store(Scale + row, scale)
        scales = tl.zeros((BLOCK,), dtype=tl.float32) + scale  # div_rn takes operands of one shape
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            _store_quantized(q_row + k0 + cols, x, scales, k0 + cols < K)


_quantize_rows = FastKernel(_quantize_rows_kernel)


def quantize_rows_fp8(x: torch.Tensor, input_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], float32 scales [M, 1]) of x [M, K] (bf16/fp16/fp32, unit column stride): per
    token (max |x| of the row / 448), or with the static per-tensor `input_scale` (float32 [1])."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows_fp8: x {tuple(x.shape)} with strides {x.stride()}: expected [M, K] with "
                         "contiguous rows")
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    if input_scale is not None:
        if input_scale.numel() != 1 or input_scale.dtype != torch.float32:
            raise ValueError("quantize_rows_fp8: a static input scale is one float32 value")
        scale = input_scale.reshape(1)
    else:
        scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m > 0:
        block = min(_BLOCK, triton.next_power_of_2(max(k, 16)))
        _quantize_rows[(m,)](x, q, scale, m, k, x.stride(0), q.stride(0), STATIC=input_scale is not None,
                             ONE_BLOCK=k <= block, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return q, (scale.expand(m, 1) if input_scale is not None else scale[:, None])
