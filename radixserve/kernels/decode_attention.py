"""Decode attention: one query token per request, K/V read through req_to_token, split-K.

Stage 1 runs one program per (request, KV head, split). All query heads of that KV head are
rows of one tile (padded to 16 for the tensor cores), so each K/V tile is read from memory once
for the whole group. A split covers a contiguous run of the request's positions; its partial
output (normalised) and log-sum-exp (base 2) go to a float32 workspace. Stage 2 merges the
splits of each (request, query head). With one split (big batches fill the GPU without
splitting) stage 1 writes the output itself and stage 2 is not launched: a launch and a
workspace round trip fewer per layer. That is a run-time branch, not a compile-time one, so
the same compiled kernel serves both (a variant first met while serving would stall a step).

An FP8 pool (float8_e4m3fn, holding k / k_scale and v / v_scale) is read as is: each tile is
widened to q's dtype (exact) for the dots, k_scale is folded into the logits' scale and v_scale
multiplies the normalised output.

The split length is computed on the device from seq_lens, so the launch depends only on the
batch size and the number of splits: a CUDA graph captured once serves every context length.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from radixserve.kernels.launch import FastKernel

LOG2E = 1.4426950408889634


@triton.jit
def _split_range(seq_len, split, num_splits, BLOCK_N: tl.constexpr):
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    return start, end


# num_splits changes with the batch size, and with it the split-K workspace's strides over heads
# and requests (mid_lse's are num_splits and Hq x num_splits): Triton would compile a variant for
# each "== 1" / "divisible by 16" property of these. Left unspecialised, one variant serves every
# batch: a compile in the middle of serving stalled a mixed step of 296 requests for ~1 s (its
# num_splits was 1, which no captured decode batch had).
_SPLIT_DEPENDENT = ["num_splits", "stride_mlb", "stride_mlh"]


@triton.jit(do_not_specialize=_SPLIT_DEPENDENT)
def _decode_stage1_kernel(
    Q, K_buf, V_buf, req_to_token, req_pool_indices, seq_lens, Mid_O, Mid_LSE, O,
    stride_qb, stride_qh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    stride_r2t,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    stride_ob, stride_oh,
    qk_scale, v_scale, num_splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens + b).to(tl.int32)
    start, end = _split_range(seq_len, split, num_splits, BLOCK_N)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_g = offs_g < GROUP
    q_heads = kv_head * GROUP + offs_g
    o_ptr = O + b * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :]
    if start < end:
        offs_n = tl.arange(0, BLOCK_N)

        q = tl.load(Q + b * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_g[:, None], other=0.0)
        row = tl.load(req_pool_indices + b).to(tl.int64)
        slot_ptr = req_to_token + row * stride_r2t
        k_base = K_buf + kv_head * stride_kbh
        v_base = V_buf + kv_head * stride_vbh

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs = n0 + offs_n
            mask_n = offs < end
            slots = tl.load(slot_ptr + offs, mask=mask_n, other=0).to(tl.int64)
            k = tl.load(k_base + slots[None, :] * stride_kbs + offs_d[:, None], mask=mask_n[None, :], other=0.0)
            if KV_FP8:
                k = k.to(q.dtype)
            qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [G, N], base-2 logits
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + slots[:, None] * stride_vbs + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            if KV_FP8:
                v = v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        if KV_FP8:
            acc *= v_scale

        if num_splits == 1:
            tl.store(o_ptr, (acc / l_i[:, None]).to(O.dtype.element_ty), mask=mask_g[:, None])
        else:
            out_ptr = Mid_O + b * stride_mob + q_heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :]
            tl.store(out_ptr, acc / l_i[:, None], mask=mask_g[:, None])
            tl.store(Mid_LSE + b * stride_mlb + q_heads * stride_mlh + split, m_i + tl.log2(l_i), mask=mask_g)
    elif num_splits == 1:
        # A request with no context (a padded row of a CUDA-graph bucket) gets zeros, not NaN.
        tl.store(o_ptr, tl.zeros([BLOCK_G, HEAD_DIM], dtype=O.dtype.element_ty), mask=mask_g[:, None])


_decode_stage1 = FastKernel(_decode_stage1_kernel)


@triton.jit(do_not_specialize=_SPLIT_DEPENDENT)
def _decode_stage2_kernel(
    Mid_O, Mid_LSE, O, seq_lens,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    stride_ob, stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    seq_len = tl.load(seq_lens + b).to(tl.int32)

    m = float("-inf")
    total = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for split in range(0, num_splits):
        start, end = _split_range(seq_len, split, num_splits, BLOCK_N)
        if start < end:
            lse = tl.load(Mid_LSE + b * stride_mlb + head * stride_mlh + split)
            o = tl.load(Mid_O + b * stride_mob + head * stride_moh + split * stride_mos + offs_d)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(lse - m_new)
            acc = acc * alpha + w * o
            total = total * alpha + w
            m = m_new
    # A request with no context (a padded row of a CUDA-graph bucket) gets zeros, not NaN.
    out = tl.where(total > 0.0, acc / tl.maximum(total, 1e-30), 0.0)
    tl.store(O + b * stride_ob + head * stride_oh + offs_d, out.to(O.dtype.element_ty))


_decode_stage2 = FastKernel(_decode_stage2_kernel)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get exact fp32 dots (the fp32 correctness checks need them), not tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def workspace_numel(batch_size: int, num_q_heads: int, num_splits: int, head_dim: int) -> tuple[int, int]:
    """(elements of Mid_O, elements of Mid_LSE) for one decode batch."""
    return batch_size * num_q_heads * num_splits * head_dim, batch_size * num_q_heads * num_splits


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                     mid_o: torch.Tensor, mid_lse: torch.Tensor, num_splits: int, *,
                     sm_scale: float | None = None, block_n: int = 128, num_warps: int = 4,
                     num_stages: int = 3, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """out[b, h] = softmax(q[b, h] . K[b]^T * scale) V[b] over positions 0..seq_lens[b]-1.

    q [B, Hq, D] (any strides with unit last stride); k_buf, v_buf [num_slots, Hkv, D];
    out [B, Hq, D] (written, in q's dtype); mid_o [B, Hq, num_splits, D] float32 and
    mid_lse [B, Hq, num_splits] float32 are scratch (unused with one split). No host sync; no
    allocation. FP8 buffers hold K / k_scale and V / v_scale.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    group = num_q_heads // num_kv_heads
    if batch == 0:
        return out
    scale = (1.0 / math.sqrt(head_dim)) if sm_scale is None else sm_scale
    assert q.stride(2) == 1 and k_buf.stride(2) == 1 and v_buf.stride(2) == 1 and out.stride(2) == 1
    block_g = max(16, triton.next_power_of_2(group))
    if q.dtype == torch.float32:
        block_n = min(block_n, 64)  # float32 tiles take twice the shared memory
    kv_fp8 = k_buf.dtype == torch.float8_e4m3fn
    _decode_stage1[(batch, num_kv_heads, num_splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse, out,
        q.stride(0), q.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        scale * LOG2E * (k_scale if kv_fp8 else 1.0), float(v_scale), num_splits,
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype), KV_FP8=kv_fp8,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits == 1:
        return out
    _decode_stage2[(batch, num_q_heads)](
        mid_o, mid_lse, out, seq_lens,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        num_splits,
        HEAD_DIM=head_dim, BLOCK_N=block_n,
        num_warps=1 if head_dim <= 64 else 2,
    )
    return out
