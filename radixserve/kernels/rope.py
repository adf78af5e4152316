"""Rotary embedding (Hugging Face's rotate-half layout) applied to q and k in place, one launch,
optionally storing the rotated k and v into the KV pool in the same launch.

cos/sin are the model's tables [max_positions, head_dim] (each half repeated); the rotation is
computed in float32 and rounded once to q's dtype. Storing here saves the attention backend's separate KV-store launch:
one kernel fewer per layer, which is most of what a small model's decode step is made of.

Optionally (Qwen3) each head of q and of k is first RMS-normalised over its head_dim values with
its weight (`q_norm_weight`, `k_norm_weight`), in the same launch and in place: the numerics of
radixserve.kernels.norm.rms_norm on [tokens * heads, head_dim] rows (normalised in float32,
rounded to q's dtype, times the weight, rounded again), then rotated as above. Unfused, the two
norms would cost two launches and two copies of the strided q and k views per layer.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from radixserve.kernels.kv_store import is_fp8, scale_to
from radixserve.kernels.launch import FastKernel


@triton.jit
def _head_rms_norm(x1, x2, X, W, offs, eps, HALF: tl.constexpr):
    """Each row (a head) of x1 | x2 ([BLOCK_H, HALF] halves, float32 of X's stored values)
    normalised over its 2 * HALF values, rounded to X's dtype, times W, rounded again: what
    rms_norm stores for that head; returned in float32."""
    inv = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.load(W + offs).to(tl.float32)[None, :]
    w2 = tl.load(W + HALF + offs).to(tl.float32)[None, :]
    y1 = ((x1 * inv).to(X.dtype.element_ty).to(tl.float32) * w1).to(X.dtype.element_ty).to(tl.float32)
    y2 = ((x2 * inv).to(X.dtype.element_ty).to(tl.float32) * w2).to(X.dtype.element_ty).to(tl.float32)
    return y1, y2


@triton.jit
def _rope_kernel(Q, K, V, positions, Cos, Sin, K_buf, V_buf, loc, QW, KW,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
                 stride_kbs, stride_kbh, stride_vbs, stride_vbh,
                 num_q_heads, num_kv_heads, k_scale, v_scale, eps,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, STORE_KV: tl.constexpr, SCALED: tl.constexpr,
                 QK_NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    offs = tl.arange(0, HALF)
    cos = tl.load(Cos + pos * stride_cos + offs).to(tl.float32)
    sin = tl.load(Sin + pos * stride_sin + offs).to(tl.float32)
    heads = tl.arange(0, BLOCK_H)

    mq = heads[:, None] < num_q_heads
    q_ptr = Q + t * stride_qt + heads[:, None] * stride_qh + offs[None, :]
    q1 = tl.load(q_ptr, mask=mq, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + HALF, mask=mq, other=0.0).to(tl.float32)
    if QK_NORM:
        q1, q2 = _head_rms_norm(q1, q2, Q, QW, offs, eps, HALF)
    tl.store(q_ptr, (q1 * cos[None, :] - q2 * sin[None, :]).to(Q.dtype.element_ty), mask=mq)
    tl.store(q_ptr + HALF, (q2 * cos[None, :] + q1 * sin[None, :]).to(Q.dtype.element_ty), mask=mq)

    mk = heads[:, None] < num_kv_heads
    k_ptr = K + t * stride_kt + heads[:, None] * stride_kh + offs[None, :]
    k1 = tl.load(k_ptr, mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptr + HALF, mask=mk, other=0.0).to(tl.float32)
    if QK_NORM:
        k1, k2 = _head_rms_norm(k1, k2, K, KW, offs, eps, HALF)
    # Rounded to k's dtype first: the pool holds exactly what the unfused path would store.
    r1 = (k1 * cos[None, :] - k2 * sin[None, :]).to(K.dtype.element_ty)
    r2 = (k2 * cos[None, :] + k1 * sin[None, :]).to(K.dtype.element_ty)
    tl.store(k_ptr, r1, mask=mk)
    tl.store(k_ptr + HALF, r2, mask=mk)
    if STORE_KV:
        slot = tl.load(loc + t).to(tl.int64)
        kb_ptr = K_buf + slot * stride_kbs + heads[:, None] * stride_kbh + offs[None, :]
        v_ptr = V + t * stride_vt + heads[:, None] * stride_vh + offs[None, :]
        vb_ptr = V_buf + slot * stride_vbs + heads[:, None] * stride_vbh + offs[None, :]
        v1 = tl.load(v_ptr, mask=mk)
        v2 = tl.load(v_ptr + HALF, mask=mk)
        if SCALED:  # an FP8 pool holds k / k_scale, v / v_scale
            r1 = scale_to(r1, k_scale, K_buf.dtype.element_ty)
            r2 = scale_to(r2, k_scale, K_buf.dtype.element_ty)
            v1 = scale_to(v1, v_scale, V_buf.dtype.element_ty)
            v2 = scale_to(v2, v_scale, V_buf.dtype.element_ty)
        tl.store(kb_ptr, r1.to(K_buf.dtype.element_ty), mask=mk)
        tl.store(kb_ptr + HALF, r2.to(K_buf.dtype.element_ty), mask=mk)
        tl.store(vb_ptr, v1.to(V_buf.dtype.element_ty), mask=mk)
        tl.store(vb_ptr + HALF, v2.to(V_buf.dtype.element_ty), mask=mk)


_rope = FastKernel(_rope_kernel)


def apply_rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, *, v: Optional[torch.Tensor] = None, k_buf: Optional[torch.Tensor] = None,
                v_buf: Optional[torch.Tensor] = None, loc: Optional[torch.Tensor] = None,
                k_scale: float = 1.0, v_scale: float = 1.0, q_norm_weight: Optional[torch.Tensor] = None,
                k_norm_weight: Optional[torch.Tensor] = None, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (views into a fused qkv are fine) at
    `positions` [T]; cos/sin [max_positions, D]. Returns (q, k).

    With q_norm_weight and k_norm_weight ([D] each, q's dtype): each head of q and of k is first
    RMS-normalised with them (`eps`), as Qwen3 does before RoPE.

    With v [T, Hkv, D], k_buf, v_buf [num_slots, Hkv, D] and loc [T]: also
    k_buf[loc[t]] = rotated k[t] and v_buf[loc[t]] = v[t] (cast to the pool's dtype; an FP8
    pool gets k / k_scale and v / v_scale).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    store = k_buf is not None
    if store and (v is None or v_buf is None or loc is None):
        raise ValueError("storing the KV needs v, k_buf, v_buf and loc")
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    assert head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0, "head_dim/2 must be a power of two"
    qk_norm = q_norm_weight is not None
    if qk_norm != (k_norm_weight is not None):
        raise ValueError("the q/k norm needs both q_norm_weight and k_norm_weight")
    if qk_norm:
        assert q_norm_weight.shape == k_norm_weight.shape == (head_dim,)
        assert q_norm_weight.is_contiguous() and k_norm_weight.is_contiguous()
    else:
        q_norm_weight = k_norm_weight = cos  # unused: QK_NORM is off
    if store:
        assert v.stride(2) == 1 and k_buf.stride(2) == 1 and v_buf.stride(2) == 1
        v_strides = (v.stride(0), v.stride(1))
        buf_strides = (k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1))
    else:
        v, k_buf, v_buf, loc = k, k, k, positions  # unused: STORE_KV is off
        v_strides, buf_strides = (0, 0), (0, 0, 0, 0)
    if num_tokens:
        _rope[(num_tokens,)](q, k, v, positions, cos, sin, k_buf, v_buf, loc, q_norm_weight, k_norm_weight,
                             q.stride(0), q.stride(1), k.stride(0), k.stride(1), *v_strides,
                             cos.stride(0), sin.stride(0), *buf_strides, num_q_heads, num_kv_heads,
                             float(k_scale), float(v_scale), float(eps), HALF=head_dim // 2,
                             BLOCK_H=triton.next_power_of_2(max(num_q_heads, num_kv_heads)),
                             STORE_KV=store, SCALED=store and is_fp8(k_buf), QK_NORM=qk_norm, num_warps=4)
    return q, k
