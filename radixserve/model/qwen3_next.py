"""Hybrid Qwen models: Qwen3-Next, Qwen3.5 / Qwen3.6 and Qwen3.5 / Qwen3.6-MoE, numerically like
transformers' Qwen3NextForCausalLM, Qwen3_5ForCausalLM and Qwen3_5MoeForCausalLM.

Each decoder layer mixes tokens with one of two layers, as config.json's `layer_types` says
(three linear for every full one in the published models):

- **Gated DeltaNet** (linear attention; radixserve.model.layers.gated_delta_net): no KV, a
  per-request recurrent state in the state pool (`batch.kv_pool.state`).
- **Gated attention**: GQA over the KV pool through the attention backend, with q|gate from one
  projection (per head: head_dim query values, then head_dim gate values), zero-centred RMSNorm
  over each q and k head, RoPE on the first `rotary_dim` values of each head (partial), and
  the output multiplied by sigmoid(gate) before o_proj. Only these layers have KV: the pool's
  layer index is the layer's index among them (`kv_layer_id`).

Every RMSNorm outside the linear layers is the zero-centred x * (1 + w) (OffsetRMSNorm); the MLP
is Qwen2's SiLU-gated one, or in the MoE sizes (`config.moe`) the routed experts plus a shared
expert with its sigmoid gate (radixserve.model.layers.moe, picked per layer by
radixserve.model.qwen2.make_mlp: Qwen3-Next by decoder_sparse_step / mlp_only_layers, Qwen3.5-MoE
every layer). Under tensor parallelism both token mixers split their heads (query and KV heads;
key heads with their value-head groups), the MLPs their intermediate columns (every expert
sliced), the vocabulary its rows, as for Qwen2 (radixserve.model.qwen2).

Not served (refused by name where config.json or the request could ask for it): FP8 weights, the
vision tower (images and videos), multi-token-prediction heads (their `mtp.*` tensors are not
read). Qwen3.5's multimodal RoPE is plain RoPE for text (the same position on all three axes).

Prefix reuse: a request's recurrent state cannot be rebuilt from KV, so the prefix cache keeps
snapshots of it (radixserve.cache.stores.snapshots) and copies the one a cached prefix ends at into
the request's row; the layers then continue that row's state as they continue a chunk's.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from radixserve.attention.base import AttentionBackend, ForwardBatch
from radixserve.distributed import SingleRank, TensorParallel, head_shard, vocab_shard
from radixserve.model.config import ModelConfig
from radixserve.model.hybrid_config import LINEAR_ATTENTION, HybridConfig
from radixserve.model.layers import KernelChoice, Linear
from radixserve.model.layers.gated_delta_net import GatedDeltaNet, LinearAttentionBatch, LinearHeads
from radixserve.model.layers.norm import OffsetRMSNorm
from radixserve.model.layers.parallel import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                              VocabParallelEmbedding)
from radixserve.model.layers.rotary import PartialRotaryEmbedding
from radixserve.model.qwen2 import make_mlp
from radixserve.model.quantization import Fp8Config


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, kv_layer_id: int, attn_backend: AttentionBackend,
                 rotary_emb: PartialRotaryEmbedding, *, dtype: torch.dtype, kernels: KernelChoice, tp: TensorParallel):
        super().__init__()
        self.kv_layer_id = kv_layer_id
        self.head_dim = d = config.head_dim
        heads = head_shard(config.num_attention_heads, config.num_key_value_heads, tp.size, tp.rank)
        self.num_heads, self.num_kv_heads = heads.num_q, heads.num_kv
        self.q_size, self.kv_size = heads.num_q * d, heads.num_kv * d
        kv_rows = (heads.kv_start * d, self.kv_size)
        # q_proj's rows are [query | gate] per head: this rank's heads are one run of 2 * d rows each.
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, {"q": (heads.q_start * 2 * d, 2 * self.q_size), "k": kv_rows, "v": kv_rows},
            bias=False, dtype=dtype, kernels=kernels)
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, start=heads.q_start * d, dtype=dtype,
                                        kernels=kernels, tp=tp)
        self.q_norm = OffsetRMSNorm(d, config.rms_norm_eps, dtype=dtype, kernels=kernels)
        self.k_norm = OffsetRMSNorm(d, config.rms_norm_eps, dtype=dtype, kernels=kernels)
        object.__setattr__(self, "_backend", attn_backend)  # shared, not submodules (see Qwen2Attention)
        object.__setattr__(self, "_rotary_emb", rotary_emb)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj.forward(x)
        t, d = qkv.shape[0], self.head_dim
        q_gate = qkv[:, :2 * self.q_size].view(t, self.num_heads, 2 * d)
        gate = q_gate[..., d:]
        k = qkv[:, 2 * self.q_size:2 * self.q_size + self.kv_size]
        v = qkv[:, 2 * self.q_size + self.kv_size:].view(t, self.num_kv_heads, d)
        q = self.q_norm.forward(q_gate[..., :d].reshape(-1, d)).view(t, self.num_heads, d)
        k = self.k_norm.forward(k.reshape(-1, d)).view(t, self.num_kv_heads, d)
        q, k = self._rotary_emb.forward(batch.positions, q, k)
        out = self._backend.forward(q, k, v, self.kv_layer_id, batch)
        out = out * torch.sigmoid(gate.reshape(t, self.q_size))
        return self.o_proj.forward(out)


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, attn_backend: AttentionBackend,
                 rotary_emb: PartialRotaryEmbedding, *, dtype: torch.dtype, kernels: KernelChoice, tp: TensorParallel):
        super().__init__()
        hybrid: HybridConfig = config.hybrid
        kind = hybrid.layer_types[layer_id]
        self.is_linear = kind == LINEAR_ATTENTION
        ordinal = hybrid.layer_types[:layer_id].count(kind)  # its index among the layers of its kind
        if self.is_linear:
            full = LinearHeads(hybrid.linear_num_k_heads, hybrid.linear_num_v_heads, 0, hybrid.linear_k_head_dim,
                               hybrid.linear_v_head_dim)
            self.linear_attn = GatedDeltaNet(config.hidden_size, full, hybrid.conv_kernel, config.rms_norm_eps, ordinal,
                                             dtype=dtype, kernels=kernels, tp=tp)
        else:
            self.self_attn = GatedAttention(config, ordinal, attn_backend, rotary_emb, dtype=dtype, kernels=kernels,
                                            tp=tp)
        self.mlp = make_mlp(config, layer_id, dtype=dtype, kernels=kernels, tp=tp)
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, kernels=kernels)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype,
                                                      kernels=kernels)

    def forward(self, h: torch.Tensor, residual: Optional[torch.Tensor], batch: ForwardBatch,
                linear: Optional[LinearAttentionBatch]) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = h
            normed = self.input_layernorm.forward(h)
        else:
            normed, residual = self.input_layernorm.forward(h, residual)
        if self.is_linear:
            mixed = self.linear_attn.forward(normed, batch, linear)
        else:
            mixed = self.self_attn.forward(normed, batch)
        normed, residual = self.post_attention_layernorm.forward(mixed, residual)
        return self.mlp.forward(normed), residual


class HybridModel(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, rotary_emb: PartialRotaryEmbedding, *,
                 dtype: torch.dtype, kernels: KernelChoice, tp: TensorParallel):
        super().__init__()
        start, rows, real = vocab_shard(config.vocab_size, tp.size, tp.rank)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, start=start, rows=rows,
                                                   real=real, dtype=dtype, tp=tp)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(config, i, attn_backend, rotary_emb, dtype=dtype, kernels=kernels, tp=tp)
            for i in range(config.num_hidden_layers))
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, kernels=kernels)
        self.kernels = kernels

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        pool = batch.kv_pool.state
        linear = None
        if pool is not None:
            linear = LinearAttentionBatch.of(batch, pool.scratch_row, triton=self.kernels.triton)
        elif any(layer.is_linear for layer in self.layers):
            raise RuntimeError("a hybrid model's KV pool needs its recurrent state pool (kv_pool.state)")
        h = self.embed_tokens(batch.input_ids)
        residual: Optional[torch.Tensor] = None
        for layer in self.layers:
            h, residual = layer.forward(h, residual, batch, linear)
        rows = batch.logits_indices
        h, _ = self.norm.forward(h[rows], residual[rows])
        return h


class Qwen3NextForCausalLM(nn.Module):
    """Built and loaded like Qwen2ForCausalLM (parameters uninitialised on `device` until
    `load_model` fills them; checkpoint names are transformers', fused where
    `packed_modules_mapping` says). The engine reads `config`, `local_heads` (this rank's
    attention heads), `kv_cache_scales` (one pair per full-attention layer), `fp8` (None) and
    `attn_backend`, and sizes the state pool from `recurrent_state_shape`."""

    # Qwen3-Next's layout of the linear layers' projection (in_proj_qkvz / in_proj_ba).
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
        "in_proj_qkvz": ("in_proj", "qkvz"),
        "in_proj_ba": ("in_proj", "ba"),
    }
    # An FP8 KV cache runs with scales 1.0 (no hybrid checkpoint publishes KV scales).
    kv_scale_pattern = None
    # The config's projection_layout this class loads (radixserve.model.hybrid_config).
    expected_layout = "qkvz"

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_positions: Optional[int] = None,
                 kernels: Optional[KernelChoice] = None, tp: Optional[TensorParallel] = None,
                 fp8: Optional[Fp8Config] = None):
        super().__init__()
        if config.hybrid is None:
            raise ValueError(f"{type(self).__name__} needs a hybrid config (layer_types and the linear-attention "
                             "shapes)")
        if fp8 is not None:
            raise ValueError(f"FP8 weights are not supported for {config.architecture} yet")
        expected = self.expected_layout
        if config.hybrid.projection_layout != expected:
            raise ValueError(f"{type(self).__name__} reads the {expected!r} projection layout, the config says "
                             f"{config.hybrid.projection_layout!r}")
        self.config = config
        self.tp = tp if tp is not None else SingleRank(device)
        self.fp8 = None
        self.kv_cache_scales: list[tuple[float, float]] = [(1.0, 1.0)] * config.num_kv_layers
        object.__setattr__(self, "attn_backend", attn_backend)
        self.dtype = dtype
        self.kernels = kernels if kernels is not None else KernelChoice.for_device(device, dtype)
        n_pos = max(max_positions or 0, config.max_position_embeddings)
        rotary_emb = PartialRotaryEmbedding(config.hybrid.rotary_dim, n_pos, config.rope_theta, dtype=dtype,
                                            device=device)
        with torch.device("meta"):
            self.model = HybridModel(config, attn_backend, rotary_emb, dtype=dtype, kernels=self.kernels, tp=self.tp)
            self.lm_head: Optional[Linear] = None
            if not config.tie_word_embeddings:
                self.lm_head = self._lm_head()
        self.to_empty(device=device)
        self.model.rotary_emb = rotary_emb  # after to_empty, which would empty its tables
        if self.lm_head is None:
            self.lm_head = self._lm_head(weight=self.model.embed_tokens.weight)
        attn = next(layer.self_attn for layer in self.model.layers if not layer.is_linear)
        self.local_heads = (attn.num_heads, attn.num_kv_heads)
        linear = [layer.linear_attn for layer in self.model.layers if layer.is_linear]
        # One pool row per request holds, per linear layer, this shape (radixserve.cache.state_pool).
        self.recurrent_state_shape: Optional[dict] = None
        if linear:
            h = linear[0].heads
            self.recurrent_state_shape = dict(num_layers=len(linear), conv_shape=(config.hybrid.conv_kernel - 1,
                                                                                   h.conv_dim),
                                              ssm_shape=(h.num_v, h.k_head_dim, h.v_head_dim), conv_dtype=dtype)

    def _lm_head(self, weight: Optional[nn.Parameter] = None) -> Linear:
        cfg = self.config
        start, rows, real = vocab_shard(cfg.vocab_size, self.tp.size, self.tp.rank)
        return ParallelLMHead(cfg.hidden_size, cfg.vocab_size, start=start, rows=rows, real=real, dtype=self.dtype,
                              kernels=self.kernels, tp=self.tp, weight=weight)

    @property
    def max_positions(self) -> int:
        return self.model.rotary_emb.max_positions

    @staticmethod
    def checkpoint_name(name: str) -> Optional[str]:
        """The parameter a checkpoint tensor fills, by transformers' name; None: not ours (the
        multi-token-prediction head)."""
        return None if name.startswith("mtp.") else name

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in fp32 for the selected token rows."""
        self.attn_backend.init_forward(batch)
        logits = self.lm_head.forward(self.model.forward(batch))
        if batch.logits_out is None:
            return logits.float()
        return batch.logits_out.copy_(logits)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 / Qwen3.6 dense: Qwen3-Next's layers with the linear projection stored split
    (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)."""

    packed_modules_mapping = {
        **{k: v for k, v in Qwen3NextForCausalLM.packed_modules_mapping.items() if not k.startswith("in_proj")},
        "in_proj_qkv": ("in_proj", "qkv"),
        "in_proj_z": ("in_proj", "z"),
        "in_proj_b": ("in_proj", "b"),
        "in_proj_a": ("in_proj", "a"),
    }
    expected_layout = "split"


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The language model of a Qwen3.5 / Qwen3.6 multimodal checkpoint: its tensors are under
    `model.language_model.`; the vision tower (`model.visual.`) is not loaded."""

    @staticmethod
    def checkpoint_name(name: str) -> Optional[str]:
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model."):]
        if name.startswith(("model.visual.", "mtp.")):
            return None
        return name


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5 / Qwen3.6-MoE (35B-A3B, ...): Qwen3.5's layers with a sparse MoE block in every
    layer (`mlp.gate`, `mlp.experts.{e}.*`, `mlp.shared_expert.*`, `mlp.shared_expert_gate`)."""


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    """The language model of a Qwen3.5 / Qwen3.6-MoE multimodal checkpoint (see
    Qwen3_5ForConditionalGeneration)."""
