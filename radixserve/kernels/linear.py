"""y = x @ W^T (+ bias) for the few rows of a decode step: a weight-streaming GEMM.

At decode, a projection multiplies a handful of rows (the batch) by a weight matrix of tens of
megabytes, so its time is the time to stream the weights once. cuBLAS tiles such products for
throughput: few output tiles (a 4608-wide projection is 36 tiles of 128), so few streaming
multiprocessors pull weights, or a split-K algorithm with a separate reduce kernel. Here every
program streams a narrow strip of W (BLOCK_N output columns) over a slice of K, so the weights
are spread over hundreds of programs; with SPLIT_K > 1, each program writes its float32 partial
to a workspace and the last program of a column strip to arrive (an atomic counter per strip)
adds the partials in split order, adds the bias and writes y. The sum order is fixed, so results
do not depend on timing, and the counters reset themselves, so the kernel needs no memset and
replays inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["M", "split_k", "k_per_split"])
def _skinny_linear_kernel(
    X, W, Bias, Y, Partial, Counter,
    M, N, K, stride_xm, stride_wn, stride_ym,
    split_k, k_per_split,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            # No mask along K, the contiguous dimension: the loads stay 16-byte vectors.
            x = tl.load(x_ptrs + k0, mask=mask_m[:, None], other=0.0)
            w = tl.load(w_ptrs + k0, mask=mask_n[:, None], other=0.0)
        else:
            mask_k = (k0 + offs_k) < k_end
            x = tl.load(x_ptrs + k0, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))

    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask_y = mask_m[:, None] & mask_n[None, :]
    if split_k == 1:
        if HAS_BIAS:
            acc += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=mask_y)
    else:
        # Partial [split_k, M, N] float32; counters, one per (column strip, row tile), start at 0.
        part_ptrs = Partial + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptrs + pid_k * M * N, acc, mask=mask_y)
        tl.debug_barrier()  # every thread's partial is written before the arrival is published
        counter = Counter + pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel")
        if arrived == split_k - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(0, split_k):
                total += tl.load(part_ptrs + s * M * N, mask=mask_y, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=mask_y)
            tl.atomic_xchg(counter, 0)


@dataclass(frozen=True)
class SkinnyConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


class SkinnyWorkspace:
    """Split-K partials and arrival counters, shared by every call on one stream (calls run in order)."""

    def __init__(self, device: torch.device | str, partial_numel: int = 1 << 22, counters: int = 1 << 14):
        self.partial = torch.empty(partial_numel, dtype=torch.float32, device=device)
        self.counter = torch.zeros(counters, dtype=torch.int32, device=device)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], config: SkinnyConfig,
                  workspace: SkinnyWorkspace, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T + bias[N] -> [M, N] in x's dtype; float32 accumulation.

    With split_k > 1 the workspace needs at least split_k * M * N partial elements and
    cdiv(N, block_n) * cdiv(M, block_m) counters, all zero (they are left zero).
    """
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return y
    c = config
    # Each split covers a whole number of BLOCK_K steps.
    k_per_split = triton.cdiv(triton.cdiv(k, c.split_k), c.block_k) * c.block_k
    split_k = triton.cdiv(k, k_per_split)
    grid = (triton.cdiv(n, c.block_n), split_k, triton.cdiv(m, c.block_m))
    if split_k > 1 and (split_k * m * n > workspace.partial.numel() or grid[0] * grid[2] > workspace.counter.numel()):
        raise ValueError(f"workspace too small for split_k={split_k}, M={m}, N={n}")
    # The workspace goes in even without split-K: the kernel's split-K branch is compiled either way.
    _skinny_linear_kernel[grid](
        x, weight, bias if bias is not None else weight, y, workspace.partial, workspace.counter,
        m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        split_k, k_per_split,
        HAS_BIAS=bias is not None, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        EVEN_K=k % c.block_k == 0,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
    return y
