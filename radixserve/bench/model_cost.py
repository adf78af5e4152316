"""Bytes and FLOPs of a Qwen2 or Qwen3 dense shape, per GPU: the floors `bench_one_batch` compares against."""

from __future__ import annotations

from dataclasses import dataclass

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
    def layer_projection_params(self) -> int:
        """Weights of one layer's projections (q|k|v, o, gate|up, down)."""
        c = self.cfg
        q, kv = self.local_heads * c.head_dim, self.local_kv_heads * c.head_dim
        return c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * (c.intermediate_size // self.tp)

    @property
    def layer_params(self) -> int:
        """One layer's projections, q|k|v bias (Qwen2), q and k norms (Qwen3: head_dim each,
        replicated) and the two RMSNorms."""
        c = self.cfg
        q, kv = self.local_heads * c.head_dim, self.local_kv_heads * c.head_dim
        bias = (q + 2 * kv) if c.qkv_bias else 0
        qk_norms = 2 * c.head_dim if c.qk_norm else 0
        return self.layer_projection_params + bias + qk_norms + 2 * c.hidden_size

    @property
    def matmul_params(self) -> int:
        """Parameters multiplied per token in the layers (no embedding, no lm_head)."""
        return self.cfg.num_hidden_layers * self.layer_params

    @property
    def decode_weight_bytes(self) -> int:
        """Weights read per decode step: all layers, final norm, lm_head (the embedding is gathered)."""
        c = self.cfg
        projections = c.num_hidden_layers * self.layer_projection_params
        rest = self.matmul_params - projections + c.hidden_size + self.local_vocab * c.hidden_size
        scales = 0
        if self.weight_elem == 1:  # a float32 scale per output row of every projection
            q, kv = self.local_heads * c.head_dim, self.local_kv_heads * c.head_dim
            rows = (q + 2 * kv) + c.hidden_size + 2 * (c.intermediate_size // self.tp) + c.hidden_size
            scales = c.num_hidden_layers * rows * 4
        return projections * self.weight_elem + rest * self.elem + scales

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
        """This GPU's weight and live KV bytes over its memory bandwidth, plus (tensor parallel) its
        collectives' bytes over the NVLink bandwidth (bytes/s, one direction)."""
        ms = (self.decode_weight_bytes + batch * ctx * self.kv_bytes_per_token) / bandwidth * 1e3
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
        linear = 2.0 * self.matmul_params * batch * length
        attn = c.num_hidden_layers * batch * self.attention_flops_layer(0, length)
        lm_head = 2.0 * c.hidden_size * self.local_vocab * batch  # logits of the last token only
        return linear + attn + lm_head
