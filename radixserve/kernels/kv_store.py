"""Write the new tokens' K and V into the pool's slots, both in one launch.

An FP8 pool (float8_e4m3fn buffers) holds k / k_scale and v / v_scale, saturated at +-448; the
attention kernels multiply the scales back in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels.launch import FastKernel

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def scale_to(x, scale, DTYPE: tl.constexpr):
    """x / scale in DTYPE (an FP8 pool's), saturated at its largest finite value."""
    y = x.to(tl.float32) / scale
    return tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX).to(DTYPE)


@triton.jit(do_not_specialize=["num_tokens"])  # one variant for every batch size
def _store_kv_kernel(K, V, K_buf, V_buf, loc,
                     stride_kt, stride_vt, stride_kbs, stride_vbs, num_tokens, k_scale, v_scale,
                     HD: tl.constexpr, BLOCK: tl.constexpr, TOKENS_PER_PROGRAM: tl.constexpr,
                     SCALED: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < HD
    for i in tl.static_range(TOKENS_PER_PROGRAM):
        t = pid * TOKENS_PER_PROGRAM + i
        if t < num_tokens:
            slot = tl.load(loc + t).to(tl.int64)
            k = tl.load(K + t.to(tl.int64) * stride_kt + offs, mask=mask)
            v = tl.load(V + t.to(tl.int64) * stride_vt + offs, mask=mask)
            if SCALED:
                k = scale_to(k, k_scale, K_buf.dtype.element_ty)
                v = scale_to(v, v_scale, V_buf.dtype.element_ty)
            tl.store(K_buf + slot * stride_kbs + offs, k.to(K_buf.dtype.element_ty), mask=mask)
            tl.store(V_buf + slot * stride_vbs + offs, v.to(V_buf.dtype.element_ty), mask=mask)


_store_kv = FastKernel(_store_kv_kernel)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] whose (H, D) part is dense, so one token's heads are one run of H*D elements."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def store_kv(k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
             loc: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k_buf[loc[t]] = k[t], v_buf[loc[t]] = v[t]; k, v [T, Hkv, D], buffers [num_slots, Hkv, D].
    FP8 buffers get k[t] / k_scale and v[t] / v_scale."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k = _rows_contiguous(k)
    v = _rows_contiguous(v)
    assert k_buf.stride(2) == 1 and k_buf.stride(1) == k_buf.shape[2]
    assert v_buf.stride(2) == 1 and v_buf.stride(1) == v_buf.shape[2]
    hd = k.shape[1] * k.shape[2]
    # Several tokens per program at big T keeps the grid (and the launch) small.
    per_program = 1 if num_tokens <= 4096 else 4
    grid = (triton.cdiv(num_tokens, per_program),)
    _store_kv[grid](k, v, k_buf, v_buf, loc, k.stride(0), v.stride(0), k_buf.stride(0), v_buf.stride(0), num_tokens,
                    float(k_scale), float(v_scale), HD=hd, BLOCK=triton.next_power_of_2(hd),
                    TOKENS_PER_PROGRAM=per_program, SCALED=is_fp8(k_buf), num_warps=4)


def is_fp8(buf: torch.Tensor) -> bool:
    return buf.dtype == torch.float8_e4m3fn
