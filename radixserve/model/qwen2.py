"""Qwen2 / Qwen2.5 forward pass over a ragged ForwardBatch, numerically like transformers' Qwen2.

Parameters are fused where the math allows (q|k|v rows in `qkv_proj`, gate|up rows in
`gate_up_proj`) so each layer runs two matmuls fewer; the loader maps HF names into them.
Attention itself (and the KV cache) belongs to the attention backend passed in.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.attention.base import AttentionBackend, ForwardBatch
from radixserve.model.config import ModelConfig

# Rows up to which the fused path runs projections through radixserve.kernels.decode_linear:
# faster than cuBLAS up to 32 rows on an H200; at 64, cuBLAS won on most projections
# (docs/gpu_notes.md, "A GEMM for decode rows").
DECODE_GEMM_MAX_ROWS = 32


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same order of operations as HF: normalise in fp32, cast back, then scale.
        input_dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(input_dtype)


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
    """q [T, Hq, D], k [T, Hkv, D], cos/sin [T, D]."""
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class Qwen2Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, attn_backend: AttentionBackend, *, dtype: torch.dtype):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=True, dtype=dtype)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False, dtype=dtype)
        # A plain attribute, never a submodule (even if a backend is an nn.Module): the backend is
        # shared by all layers and its state must survive the model's meta -> device move.
        object.__setattr__(self, "_backend", attn_backend)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, k, cos, sin)
        out = self._backend.forward(q, k, v, self.layer_id, batch)
        return self.o_proj(out.reshape(t, self.q_size))

    def forward_fused(self, x: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                      batch: ForwardBatch, kernels) -> torch.Tensor:
        """The same function with RoPE applied in place on views of the qkv output, and k and v
        stored into the KV pool by the same launch."""
        t = x.shape[0]
        qkv = kernels.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        pool = batch.kv_pool
        kernels.apply_rope_(q, k, batch.positions, cos_table, sin_table, v=v, k_buf=pool.k_buffers[self.layer_id],
                            v_buf=pool.v_buffers[self.layer_id], loc=batch.out_cache_loc)
        out = self._backend.forward(q, k, v, self.layer_id, batch, save_kv=False)
        return kernels.linear(out.reshape(t, self.q_size), self.o_proj.weight)


class Qwen2MLP(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor, kernels) -> torch.Tensor:
        return kernels.linear(kernels.linear(x, self.gate_up_proj.weight, silu_mul=True), self.down_proj.weight)


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, attn_backend: AttentionBackend, *, dtype: torch.dtype):
        super().__init__()
        self.self_attn = Qwen2Attention(config, layer_id, attn_backend, dtype=dtype)
        self.mlp = Qwen2MLP(config, dtype=dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, h: torch.Tensor, residual: Optional[torch.Tensor], cos_table: torch.Tensor,
                      sin_table: torch.Tensor, batch: ForwardBatch, kernels
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output not yet added to the residual, the residual stream).

        The residual add of each sub-block is fused into the next RMSNorm (this layer's
        post-attention norm, the next layer's input norm, or the final norm), so a layer runs
        two norm launches and no separate add. Same rounding as `forward`: x + residual is
        rounded to the activation dtype before it is normalised.
        """
        if residual is None:
            residual = h
            normed = kernels.rms_norm(h, self.input_layernorm.weight, self.input_layernorm.eps)
        else:
            normed, residual = kernels.add_rms_norm(h, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        a = self.self_attn.forward_fused(normed, cos_table, sin_table, batch, kernels)
        normed, residual = kernels.add_rms_norm(a, residual, self.post_attention_layernorm.weight,
                                                self.post_attention_layernorm.eps)
        return self.mlp.forward_fused(normed, kernels), residual


class Qwen2ForCausalLM(nn.Module):
    """Parameters are allocated uninitialised on `device`; `load_model` fills every one of them.

    Names follow HF's minus the fusions: `embed_tokens.weight`, `layers.{i}.self_attn.qkv_proj.*`,
    `layers.{i}.mlp.gate_up_proj.weight`, `norm.weight`, `lm_head.weight` (absent when tied).
    """

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_positions: Optional[int] = None,
                 fused_kernels: Optional[bool] = None):
        super().__init__()
        self.config = config
        object.__setattr__(self, "attn_backend", attn_backend)  # see Qwen2Attention._backend
        self.dtype = dtype
        # Built on the meta device, then given real (uninitialised) storage once: no time is spent
        # on random init that the weights would overwrite, and no CPU copy of a GPU model exists.
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
            self.layers = nn.ModuleList(
                Qwen2DecoderLayer(config, i, attn_backend, dtype=dtype) for i in range(config.num_hidden_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
            self.lm_head: Optional[nn.Linear] = None
            if not config.tie_word_embeddings:
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.to_empty(device=device)
        n_pos = max(max_positions or 0, config.max_position_embeddings)
        cos, sin = rope_cos_sin(n_pos, config.head_dim, config.rope_theta, device)
        # HF computes cos/sin in fp32 and casts them to the activation dtype before rotating.
        self.register_buffer("rope_cos", cos.to(dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(dtype), persistent=False)
        # None: the fused Triton kernels on CUDA in bf16/fp16, the pure-torch path elsewhere.
        # The torch path stays the reference (CPU, fp32) and can be forced with False.
        self._kernels: Optional[_FusedKernels] = None
        self._decode_gemm_max_rows = DECODE_GEMM_MAX_ROWS
        self.use_fused_kernels = fused_kernels

    @property
    def use_fused_kernels(self) -> bool:
        return self._kernels is not None

    @use_fused_kernels.setter
    def use_fused_kernels(self, value: Optional[bool]) -> None:
        device = self.rope_cos.device
        if value is None:
            value = device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16) and _triton_available()
        if value and device.type != "cuda":
            raise ValueError("the fused kernels need a CUDA device")
        self._kernels = _FusedKernels(self._decode_gemm_max_rows) if value else None

    @property
    def decode_gemm_max_rows(self) -> int:
        """On the fused path, projections of at most this many rows (decode batches) run the
        weight-streaming Triton GEMM (radixserve.kernels.decode_linear); larger ones, cuBLAS."""
        return self._decode_gemm_max_rows

    @decode_gemm_max_rows.setter
    def decode_gemm_max_rows(self, rows: int) -> None:
        self._decode_gemm_max_rows = rows
        if self._kernels is not None:
            self._kernels.max_rows = rows

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def max_positions(self) -> int:
        return int(self.rope_cos.shape[0])

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in fp32 for the selected token rows."""
        self.attn_backend.init_forward(batch)
        h = self.embed_tokens(batch.input_ids)
        if self._kernels is not None:
            return self._forward_fused(h, batch, self._kernels)
        cos = self.rope_cos[batch.positions]
        sin = self.rope_sin[batch.positions]
        for layer in self.layers:
            h = layer(h, cos, sin, batch)
        # The final norm and lm_head are row-wise: computing them only for the sampled rows saves
        # a [T, vocab] matmul on every prefill.
        h = self.norm(h[batch.logits_indices])
        return F.linear(h, self.lm_head_weight).float()

    def _forward_fused(self, h: torch.Tensor, batch: ForwardBatch, kernels) -> torch.Tensor:
        residual: Optional[torch.Tensor] = None
        for layer in self.layers:
            h, residual = layer.forward_fused(h, residual, self.rope_cos, self.rope_sin, batch, kernels)
        rows = batch.logits_indices
        h, _ = kernels.add_rms_norm(h[rows], residual[rows], self.norm.weight, self.norm.eps)
        return kernels.linear(h, self.lm_head_weight).float()


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class _FusedKernels:
    """The fused kernels, imported on first use (they import triton)."""

    def __init__(self, max_rows: int):
        from radixserve.kernels.activation import silu_and_mul
        from radixserve.kernels.decode_linear import decode_linear
        from radixserve.kernels.decode_linear_config import config_for
        from radixserve.kernels.norm import add_rms_norm, rms_norm
        from radixserve.kernels.rope import apply_rope_

        self.rms_norm = rms_norm
        self.add_rms_norm = add_rms_norm
        self.silu_and_mul = silu_and_mul
        self.apply_rope_ = apply_rope_
        self.decode_linear = decode_linear
        self.decode_linear_config = config_for
        self.max_rows = max_rows

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
               silu_mul: bool = False) -> torch.Tensor:
        """F.linear (then silu_and_mul if asked), through the weight-streaming GEMM for a decode
        batch's few rows."""
        if 0 < x.shape[0] <= self.max_rows and x.stride(-1) == 1:
            config = self.decode_linear_config(weight)
            if config is not None:
                return self.decode_linear(x, weight, bias, config, silu_mul=silu_mul)
        y = F.linear(x, weight, bias)
        return self.silu_and_mul(y) if silu_mul else y
