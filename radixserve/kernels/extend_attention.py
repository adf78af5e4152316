"""Extend attention: a ragged batch of requests, each with a cached prefix plus new tokens.

One program per (item, KV head); the items come from `extend_attention_plan.plan_extend`. A
program's block_m rows are (new token, query head) pairs of one request and one KV head's group,
token major (GQA packing): each K/V tile it loads feeds the whole group in one block_m-row dot,
where a program per query head would load it `group` times, and short extends still fill the
tensor cores' rows (16 new tokens x 7 heads = 112 rows).

Each program runs a FlashAttention-2 online softmax (bf16/fp16 dots, fp32 accumulation, base-2
exponentials) first over its item's range [lo, hi) of the request's cached prefix, gathered from
the KV pool through req_to_token (page size 1 rows: no TMA; Triton's pipeliner keeps num_stages
cp.async tiles in flight, the slot loads ahead of the row loads), then, in the item that reaches
the prefix's end, causally over the new tokens, read from the contiguous k/v of this pass. Only
the tiles that straddle the prefix end or the diagonal are masked. An item that is one split of
a tile (a long prefix in a batch too small to fill the GPU) writes its normalized partial output
and log-sum-exp to a float32 workspace; `_merge_kernel` combines a tile's splits.

An FP8 pool (holding k / k_scale and v / v_scale) is read in phase 1 with each tile widened to
q's dtype: k_scale folded into the logits' scale, v dequantized in registers. The new tokens'
k/v (phase 2) come in q's dtype.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton
import triton.language as tl

from radixserve.kernels.extend_attention_config import ExtendAttentionConfig
from radixserve.kernels.extend_attention_plan import ExtendPlan
from radixserve.kernels.launch import FastKernel

LOG2E = 1.4426950408889634
MERGE_ROWS = 16  # rows of a tile per merge program


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k, v, qk_scale, mask, DOT_PRECISION: tl.constexpr):
    """One online-softmax step; k and v [N, D]; mask [M, N] or None."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if mask is not None:
        qk = tl.where(mask, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
    else:
        # The scale goes into the exponent's argument: one FMA per element, no separate pass.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _gather_kv(k_base, v_base, slots, offs_d, stride_kbs, stride_vbs, dtype, v_scale, mask_n,
               KV_FP8: tl.constexpr):
    """K and V rows [N, D] of the pool at `slots` (masked rows zero), widened to `dtype`."""
    if mask_n is not None:
        k = tl.load(k_base + slots[:, None] * stride_kbs + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        v = tl.load(v_base + slots[:, None] * stride_vbs + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    else:
        k = tl.load(k_base + slots[:, None] * stride_kbs + offs_d[None, :])
        v = tl.load(v_base + slots[:, None] * stride_vbs + offs_d[None, :])
    if KV_FP8:
        k = k.to(dtype)
        v = (v.to(tl.float32) * v_scale).to(dtype)
    return k, v


# num_tokens changes with every batch: specialising on it (divisibility by 16) would compile a
# second variant in the middle of serving.
@triton.jit(do_not_specialize=["num_tokens"])
def _extend_kernel(
    Q, K_new, V_new, O, K_buf, V_buf, req_to_token, Mid_O, Mid_L,
    req_pool_indices, prefix_lens, extend_lens, q_starts,
    item_req, item_m, item_lo, item_hi, item_part,
    num_tokens, num_kv_heads,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_ot, stride_oh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_r2t, stride_mid_p, stride_mid_h,
    qk_scale, k_scale, v_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, PREFETCH_SLOTS: tl.constexpr,
    TMA_NEW: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    r = tl.load(item_req + item)
    m0 = tl.load(item_m + item)
    lo = tl.load(item_lo + item)
    hi = tl.load(item_hi + item)
    part = tl.load(item_part + item)
    prefix = tl.load(prefix_lens + r).to(tl.int32)
    extend = tl.load(extend_lens + r).to(tl.int32)
    q_start = tl.load(q_starts + r).to(tl.int64)

    # Row i of the program: token (m0 + i) // GROUP of the request, query head
    # kv_head * GROUP + (m0 + i) % GROUP.
    rows = m0 + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = tok < extend
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Phase 1: prefix positions [lo, hi) through req_to_token; every new token sees all of them.
    # lo is a multiple of BLOCK_N, and so is hi unless it is the prefix's end.
    row = tl.load(req_pool_indices + r).to(tl.int64)
    slot_ptr = req_to_token + row * stride_r2t
    k_base = K_buf + kv_head * stride_kbh
    v_base = V_buf + kv_head * stride_vbh
    full_end = lo + ((hi - lo) // BLOCK_N) * BLOCK_N
    prefix_qk_scale = qk_scale * k_scale
    if PREFETCH_SLOTS:
        # Slots one tile ahead as a loop-carried value: the row loads of a tile never wait on
        # the slot load issued in the same iteration.
        slots = tl.load(slot_ptr + lo + offs_n, mask=lo + offs_n < hi, other=0).to(tl.int64)
        for n0 in range(lo, full_end, BLOCK_N):
            nxt = n0 + BLOCK_N + offs_n
            slots_next = tl.load(slot_ptr + nxt, mask=nxt < hi, other=0).to(tl.int64)
            k, v = _gather_kv(k_base, v_base, slots, offs_d, stride_kbs, stride_vbs, q.dtype, v_scale, None, KV_FP8)
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, prefix_qk_scale, None, DOT_PRECISION)
            slots = slots_next
    else:
        for n0 in range(lo, full_end, BLOCK_N):
            slots = tl.load(slot_ptr + n0 + offs_n).to(tl.int64)
            k, v = _gather_kv(k_base, v_base, slots, offs_d, stride_kbs, stride_vbs, q.dtype, v_scale, None, KV_FP8)
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, prefix_qk_scale, None, DOT_PRECISION)
    if full_end < hi:
        offs = full_end + offs_n
        mask_n = offs < hi
        slots = tl.load(slot_ptr + offs, mask=mask_n, other=0).to(tl.int64)
        k, v = _gather_kv(k_base, v_base, slots, offs_d, stride_kbs, stride_vbs, q.dtype, v_scale, mask_n, KV_FP8)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, prefix_qk_scale, mask_n[None, :], DOT_PRECISION)

    # Phase 2 (the item that reaches the prefix's end): the new tokens, causally. Tiles that end
    # at or before the first row's token are wholly visible to every row.
    if hi >= prefix:
        t_first = m0 // GROUP
        t_end = tl.minimum((m0 + BLOCK_M - 1) // GROUP + 1, extend)
        free_end = ((t_first + 1) // BLOCK_N) * BLOCK_N
        if TMA_NEW:
            # 2-D descriptors over [tokens, KV heads x D] (the caller checked that a token's heads
            # are contiguous). Positions past the request (the next request's tokens, or zeros
            # past the last token) are masked below.
            kn_desc = tl.make_tensor_descriptor(K_new, shape=[num_tokens, num_kv_heads * HEAD_DIM],
                                                strides=[stride_knt, 1], block_shape=[BLOCK_N, HEAD_DIM])
            vn_desc = tl.make_tensor_descriptor(V_new, shape=[num_tokens, num_kv_heads * HEAD_DIM],
                                                strides=[stride_vnt, 1], block_shape=[BLOCK_N, HEAD_DIM])
            t0 = q_start.to(tl.int32)
            col = kv_head * HEAD_DIM
            for n0 in tl.range(0, free_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
                k = kn_desc.load([t0 + n0, col])
                v = vn_desc.load([t0 + n0, col])
                acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, qk_scale, None, DOT_PRECISION)
            for n0 in range(free_end, t_end, BLOCK_N):
                offs = n0 + offs_n
                k = kn_desc.load([t0 + n0, col])
                v = vn_desc.load([t0 + n0, col])
                causal = (offs[None, :] <= tok[:, None]) & (offs[None, :] < extend)
                acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, qk_scale, causal, DOT_PRECISION)
        else:
            kn_base = K_new + q_start * stride_knt + kv_head * stride_knh
            vn_base = V_new + q_start * stride_vnt + kv_head * stride_vnh
            for n0 in range(0, free_end, BLOCK_N):
                offs = n0 + offs_n
                k = tl.load(kn_base + offs[:, None] * stride_knt + offs_d[None, :])
                v = tl.load(vn_base + offs[:, None] * stride_vnt + offs_d[None, :])
                acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, qk_scale, None, DOT_PRECISION)
            for n0 in range(free_end, t_end, BLOCK_N):
                offs = n0 + offs_n
                mask_n = offs < extend
                k = tl.load(kn_base + offs[:, None] * stride_knt + offs_d[None, :], mask=mask_n[:, None], other=0.0)
                v = tl.load(vn_base + offs[:, None] * stride_vnt + offs_d[None, :], mask=mask_n[:, None], other=0.0)
                causal = (offs[None, :] <= tok[:, None]) & mask_n[None, :]
                acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, qk_scale, causal, DOT_PRECISION)

    out = acc / l_i[:, None]
    if part < 0:
        tl.store(O + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=row_ok[:, None])
    else:
        offs_m = tl.arange(0, BLOCK_M)
        mid = part.to(tl.int64) * stride_mid_p + kv_head * stride_mid_h
        tl.store(Mid_O + mid + offs_m[:, None] * HEAD_DIM + offs_d[None, :], out)
        tl.store(Mid_L + (mid // HEAD_DIM) + offs_m, m_i + tl.log2(l_i))


@triton.jit
def _merge_kernel(
    O, Mid_O, Mid_L, q_starts, extend_lens, merge_req, merge_m, merge_first, merge_count,
    stride_ot, stride_oh, stride_mid_p, stride_mid_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MERGE_ROWS: tl.constexpr,
):
    """out rows of one split tile (MERGE_ROWS of them per program) = its splits' partial outputs
    weighted by exp2(lse - max lse)."""
    g = tl.program_id(0)
    kv_head = tl.program_id(1)
    sub = tl.program_id(2)
    r = tl.load(merge_req + g)
    m0 = tl.load(merge_m + g)
    first = tl.load(merge_first + g)
    count = tl.load(merge_count + g)
    extend = tl.load(extend_lens + r).to(tl.int32)
    q_start = tl.load(q_starts + r).to(tl.int64)
    offs_m = sub * MERGE_ROWS + tl.arange(0, MERGE_ROWS)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = m0 + offs_m
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    m = tl.full([MERGE_ROWS], float("-inf"), dtype=tl.float32)
    l = tl.zeros([MERGE_ROWS], dtype=tl.float32)
    acc = tl.zeros([MERGE_ROWS, HEAD_DIM], dtype=tl.float32)
    first = first.to(tl.int64)
    for i in range(0, count):
        mid = (first + i) * stride_mid_p + kv_head * stride_mid_h
        lse = tl.load(Mid_L + (mid // HEAD_DIM) + offs_m)
        o = tl.load(Mid_O + mid + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + o * w[:, None]
        l = l * alpha + w
        m = m_new
    tl.store(O + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             (acc / l[:, None]).to(O.dtype.element_ty), mask=(tok < extend)[:, None])


_extend = FastKernel(_extend_kernel)
_merge = FastKernel(_merge_kernel)
_allocator_set = False


def _ensure_tma_allocator() -> None:
    """Device-side tensor descriptors need scratch global memory from Triton's allocator hook."""
    global _allocator_set
    if not _allocator_set:
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        _allocator_set = True


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                     plan: ExtendPlan, config: ExtendAttentionConfig, *, sm_scale: float | None = None,
                     k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """out [T, Hq, D] = attention of the new tokens q [T, Hq, D] (requests concatenated).

    k, v [T, Hkv, D] are the new tokens' keys/values (already stored in the pool too), in q's
    dtype; the prefix of request i is req_to_token[req_pool_indices[i], :prefix_lens[i]] in
    k_buf/v_buf (FP8 buffers hold K / k_scale and V / v_scale). `plan` (plan_extend with this
    config's block_m / block_n and q's group) says which rows and ranges each program takes.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0 or plan.num_items == 0:
        return out
    num_kv_heads = k_buf.shape[1]
    group = num_q_heads // num_kv_heads
    if (plan.group, plan.block_m, plan.block_n) != (group, config.block_m, config.block_n):
        raise ValueError(f"plan (group {plan.group}, {plan.block_m} x {plan.block_n}) does not match "
                         f"group {group} and config {config.label()}")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim {head_dim} must be a power of two >= 16")
    for x in (q, k, v, out, k_buf, v_buf):
        assert x.stride(2) == 1, "the head dimension must be contiguous"
    scale = (1.0 / math.sqrt(head_dim)) if sm_scale is None else sm_scale
    if config.tma_new and (k.stride(1) != head_dim or v.stride(1) != head_dim):
        # The descriptors see a token's heads as one contiguous row: other layouts take pointer loads.
        config = replace(config, tma_new=False, warp_specialize=False)
    if config.tma_new and q.is_cuda:
        _ensure_tma_allocator()
    mid_o, mid_l = plan.workspace(num_kv_heads, head_dim, q.device)
    it = plan.items
    _extend[(plan.num_items, num_kv_heads)](
        q, k, v, out, k_buf, v_buf, req_to_token, mid_o, mid_l,
        req_pool_indices, prefix_lens, extend_lens, plan.q_starts,
        it["req"], it["m0"], it["lo"], it["hi"], it["part"],
        num_tokens, num_kv_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1),
        scale * LOG2E, float(k_scale), float(v_scale),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=k_buf.dtype == torch.float8_e4m3fn,
        PREFETCH_SLOTS=config.prefetch_slots, TMA_NEW=config.tma_new, WARP_SPECIALIZE=config.warp_specialize,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if plan.num_merges:
        mg = plan.merges
        rows = min(MERGE_ROWS, config.block_m)
        _merge[(plan.num_merges, num_kv_heads, config.block_m // rows)](
            out, mid_o, mid_l, plan.q_starts, extend_lens, mg["req"], mg["m0"], mg["first_part"], mg["num_parts"],
            out.stride(0), out.stride(1), mid_o.stride(0), mid_o.stride(1),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_M=config.block_m, MERGE_ROWS=rows, num_warps=4, num_stages=2,
        )
    return out
