"""The per-query-head extend attention kernel that radixserve.kernels.extend_attention replaced,
kept for scripts/extend_attention_sweep.py to time beside it (not used by the package).

One program per (query head, tile of BLOCK_M new tokens of one request): each K/V prefix tile is
loaded once per query head (7 times per KV head for Qwen2-7B). FlashAttention-2 online softmax
over the cached prefix through req_to_token, then causally over the new tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixserve.kernels.launch import FastKernel

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k, v, qk_scale, mask, DOT_PRECISION: tl.constexpr):
    """One online-softmax step; k [D, N], v [N, D]; mask [M, N] or None."""
    qk = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
    if mask is not None:
        qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _extend_kernel(
    Q, K_new, V_new, O, K_buf, V_buf, req_to_token,
    req_pool_indices, prefix_lens, extend_lens, q_starts, tile_req, tile_m,
    stride_qt, stride_qh, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_ot, stride_oh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh, stride_r2t,
    qk_scale, k_scale, v_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    head = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = head // GROUP
    r = tl.load(tile_req + tile)
    m0 = tl.load(tile_m + tile)
    prefix = tl.load(prefix_lens + r).to(tl.int32)
    extend = tl.load(extend_lens + r).to(tl.int32)
    q_start = tl.load(q_starts + r).to(tl.int64)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < extend

    q = tl.load(Q + (q_start + offs_m[:, None]) * stride_qt + head * stride_qh + offs_d[None, :],
                mask=mask_m[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Phase 1: the cached prefix, through req_to_token. Every new token sees all of it.
    row = tl.load(req_pool_indices + r).to(tl.int64)
    slot_ptr = req_to_token + row * stride_r2t
    k_base = K_buf + kv_head * stride_kbh
    v_base = V_buf + kv_head * stride_vbh
    prefix_full = (prefix // BLOCK_N) * BLOCK_N
    prefix_qk_scale = qk_scale * k_scale
    for n0 in range(0, prefix_full, BLOCK_N):
        slots = tl.load(slot_ptr + n0 + offs_n).to(tl.int64)
        k = tl.load(k_base + slots[None, :] * stride_kbs + offs_d[:, None])
        v = tl.load(v_base + slots[:, None] * stride_vbs + offs_d[None, :])
        if KV_FP8:
            k = k.to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, prefix_qk_scale, None, DOT_PRECISION)
    if prefix_full < prefix:
        offs = prefix_full + offs_n
        mask_n = offs < prefix
        slots = tl.load(slot_ptr + offs, mask=mask_n, other=0).to(tl.int64)
        k = tl.load(k_base + slots[None, :] * stride_kbs + offs_d[:, None], mask=mask_n[None, :], other=0.0)
        v = tl.load(v_base + slots[:, None] * stride_vbs + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, prefix_qk_scale, mask_n[None, :], DOT_PRECISION)

    # Phase 2: the new tokens, causally. Tiles left of m0 are wholly visible to every row here.
    kn_base = K_new + q_start * stride_knt + kv_head * stride_knh
    vn_base = V_new + q_start * stride_vnt + kv_head * stride_vnh
    for n0 in range(0, m0, BLOCK_N):
        offs = n0 + offs_n
        k = tl.load(kn_base + offs[None, :] * stride_knt + offs_d[:, None])
        v = tl.load(vn_base + offs[:, None] * stride_vnt + offs_d[None, :])
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, qk_scale, None, DOT_PRECISION)
    diag_end = tl.minimum(extend, m0 + BLOCK_M)
    for n0 in range(m0, diag_end, BLOCK_N):
        offs = n0 + offs_n
        mask_n = offs < extend
        k = tl.load(kn_base + offs[None, :] * stride_knt + offs_d[:, None], mask=mask_n[None, :], other=0.0)
        v = tl.load(vn_base + offs[:, None] * stride_vnt + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        causal = (offs[None, :] <= offs_m[:, None]) & mask_n[None, :]
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, qk_scale, causal, DOT_PRECISION)

    out = acc / l_i[:, None]
    tl.store(O + (q_start + offs_m[:, None]) * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=mask_m[:, None])


_extend = FastKernel(_extend_kernel)


@dataclass
class ExtendPlan:
    q_starts: torch.Tensor  # [B] int32, first row of each request's new tokens
    tile_req: torch.Tensor  # [num_tiles] int32
    tile_m: torch.Tensor  # [num_tiles] int32, first new token (within the request) of the tile
    block_m: int

    @property
    def num_tiles(self) -> int:
        return int(self.tile_req.shape[0])


def plan_extend_tiles(extend_lens: list[int], prefix_lens: list[int], block_m: int,
                      device: torch.device | str, first_request: int = 0) -> ExtendPlan:
    """Tiles of `block_m` new tokens per request, costliest first; one host-to-device copy.
    Requests before `first_request` get no tiles (another kernel attends for them)."""
    q_starts: list[int] = []
    tiles: list[tuple[int, int, int]] = []  # (-work, request, m0)
    offset = 0
    for r, (ext, prefix) in enumerate(zip(extend_lens, prefix_lens)):
        q_starts.append(offset)
        offset += ext
        if r < first_request:
            continue
        for m0 in range(0, ext, block_m):
            tiles.append((-(prefix + min(ext, m0 + block_m)), r, m0))
    tiles.sort()
    # Each part starts on a 16-byte boundary (4 int32s): Triton specialises pointers on alignment,
    # so unaligned views would compile new kernel variants as batch shapes change.
    b, n = len(q_starts), len(tiles)
    pad_b, pad_n = [0] * (-b % 4), [0] * (-n % 4)
    packed = torch.tensor(q_starts + pad_b + [t[1] for t in tiles] + pad_n + [t[2] for t in tiles], dtype=torch.int32)
    if torch.device(device).type == "cuda":
        packed = packed.pin_memory()
    packed = packed.to(device, non_blocking=True)
    b4, n4 = b + len(pad_b), n + len(pad_n)
    return ExtendPlan(packed[:b], packed[b4:b4 + n], packed[b4 + n4:b4 + n4 + n], block_m)


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, extend_lens: torch.Tensor,
                     plan: ExtendPlan, *, sm_scale: float | None = None, block_n: int = 64,
                     num_warps: int | None = None, num_stages: int = 3, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """out [T, Hq, D] = attention of the new tokens q [T, Hq, D] (requests concatenated).

    k, v [T, Hkv, D] are the new tokens' keys/values (already stored in the pool too), in q's
    dtype; the prefix of request i is req_to_token[req_pool_indices[i], :prefix_lens[i]] in
    k_buf/v_buf (FP8 buffers hold K / k_scale and V / v_scale).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0 or plan.num_tiles == 0:
        return out
    num_kv_heads = k_buf.shape[1]
    scale = (1.0 / math.sqrt(head_dim)) if sm_scale is None else sm_scale
    assert plan.block_m % block_n == 0, "BLOCK_M must be a multiple of BLOCK_N"
    for x in (q, k, v, out, k_buf, v_buf):
        assert x.stride(2) == 1, "the head dimension must be contiguous"
    if num_warps is None:
        num_warps = 8 if head_dim >= 128 else 4
    grid = (num_q_heads, plan.num_tiles)
    _extend[grid](
        q, k, v, out, k_buf, v_buf, req_to_token,
        req_pool_indices, prefix_lens, extend_lens, plan.q_starts, plan.tile_req, plan.tile_m,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), req_to_token.stride(0),
        scale * LOG2E, float(k_scale), float(v_scale),
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=plan.block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=k_buf.dtype == torch.float8_e4m3fn,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
