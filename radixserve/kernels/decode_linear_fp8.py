"""The decode-row GEMM over FP8 (e4m3) weights: y = x @ (W * scale)^T (+ bias) for a decode
step's few rows.

Same tiling, K split and SiLU-and-mul epilogue as the bf16 kernel (radixserve.kernels.decode_linear,
whose tile setup, tile loads, store and reduce kernel this one shares), with two
differences: each weight tile is loaded as e4m3 (one
byte per weight: half the bytes a decode step streams) and each output column's float32 scale
multiplies its accumulator before anything is stored, so split partials, the bias and the SiLU see
dequantized values.

What the tensor cores multiply, by `config.fp8_mode` (radixserve.kernels.decode_linear_config):
- "token_fp8" (the model's default): bf16 activations quantized to e4m3 first, one scale per
  token, then the FP8 x FP8 dot below (as with `x_scale`). The quantization is one launch of
  radixserve.kernels.quant_fp8 here (or with the checkpoint's static scale); the model hands
  q|k|v and gate|up their rows in e4m3 with scales already (the RMSNorm in front writes them,
  radixserve.kernels.norm.rms_norm_fp8, bit for bit the same). The numerics of the prefill
  path's `torch._scaled_mm`, so a token's logits do not depend on whether its rows ran as decode
  or as prefill, and an e4m3 x tile is half a bf16 one's bytes and instructions. On an H200 the
  fastest mode from 1 to 64 rows.
- "widen": the weight tile widened to the activation dtype in registers (exact: every e4m3 value is
  a bf16/fp16 value), activations as they are (at a handful of rows their bytes are nothing next
  to the weights', and they lose no precision).
- "fp16": weights widened to fp16 (one conversion instruction per two weights on sm89+, where
  e4m3 -> bf16 takes three) and bf16 activations rounded to fp16, saturating at +-65504. The same
  products as the default for activations of magnitude 2^-17 to 65504 (fp16 holds every bf16 value
  there); smaller ones lose low bits, larger ones saturate.
- whatever the mode, with `x_scale` given: x is e4m3 too (activations quantized per token, scales float32 [M], as the
  prefill path's `torch._scaled_mm` takes them): an FP8 x FP8 dot, no widening, the row scale
  applied with the column scale.
- "tile_fp8": x stays bf16 in memory and each program quantizes the slice it loads, one scale
  per token per BLOCK_K slice (max |x| of the slice / 448); every slice's FP8 x FP8 dot is scaled
  by it into the float32 accumulator. The FP8 tensor cores on both operands with no quantization
  launch; each activation off by up to 1/16 of its slice's largest (per-token scales: of its
  token's largest), so a little closer to bf16 than the prefill path's numerics.
- "tile_fp8x2": as "tile_fp8", and what the first e4m3 term of each slice missed quantized as a
  second term with its own scale, a second FP8 dot: each activation off by about 1/256 of its
  slice's largest (bf16 rounding: 1/256 of the value itself), twice the tensor-core work (idle at
  decode sizes) for nearly bf16 activations.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from radixserve.kernels.decode_linear import _load_tiles, _reduce, _store_tile, _tile_setup
from radixserve.kernels.decode_linear_config import DecodeLinearConfig, block_m_for, pipeline_stages, split_plan, \
    supported
from radixserve.kernels.launch import FastKernel
from radixserve.kernels.quant_fp8 import quantize_rows_fp8


@triton.jit
def _quantize_tile(xf, FP8: tl.constexpr):
    """(e4m3 [BLOCK_K, BLOCK_M], float32 scales [BLOCK_M]) of a float32 x tile: each token's
    column scaled so its largest |value| maps to 448 (a zero column, padding included, stays 0)."""
    amax = tl.maximum(tl.max(tl.abs(xf), axis=0), 1e-30)
    q = tl.minimum(tl.maximum(xf * (448.0 / amax)[None, :], -448.0), 448.0)
    return q.to(FP8, fp_downcast_rounding="rtne"), amax / 448.0


@triton.jit(do_not_specialize=["M", "tiles_per_split"])
def _decode_linear_fp8_kernel(
    X, W, Scale, XScale, Bias, Y, M, N, K, stride_xm, stride_ym, tiles_per_split,
    HAS_BIAS: tl.constexpr, WRITE_PARTIAL: tl.constexpr, GATED: tl.constexpr, EVEN_N: tl.constexpr,
    X_FP8: tl.constexpr, DOT_FP16: tl.constexpr, X_TILE_TERMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n, pid_s, offs_n, mask_n, offs_m, mask_m, n_tiles, w_ptrs, x_ptrs = _tile_setup(
        X, W, M, N, K, stride_xm, tiles_per_split, GATED, BLOCK_M, BLOCK_N, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(0, n_tiles):
        w, x = _load_tiles(w_ptrs, x_ptrs, mask_n, mask_m, EVEN_N)
        if X_FP8:
            acc = tl.dot(w, x, acc)
        elif X_TILE_TERMS > 0:
            xf = x.to(tl.float32)
            xq, x_scale = _quantize_tile(xf, W.dtype.element_ty)
            acc += tl.dot(w, xq) * x_scale[None, :]
            if X_TILE_TERMS > 1:  # what the first e4m3 term missed, as a second one
                rq, r_scale = _quantize_tile(xf - xq.to(tl.float32) * x_scale[None, :], W.dtype.element_ty)
                acc += tl.dot(w, rq) * r_scale[None, :]
        elif DOT_FP16:
            x16 = tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
            acc = tl.dot(w.to(tl.float16), x16, acc)
        else:
            acc = tl.dot(w.to(x.dtype), x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    acc *= tl.load(Scale + offs_n, mask=mask_n, other=0.0)[:, None]
    if X_FP8:
        acc *= tl.load(XScale + offs_m, mask=mask_m, other=0.0)[None, :]
    _store_tile(acc, Bias, Y, M, N, stride_ym, pid_n, pid_s, offs_n, mask_n, offs_m, mask_m, HAS_BIAS, WRITE_PARTIAL,
                GATED, BLOCK_M, BLOCK_N)


_linear_fp8 = FastKernel(_decode_linear_fp8_kernel)


def decode_linear_fp8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor],
                      config: DecodeLinearConfig, out: Optional[torch.Tensor] = None,
                      partial: Optional[torch.Tensor] = None, silu_mul: bool = False,
                      x_scale: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
                      input_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] e4m3 * weight_scale [N] float32)^T + bias [N] -> [M, N] in x's
    dtype, float32 accumulation. silu_mul, config, partial: as `decode_linear`.

    x_scale (float32 [M]): x is e4m3, x[i] * x_scale[i] the activations; the result is out_dtype
    (or out's); otherwise config.fp8_mode says how x is multiplied (see the module's docstring).
    input_scale (float32 [1]): "token_fp8" quantizes x with this static scale, not per token."""
    if config.fp8_mode == "token_fp8" and x.dtype != torch.float8_e4m3fn and x_scale is None:
        out_dtype = x.dtype
        x, x_scale = quantize_rows_fp8(x, input_scale)
    m, k = x.shape
    n = weight.shape[0]
    if weight.dtype != torch.float8_e4m3fn or weight_scale.dtype != torch.float32 or weight_scale.shape != (n,):
        raise ValueError(f"decode_linear_fp8: weight {weight.dtype} and scale {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}: expected e4m3 weights and float32 scales [{n}]")
    x_fp8 = x.dtype == torch.float8_e4m3fn
    if x_fp8 != (x_scale is not None) or (x_scale is not None and (x_scale.dtype != torch.float32
                                                                     or x_scale.numel() != m)):
        raise ValueError(f"decode_linear_fp8: x {x.dtype} with x_scale "
                         f"{None if x_scale is None else (x_scale.dtype, tuple(x_scale.shape))}: e4m3 "
                         f"activations take float32 scales [{m}], others none")
    if weight.shape[1] != k or x.stride(1) != 1 or not supported(weight, config) \
            or (silu_mul and (n % 2 or bias is not None)):
        raise ValueError(f"decode_linear_fp8: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit "
                         f"block_k={config.block_k}" + (" with silu_mul" if silu_mul else ""))
    n_out = n // 2 if silu_mul else n
    y_dtype = out_dtype if x_fp8 else x.dtype
    y = torch.empty((m, n_out), dtype=y_dtype, device=x.device) if out is None else out
    if m == 0:
        return y
    c = config
    tiles_per_split, split = split_plan(k, c)
    block_m = block_m_for(m)
    stages = pipeline_stages(c, block_m, x.element_size(), weight.element_size())
    cols = c.block_n // 2 if silu_mul else c.block_n
    grid = (triton.cdiv(n_out, cols), split, triton.cdiv(m, block_m))
    has_bias = bias is not None
    bias_arg = bias if has_bias else weight_scale
    if split > 1:
        if partial is None:
            partial = torch.empty(split * m * n, dtype=torch.float32, device=x.device)
        elif partial.numel() < split * m * n or partial.dtype != torch.float32:
            raise ValueError(f"decode_linear_fp8: the partial buffer needs {split * m * n} float32 elements")
    x_scale_arg = x_scale.reshape(m).contiguous() if x_fp8 else weight_scale  # a static scale is expanded
    _linear_fp8[grid](x, weight, weight_scale, x_scale_arg, bias_arg, y if split == 1 else partial, m, n, k,
                      x.stride(0), y.stride(0), tiles_per_split, HAS_BIAS=has_bias, WRITE_PARTIAL=split > 1,
                      GATED=silu_mul, EVEN_N=n_out % cols == 0, X_FP8=x_fp8,
                      DOT_FP16=c.fp8_mode == "fp16" and not x_fp8,
                      X_TILE_TERMS=0 if x_fp8 else {"tile_fp8": 1, "tile_fp8x2": 2}.get(c.fp8_mode, 0),
                      BLOCK_M=block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, num_warps=c.num_warps,
                      num_stages=stages)
    if split > 1:
        block = min(1024, triton.next_power_of_2(n_out))
        _reduce[(m, triton.cdiv(n_out, block))](partial, bias_arg, y, m, n, y.stride(0), split,
                                               HAS_BIAS=has_bias, GATED=silu_mul, BLOCK=block, num_warps=4)
    return y


def tile_quantized_reference(x: torch.Tensor, block_k: int, terms: int = 1,
                             dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """What the tile modes multiply, computed with torch: x [M, K] with each token's block_k slices
    quantized to e4m3 by the slice's max |x| / 448 ("tile_fp8"); terms=2 adds the first term's
    error quantized the same way ("tile_fp8x2"). Returned in dtype."""
    m, k = x.shape
    xs = x.to(dtype).view(m, k // block_k, block_k)
    out = torch.zeros_like(xs)
    for _ in range(terms):
        rest = xs - out
        amax = rest.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
        out = out + (rest * (448.0 / amax)).clamp(-448, 448).to(torch.float8_e4m3fn).to(dtype) * (amax / 448.0)
    return out.view(m, k)
