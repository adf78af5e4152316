"""Rotary position embedding (transformers' rotate-half layout) over tables shared by all layers."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from radixserve.model.layers.kernel_choice import KernelChoice
from radixserve.model.layers.norm import RMSNorm


def rope_cos_sin(max_positions: int, head_dim: int, theta: float, device: torch.device | str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, head_dim] in fp32, each half repeated (HF's rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.int64, device=device).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D], cos/sin [T, D]; new tensors."""
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class RotaryEmbedding(nn.Module):
    """Rotates q and k at their positions, and where the kernel can, stores k and v in the KV pool
    in the same launch.

    `forward(positions, q, k, v=, k_buf=, v_buf=, loc=)` returns (q, k, stored). Triton: q and k
    (views into the fused qkv output are fine) are rotated in place and k, v written to
    k_buf/v_buf at slots `loc` by the same launch, so stored is True and the attention backend
    only attends (an FP8 pool gets k / k_scale, v / v_scale: `kv_scales`). Torch: new rotated
    tensors, stored is False (the backend stores them).

    `qk_norm=(q_norm, k_norm)` (Qwen3): each head of q and of k is first normalised by these
    RMSNorms over its head_dim values. Triton: inside the same launch, in place (no copy of the
    strided q and k views, no launch of its own); torch: the norms on [tokens * heads, head_dim]
    rows, then the rotation.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, *, dtype: torch.dtype,
                 device: torch.device | str, kernels: KernelChoice):
        super().__init__()
        cos, sin = rope_cos_sin(max_positions, head_dim, theta, device)
        # HF computes cos/sin in fp32 and casts them to the activation dtype before rotating.
        self.register_buffer("cos", cos.to(dtype), persistent=False)
        self.register_buffer("sin", sin.to(dtype), persistent=False)
        self._triton_rope = None
        if kernels.triton:
            from radixserve.kernels.rope import apply_rope_

            self._triton_rope = apply_rope_

    @property
    def max_positions(self) -> int:
        return int(self.cos.shape[0])

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *, v: Optional[torch.Tensor] = None,
                k_buf: Optional[torch.Tensor] = None, v_buf: Optional[torch.Tensor] = None,
                loc: Optional[torch.Tensor] = None, kv_scales: tuple[float, float] = (1.0, 1.0),
                qk_norm: Optional[tuple[RMSNorm, RMSNorm]] = None) -> tuple[torch.Tensor, torch.Tensor, bool]:
        if self._triton_rope is not None:
            norm_weights = {}
            if qk_norm is not None:
                q_norm, k_norm = qk_norm
                norm_weights = dict(q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight, eps=q_norm.eps)
            self._triton_rope(q, k, positions, self.cos, self.sin, v=v, k_buf=k_buf, v_buf=v_buf, loc=loc,
                              k_scale=kv_scales[0], v_scale=kv_scales[1], **norm_weights)
            return q, k, k_buf is not None
        if qk_norm is not None:
            (t, hq, d), hkv = q.shape, k.shape[1]
            q = qk_norm[0].forward(q.reshape(-1, d)).view(t, hq, d)
            k = qk_norm[1].forward(k.reshape(-1, d)).view(t, hkv, d)
        q, k = apply_rope(q, k, self.cos[positions], self.sin[positions])
        return q, k, False


class PartialRotaryEmbedding(nn.Module):
    """RoPE on the first `rotary_dim` values of each head only (rotate-half within them; the rest
    pass through), as Qwen3-Next and Qwen3.5 apply it (partial_rotary_factor 0.25: 64 of 256).
    Torch ops on every device, new tensors: q [T, Hq, D], k [T, Hkv, D]."""

    def __init__(self, rotary_dim: int, max_positions: int, theta: float, *, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.rotary_dim = rotary_dim
        cos, sin = rope_cos_sin(max_positions, rotary_dim, theta, device)
        self.register_buffer("cos", cos.to(dtype), persistent=False)
        self.register_buffer("sin", sin.to(dtype), persistent=False)

    @property
    def max_positions(self) -> int:
        return int(self.cos.shape[0])

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.rotary_dim
        q_rot, k_rot = apply_rope(q[..., :r], k[..., :r], self.cos[positions], self.sin[positions])
        if r == q.shape[-1]:
            return q_rot, k_rot
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
