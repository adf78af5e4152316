"""Rotary embedding (Hugging Face's rotate-half layout) applied to q and k in place, one launch.

cos/sin are the model's tables [max_positions, head_dim] (each half repeated, as
`radixserve.model.qwen2.rope_cos_sin` builds them); the rotation is computed in float32 and
rounded once to q's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(Q, K, positions, Cos, Sin, stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
                 num_q_heads, num_kv_heads,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr):
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
    tl.store(q_ptr, (q1 * cos[None, :] - q2 * sin[None, :]).to(Q.dtype.element_ty), mask=mq)
    tl.store(q_ptr + HALF, (q2 * cos[None, :] + q1 * sin[None, :]).to(Q.dtype.element_ty), mask=mq)

    mk = heads[:, None] < num_kv_heads
    k_ptr = K + t * stride_kt + heads[:, None] * stride_kh + offs[None, :]
    k1 = tl.load(k_ptr, mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptr + HALF, mask=mk, other=0.0).to(tl.float32)
    tl.store(k_ptr, (k1 * cos[None, :] - k2 * sin[None, :]).to(K.dtype.element_ty), mask=mk)
    tl.store(k_ptr + HALF, (k2 * cos[None, :] + k1 * sin[None, :]).to(K.dtype.element_ty), mask=mk)


def apply_rope_(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (views into a fused qkv are fine) at
    `positions` [T]; cos/sin [max_positions, D]. Returns (q, k)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    assert head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0, "head_dim/2 must be a power of two"
    if num_tokens:
        _rope_kernel[(num_tokens,)](q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                    cos.stride(0), sin.stride(0), num_q_heads, num_kv_heads,
                                    HALF=head_dim // 2, BLOCK_H=triton.next_power_of_2(max(num_q_heads, num_kv_heads)),
                                    num_warps=4)
    return q, k
