"""Bytes and FLOPs of a Qwen2, Qwen3 or mixture-of-experts (Qwen3-MoE, Qwen2-MoE) shape, per GPU: the
floors `bench_one_batch` compares against. A mixture of experts' decode step reads the experts its
batch touches (expected under uniform routing), its prefill multiplies each token by its top-k."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from radixserve.model.config import ModelConfig


@dataclass
class ModelCost:
    """Bytes and FLOPs of the model's shape (bf16) on one GPU; with `tp` > 1, of one rank's shard
    (its query heads, its KV heads, replicated when there are fewer than ranks, its MLP columns
    and vocabulary rows) and of the collectives that join the ranks. `weight_elem`: bytes per
    projection weight (1: FP8, plus a float32 scale per output row); `kv_elem`: bytes per KV
    value (1: an FP8 KV cache); `elem`: everything else (norms, biases, lm_head, activations)."""

    cfg: ModelConfig
    elem: int = 2
    tp: int = 1
    weight_elem: int = 2
    kv_elem: int = 2

    @property
    def local_heads(self) -> int:
        return self.cfg.num_attention_heads // self.tp

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.cfg.num_key_value_heads // self.tp)

    @property
    def local_vocab(self) -> int:
        return -(-self.cfg.vocab_size // self.tp)

    @property
    def attention_projection_params(self) -> int:
        """Weights of one layer's q|k|v and o projections."""
        c = self.cfg
        q, kv = self.local_heads * c.head_dim, self.local_kv_heads * c.head_dim
        return c.hidden_size * (q + 2 * kv) + q * c.hidden_size

    @property
    def layer_projection_params(self) -> int:
        """Weights of one dense layer's projections (q|k|v, o, gate|up, down)."""
        c = self.cfg
        return self.attention_projection_params + 3 * c.hidden_size * (c.intermediate_size // self.tp)

    def mlp_projection_params(self, layer: int, experts: Optional[float] = None) -> float:
        """Layer `layer`'s MLP projection weights: the dense MLP's, or (a sparse layer) `experts`
        routed experts (default all of them) plus the shared expert; the router's gates are not
        projections (they stay in bf16 under FP8, see `layer_other_params`)."""
        c = self.cfg
        h = c.hidden_size
        if not c.is_sparse_layer(layer):
            return 3 * h * (c.intermediate_size // self.tp)
        moe = c.moe
        n = moe.num_experts if experts is None else experts
        return n * 3 * h * (moe.moe_intermediate_size // self.tp) + \
            3 * h * (moe.shared_expert_intermediate_size // self.tp)

    def layer_other_params(self, layer: int) -> int:
        """Layer `layer`'s weights besides its projections: q|k|v bias (Qwen2), q and k norms (Qwen3:
        head_dim each, replicated), the two RMSNorms, and a sparse layer's router gate (experts x
        hidden) and shared-expert gate (hidden), replicated."""
        c = self.cfg
        q, kv = self.local_heads * c.head_dim, self.local_kv_heads * c.head_dim
        bias = (q + 2 * kv) if c.qkv_bias else 0
        qk_norms = 2 * c.head_dim if c.qk_norm else 0
        gates = 0
        if c.is_sparse_layer(layer):
            gates = c.moe.num_experts * c.hidden_size + (c.hidden_size if c.moe.shared_expert_intermediate_size else 0)
        return bias + qk_norms + 2 * c.hidden_size + gates

    @property
    def layer_params(self) -> int:
        """One dense layer's weights (layer 0's for a model without experts)."""
        return self.layer_projection_params + self.layer_other_params(-1)

    @property
    def matmul_params(self) -> int:
        """Parameters of the layers (no embedding, no lm_head, no final norm), every expert counted."""
        return sum(int(self.attention_projection_params + self.mlp_projection_params(i)) + self.layer_other_params(i)
                   for i in range(self.cfg.num_hidden_layers))

    @property
    def active_params(self) -> int:
        """Parameters of the layers one token multiplies: a sparse layer's top-k experts only."""
        c = self.cfg
        top_k = c.moe.top_k if c.moe is not None else None
        return sum(int(self.attention_projection_params + self.mlp_projection_params(i, top_k))
                   + self.layer_other_params(i) for i in range(c.num_hidden_layers))

    def touched_experts(self, batch: int) -> float:
        """Experts a decode batch of `batch` tokens reads per sparse layer, expected under uniform
        routing (each token picks top_k of the experts): E x (1 - (1 - k/E)^batch)."""
        moe = self.cfg.moe
        if moe is None or moe.num_experts == 0:
            return 0.0
        e = moe.num_experts
        return e * (1.0 - (1.0 - moe.top_k / e) ** batch)

    def decode_weight_bytes_at(self, batch: Optional[int]) -> float:
        """Weights read per decode step of `batch` tokens: every layer (a sparse layer's experts
        the batch touches, `touched_experts`; None: all of them), final norm, lm_head (the
        embedding is gathered); FP8 projections one byte a weight and a float32 scale per output
        row, the gates in bf16."""
        c = self.cfg
        experts = None if batch is None or c.moe is None else self.touched_experts(batch)
        q, kv = self.local_heads * c.head_dim, self.local_kv_heads * c.head_dim
        projections = other = scale_rows = 0.0
        for i in range(c.num_hidden_layers):
            projections += self.attention_projection_params + self.mlp_projection_params(i, experts)
            other += self.layer_other_params(i)
            scale_rows += (q + 2 * kv) + c.hidden_size
            if c.is_sparse_layer(i):
                moe = c.moe
                n = moe.num_experts if experts is None else experts
                scale_rows += n * (2 * (moe.moe_intermediate_size // self.tp) + c.hidden_size)
                if moe.shared_expert_intermediate_size:
                    scale_rows += 2 * (moe.shared_expert_intermediate_size // self.tp) + c.hidden_size
            else:
                scale_rows += 2 * (c.intermediate_size // self.tp) + c.hidden_size
        rest = other + c.hidden_size + self.local_vocab * c.hidden_size
        scales = scale_rows * 4 if self.weight_elem == 1 else 0
        return projections * self.weight_elem + rest * self.elem + scales

    @property
    def decode_weight_bytes(self) -> int:
        """Weights a decode step reads when it touches every expert (a dense model: always)."""
        return int(self.decode_weight_bytes_at(None))

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.cfg
        return 2 * c.num_hidden_layers * self.local_kv_heads * c.head_dim * self.kv_elem

    def kv_bytes_per_token_layer(self) -> int:
        return self.kv_bytes_per_token // self.cfg.num_hidden_layers

    def decode_collective_bytes(self, batch: int) -> float:
        """Bytes each GPU sends in one decode step's collectives, as ring algorithms move them:
        2 x layers + 1 all-reduces of [batch, hidden] (2 (N-1)/N of the message each: o_proj,
        down_proj, the embedding) and the all-gather of [batch, vocab] logits ((N-1)/N of it)."""
        n = self.tp
        if n == 1:
            return 0.0
        c = self.cfg
        all_reduce = (2 * c.num_hidden_layers + 1) * batch * c.hidden_size * self.elem * 2 * (n - 1) / n
        all_gather = batch * self.local_vocab * n * self.elem * (n - 1) / n
        return all_reduce + all_gather

    def decode_floor_ms(self, batch: int, ctx: int, bandwidth: float, link_bandwidth: float) -> float:
        """This GPU's weight (of a mixture of experts, the experts the batch touches) and live KV
        bytes over its memory bandwidth, plus (tensor parallel) its collectives' bytes over the
        NVLink bandwidth (bytes/s, one direction)."""
        ms = (self.decode_weight_bytes_at(batch) + batch * ctx * self.kv_bytes_per_token) / bandwidth * 1e3
        if self.tp > 1:
            ms += self.decode_collective_bytes(batch) / link_bandwidth * 1e3
        return ms

    def attention_flops_layer(self, prefix: int, extend: int) -> float:
        """QK^T and PV FLOPs of one layer for `extend` new tokens over `prefix` cached + causal."""
        c = self.cfg
        pairs = extend * prefix + extend * (extend + 1) / 2
        return 4.0 * self.local_heads * c.head_dim * pairs

    def prefill_flops(self, batch: int, length: int) -> float:
        c = self.cfg
        linear = 2.0 * self.active_params * batch * length
        attn = c.num_hidden_layers * batch * self.attention_flops_layer(0, length)
        lm_head = 2.0 * c.hidden_size * self.local_vocab * batch  # logits of the last token only
        return linear + attn + lm_head
