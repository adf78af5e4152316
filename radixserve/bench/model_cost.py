"""Bytes and FLOPs of a Qwen2, Qwen3, mixture-of-experts (Qwen3-MoE, Qwen2-MoE) or hybrid (Qwen3.5 /
3.6, Qwen3-Next, dense or MoE) shape, per GPU: the floors `bench_one_batch` compares against. A
mixture of experts' decode step reads the experts its batch touches (expected under uniform
routing), its prefill multiplies each token by its top-k. A hybrid's full-attention layers keep
KV; its linear-attention (Gated DeltaNet) layers keep a recurrent state per request instead, which
a decode step reads and writes once, and which its prefill computes in the chunked form
(`linear_attention_flops_layer`)."""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil
from typing import Optional

from radixserve.model.config import ModelConfig
from radixserve.model.hybrid_config import LINEAR_ATTENTION

# Tokens per chunk of the chunked Gated DeltaNet prefill (fla-core's chunk_gated_delta_rule and our
# torch reference, radixserve.model.layers.gated_delta.CHUNK_SIZE).
LINEAR_CHUNK = 64


@dataclass
class ModelCost:
    """Bytes and FLOPs of the model's shape (bf16) on one GPU; with `tp` > 1, of one rank's shard
    (its query heads, its KV heads, replicated when there are fewer than ranks, its MLP columns
    and vocabulary rows) and of the collectives that join the ranks. `weight_elem`: bytes per
    projection weight (1: FP8, plus a float32 scale per output row); `kv_elem`: bytes per KV
    value (1: an FP8 KV cache); `elem`: everything else (norms, biases, lm_head, activations, a
    hybrid's conv windows); `ssm_elem`: bytes per value of a hybrid's recurrent states (4: float32,
    the default of --mamba-ssm-dtype; 2: bfloat16)."""

    cfg: ModelConfig
    elem: int = 2
    tp: int = 1
    weight_elem: int = 2
    kv_elem: int = 2
    ssm_elem: int = 4

    @property
    def local_heads(self) -> int:
        return self.cfg.num_attention_heads // self.tp

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.cfg.num_key_value_heads // self.tp)

    @property
    def local_vocab(self) -> int:
        return -(-self.cfg.vocab_size // self.tp)

    def is_linear_layer(self, layer: int) -> bool:
        """Whether layer `layer` is a hybrid's linear-attention layer (else attention)."""
        h = self.cfg.hybrid
        return h is not None and 0 <= layer < len(h.layer_types) and h.layer_types[layer] == LINEAR_ATTENTION

    @property
    def q_rows(self) -> int:
        """Output rows of one attention layer's q projection on this GPU: a hybrid's gated attention
        writes each head's gate beside its query (2 x head_dim a head)."""
        q = self.local_heads * self.cfg.head_dim
        return 2 * q if self.cfg.hybrid is not None else q

    @property
    def attention_projection_params(self) -> int:
        """Weights of one attention layer's q|k|v and o projections."""
        c = self.cfg
        q, kv = self.local_heads * c.head_dim, self.local_kv_heads * c.head_dim
        return c.hidden_size * (self.q_rows + 2 * kv) + q * c.hidden_size

    @property
    def linear_dims(self) -> tuple[int, int, int]:
        """(value heads, key channels, value channels) of one linear-attention layer on this GPU
        (key heads and their value-head groups split over the ranks)."""
        h = self.cfg.hybrid
        num_k, num_v = h.linear_num_k_heads // self.tp, h.linear_num_v_heads // self.tp
        return num_v, num_k * h.linear_k_head_dim, num_v * h.linear_v_head_dim

    @property
    def linear_conv_channels(self) -> int:
        """Channels of a linear-attention layer's short convolution: q | k | v."""
        _, key, value = self.linear_dims
        return 2 * key + value

    @property
    def linear_in_rows(self) -> int:
        """Output rows of a linear-attention layer's input projection: q | k | v | z | b | a."""
        num_v, _, value = self.linear_dims
        return self.linear_conv_channels + value + 2 * num_v

    @property
    def linear_projection_params(self) -> int:
        """Weights of one linear-attention layer's in_proj and out_proj."""
        _, _, value = self.linear_dims
        return self.cfg.hidden_size * self.linear_in_rows + value * self.cfg.hidden_size

    def mixer_projection_params(self, layer: int) -> int:
        """Layer `layer`'s token mixer's projection weights: linear or full attention."""
        return self.linear_projection_params if self.is_linear_layer(layer) else self.attention_projection_params

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
        """Layer `layer`'s weights besides its projections: q|k|v bias (Qwen2), q and k norms (Qwen3
        and the hybrids' attention: head_dim each, replicated), or a linear-attention layer's conv
        weights (channels x kernel), A_log and dt_bias (one per value head) and gated norm
        (v_head_dim, replicated); the two RMSNorms; and a sparse layer's router gate (experts x
        hidden) and shared-expert gate (hidden), replicated."""
        c = self.cfg
        gates = 0
        if c.is_sparse_layer(layer):
            gates = c.moe.num_experts * c.hidden_size + (c.hidden_size if c.moe.shared_expert_intermediate_size else 0)
        if self.is_linear_layer(layer):
            h = c.hybrid
            num_v, _, _ = self.linear_dims
            mixer = self.linear_conv_channels * h.conv_kernel + 2 * num_v + h.linear_v_head_dim
        else:
            q, kv = self.local_heads * c.head_dim, self.local_kv_heads * c.head_dim
            bias = (q + 2 * kv) if c.qkv_bias else 0
            mixer = bias + (2 * c.head_dim if c.qk_norm or c.hybrid is not None else 0)
        return mixer + 2 * c.hidden_size + gates

    @property
    def layer_params(self) -> int:
        """One dense layer's weights (layer 0's for a model without experts)."""
        return self.layer_projection_params + self.layer_other_params(-1)

    @property
    def matmul_params(self) -> int:
        """Parameters of the layers (no embedding, no lm_head, no final norm), every expert counted."""
        return sum(int(self.mixer_projection_params(i) + self.mlp_projection_params(i)) + self.layer_other_params(i)
                   for i in range(self.cfg.num_hidden_layers))

    @property
    def active_params(self) -> int:
        """Parameters of the layers one token multiplies: a sparse layer's top-k experts only."""
        c = self.cfg
        top_k = c.moe.top_k if c.moe is not None else None
        return sum(int(self.mixer_projection_params(i) + self.mlp_projection_params(i, top_k))
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
        kv = self.local_kv_heads * c.head_dim
        projections = other = scale_rows = 0.0
        for i in range(c.num_hidden_layers):
            projections += self.mixer_projection_params(i) + self.mlp_projection_params(i, experts)
            other += self.layer_other_params(i)
            scale_rows += (self.linear_in_rows if self.is_linear_layer(i) else self.q_rows + 2 * kv) + c.hidden_size
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
        """K and V of one token in every layer that keeps KV (a hybrid's full-attention layers)."""
        c = self.cfg
        return 2 * c.num_kv_layers * self.local_kv_heads * c.head_dim * self.kv_elem

    def kv_bytes_per_token_layer(self) -> int:
        return self.kv_bytes_per_token // max(1, self.cfg.num_kv_layers)

    @property
    def state_bytes_per_request(self) -> int:
        """A request's recurrent states in every linear-attention layer (0 without any): the conv
        window ((kernel - 1) x channels, in the model's dtype) and the state (value heads x
        k_head_dim x v_head_dim, in ssm_elem bytes), as radixserve.cache.state_pool holds them."""
        h = self.cfg.hybrid
        if h is None or not h.num_linear_layers:
            return 0
        num_v, _, _ = self.linear_dims
        conv = (h.conv_kernel - 1) * self.linear_conv_channels * self.elem
        ssm = num_v * h.linear_k_head_dim * h.linear_v_head_dim * self.ssm_elem
        return h.num_linear_layers * (conv + ssm)

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

    def decode_bytes(self, batch: int, ctx: int) -> float:
        """Bytes one decode step of `batch` requests at context `ctx` moves at the least: the weights
        (of a mixture of experts, the experts the batch touches), the live KV of the layers that
        keep it, and each request's recurrent states read and written once (a hybrid's)."""
        return (self.decode_weight_bytes_at(batch) + batch * ctx * self.kv_bytes_per_token
                + batch * 2 * self.state_bytes_per_request)

    def decode_floor_ms(self, batch: int, ctx: int, bandwidth: float, link_bandwidth: float) -> float:
        """`decode_bytes` over this GPU's copy bandwidth (which counts bytes read plus bytes
        written), plus (tensor parallel) its collectives' bytes over the NVLink bandwidth (bytes/s,
        one direction)."""
        ms = self.decode_bytes(batch, ctx) / bandwidth * 1e3
        if self.tp > 1:
            ms += self.decode_collective_bytes(batch) / link_bandwidth * 1e3
        return ms

    def attention_flops_layer(self, prefix: int, extend: int) -> float:
        """QK^T and PV FLOPs of one layer for `extend` new tokens over `prefix` cached + causal."""
        c = self.cfg
        pairs = extend * prefix + extend * (extend + 1) / 2
        return 4.0 * self.local_heads * c.head_dim * pairs

    def linear_attention_flops_layer(self, length: int) -> float:
        """FLOPs of one linear-attention layer over one sequence of `length` new tokens, beyond its
        projections: the short convolution (2 x kernel per channel and token) and the chunked gated
        delta rule, as fla's chunk_gated_delta_rule computes it: per chunk of C = LINEAR_CHUNK
        tokens (the last one padded: it runs whole) and value head (q and k shared by a value-head
        group are expanded to it), with dk, dv the head dims, every product counted dense as the
        tensor cores run it, even where half of it is masked:
          K K^T                            2 C^2 dk
          (I + A)^-1, unit lower triangle  C^3 / 3
          W = T (beta K), U = T (beta V)   2 C^2 (dk + dv)
          Q K^T                            2 C^2 dk
          U - W S, Q S, K^T U (the state)  3 x 2 C dk dv
          (Q K^T) U                        2 C^2 dv
        = C^2 (6 dk + 4 dv) + 6 C dk dv + C^3 / 3. The gates, decays and norms are elementwise
        (left out). A decode step runs the recurrent form instead, bound by its state's bytes."""
        h = self.cfg.hybrid
        num_v, _, _ = self.linear_dims
        dk, dv, chunk = h.linear_k_head_dim, h.linear_v_head_dim, LINEAR_CHUNK
        per_chunk = chunk ** 2 * (6 * dk + 4 * dv) + 6 * chunk * dk * dv + chunk ** 3 / 3
        conv = 2.0 * h.conv_kernel * self.linear_conv_channels * length
        return conv + num_v * ceil(length / chunk) * per_chunk

    def prefill_flops(self, batch: int, length: int) -> float:
        """FLOPs of a prefill of `batch` sequences of `length` tokens: every projection (a token's
        top-k experts), causal attention in the attention layers, the chunked linear attention in
        a hybrid's linear layers, the last token's logits."""
        c = self.cfg
        projections = 2.0 * self.active_params * batch * length
        attention_layers = c.num_hidden_layers - (c.hybrid.num_linear_layers if c.hybrid is not None else 0)
        attn = attention_layers * batch * self.attention_flops_layer(0, length)
        linear = 0.0
        if c.hybrid is not None and c.hybrid.num_linear_layers:
            linear = c.hybrid.num_linear_layers * batch * self.linear_attention_flops_layer(length)
        lm_head = 2.0 * c.hidden_size * self.local_vocab * batch  # logits of the last token only
        return projections + attn + linear + lm_head
