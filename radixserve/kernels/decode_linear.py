"""y = x @ W^T (+ bias) for the few rows of a decode step, streaming W through many programs.

At decode a projection multiplies a handful of rows (the batch, M <= 64) by tens of megabytes of
weights, so its time is the time to read the weights once. Each program here owns BLOCK_N rows
of W (output columns) over one slice of K. The product is computed transposed, W_tile @ x^T
([BLOCK_N, BLOCK_K] @ [BLOCK_K, BLOCK_M]), so the weight tile is the large operand of the
tensor-core instruction (on Hopper a 64-row wgmma with an N of 16) and the batch rows, padded to
16, are the small one. With SPLIT > 1 the K slices write float32 partials [SPLIT, M, N] and a
row-wise reduce adds them in split order (deterministic: no atomics) with the bias; a reduce is
cheap next to the weights (M x N x 4 bytes per split) and lets every projection, even a narrow
one, spread its weights over enough programs to keep every SM's loads in flight.

`silu_mul=True` takes the fused gate|up weight and returns silu(gate) * up: each program reads
the gate rows and the up rows of the same output columns, so the MLP's activation costs no
launch of its own and its [M, 2I] intermediate is never written.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from radixserve.kernels.decode_linear_config import (DecodeLinearConfig, block_m_for, pipeline_stages, split_plan,
                                                     supported)
from radixserve.kernels.launch import FastKernel


@triton.jit
def _silu_mul(gate, up, DTYPE: tl.constexpr):
    # Rounded to the activation dtype first, as the unfused path (GEMM output, then silu_and_mul) does.
    gate = gate.to(DTYPE).to(tl.float32)
    up = up.to(DTYPE).to(tl.float32)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _tile_setup(X, W, M, N, K, stride_xm, tiles_per_split, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Where a program of either decode-row GEMM (this one, decode_linear_fp8's) works: its W rows
    (`offs_n`, `mask_n`), its x rows (`offs_m`, `mask_m`), the K tiles of its split (`n_tiles`)
    and the pointers to the first of them. Grid: (output column tiles, K splits, row tiles)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    r = tl.arange(0, BLOCK_N)
    if GATED:
        # W is gate rows [0, N/2) then up rows [N/2, N): a program's tile is HALF gate rows and the
        # HALF up rows of the same output columns, so its epilogue can apply silu(gate) * up.
        HALF: tl.constexpr = BLOCK_N // 2
        cols = pid_n * HALF + (r % HALF)
        offs_n = tl.where(r < HALF, cols, N // 2 + cols)
        mask_n = cols < N // 2
    else:
        offs_n = pid_n * BLOCK_N + r
        mask_n = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    first = pid_s * tiles_per_split
    n_tiles = tl.minimum(tiles_per_split, K // BLOCK_K - first)
    k0 = first * BLOCK_K
    mask_m = offs_m < M
    w_ptrs = W + offs_n[:, None].to(tl.int64) * K + (k0 + offs_k)[None, :]
    x_ptrs = X + offs_m[None, :] * stride_xm + (k0 + offs_k)[:, None]
    return pid_n, pid_s, offs_n, mask_n, offs_m, mask_m, n_tiles, w_ptrs, x_ptrs


@triton.jit
def _load_tiles(w_ptrs, x_ptrs, mask_n, mask_m, EVEN_N: tl.constexpr):
    """One K step's weight tile [BLOCK_N, BLOCK_K] and x tile [BLOCK_K, BLOCK_M] (padding rows 0)."""
    if EVEN_N:
        w = tl.load(w_ptrs)  # unmasked: 16-byte vector loads along K
    else:
        w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
    x = tl.load(x_ptrs, mask=mask_m[None, :], other=0.0)
    return w, x


@triton.jit
def _store_tile(acc, Bias, Y, M, N, stride_ym, pid_n, pid_s, offs_n, mask_n, offs_m, mask_m,
                HAS_BIAS: tl.constexpr, WRITE_PARTIAL: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """A program's float32 accumulator [BLOCK_N, BLOCK_M] out: as a split's partial sums, as
    silu(gate) * up, or plus the bias, in Y's dtype."""
    if WRITE_PARTIAL:
        # Partial [SPLIT, M, N] float32 (W's row order), reduced by _reduce_partials_kernel.
        p_ptrs = Y + (pid_s * M + offs_m[None, :]).to(tl.int64) * N + offs_n[:, None]
        tl.store(p_ptrs, acc, mask=mask_n[:, None] & mask_m[None, :])
    elif GATED:
        HALF: tl.constexpr = BLOCK_N // 2
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, HALF, BLOCK_M)), (1, 2, 0)))
        h = _silu_mul(gate, up, Y.dtype.element_ty)
        out_cols = pid_n * HALF + tl.arange(0, HALF)
        y_ptrs = Y + offs_m[None, :] * stride_ym + out_cols[:, None]
        tl.store(y_ptrs, h.to(Y.dtype.element_ty), mask=(out_cols < N // 2)[:, None] & mask_m[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        y_ptrs = Y + offs_m[None, :] * stride_ym + offs_n[:, None]
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


@triton.jit(do_not_specialize=["M", "tiles_per_split"])
def _decode_linear_kernel(
    X, W, Bias, Y, M, N, K, stride_xm, stride_ym, tiles_per_split,
    HAS_BIAS: tl.constexpr, WRITE_PARTIAL: tl.constexpr, GATED: tl.constexpr, EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n, pid_s, offs_n, mask_n, offs_m, mask_m, n_tiles, w_ptrs, x_ptrs = _tile_setup(
        X, W, M, N, K, stride_xm, tiles_per_split, GATED, BLOCK_M, BLOCK_N, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(0, n_tiles):
        w, x = _load_tiles(w_ptrs, x_ptrs, mask_n, mask_m, EVEN_N)
        acc = tl.dot(w, x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    _store_tile(acc, Bias, Y, M, N, stride_ym, pid_n, pid_s, offs_n, mask_n, offs_m, mask_m, HAS_BIAS, WRITE_PARTIAL,
                GATED, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["M", "num_splits"])
def _reduce_partials_kernel(P, Bias, Y, M, N, stride_ym, num_splits, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                            BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_out = N // 2 if GATED else N
    mask = offs < n_out
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK,), dtype=tl.float32)
    p_ptrs = P + row.to(tl.int64) * N + offs
    for _ in range(0, num_splits):  # split order: the sum does not depend on timing
        acc += tl.load(p_ptrs, mask=mask, other=0.0)
        if GATED:
            acc_up += tl.load(p_ptrs + n_out, mask=mask, other=0.0)
        p_ptrs += M * N
    if GATED:
        acc = _silu_mul(acc, acc_up, Y.dtype.element_ty)
    elif HAS_BIAS:
        acc += tl.load(Bias + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_ym + offs, acc.to(Y.dtype.element_ty), mask=mask)


_linear = FastKernel(_decode_linear_kernel)
_reduce = FastKernel(_reduce_partials_kernel)


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], config: DecodeLinearConfig,
                  out: Optional[torch.Tensor] = None, partial: Optional[torch.Tensor] = None,
                  silu_mul: bool = False) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T + bias [N] -> [M, N] in x's dtype, float32 accumulation.

    silu_mul: weight is gate|up (N = 2I) and the result is silu(gate) * up, [M, I] (no bias).
    With config.split > 1, `partial` (float32, at least split x M x N elements) holds the split
    sums; it is allocated when not given.
    """
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x.stride(1) != 1 or not supported(weight, config) \
            or (silu_mul and (n % 2 or bias is not None)):
        raise ValueError(f"decode_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit "
                         f"block_k={config.block_k}" + (" with silu_mul" if silu_mul else ""))
    n_out = n // 2 if silu_mul else n
    y = torch.empty((m, n_out), dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return y
    c = config
    tiles_per_split, split = split_plan(k, c)
    block_m = block_m_for(m)
    stages = pipeline_stages(c, block_m, x.element_size())
    # A gated program covers block_n // 2 output columns (and reads block_n rows of W).
    cols = c.block_n // 2 if silu_mul else c.block_n
    grid = (triton.cdiv(n_out, cols), split, triton.cdiv(m, block_m))
    has_bias = bias is not None
    bias_arg = bias if has_bias else weight
    if split > 1:
        if partial is None:
            partial = torch.empty(split * m * n, dtype=torch.float32, device=x.device)
        elif partial.numel() < split * m * n or partial.dtype != torch.float32:
            raise ValueError(f"decode_linear: the partial buffer needs {split * m * n} float32 elements")
    _linear[grid](x, weight, bias_arg, y if split == 1 else partial, m, n, k, x.stride(0), y.stride(0),
                  tiles_per_split, HAS_BIAS=has_bias, WRITE_PARTIAL=split > 1, GATED=silu_mul,
                  EVEN_N=n_out % cols == 0, BLOCK_M=block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                  num_warps=c.num_warps, num_stages=stages)
    if split > 1:
        block = min(1024, triton.next_power_of_2(n_out))
        _reduce[(m, triton.cdiv(n_out, block))](partial, bias_arg, y, m, n, y.stride(0), split,
                                               HAS_BIAS=has_bias, GATED=silu_mul, BLOCK=block, num_warps=4)
    return y
