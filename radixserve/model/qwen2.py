"""Qwen2 / Qwen2.5 forward pass over a ragged ForwardBatch, numerically like transformers' Qwen2.

The decoder is shared with the families that differ from Qwen2 only in options of ModelConfig
(set per family in radixserve.model.registry): `qkv_bias` and `qk_norm` (Qwen3 dense, see
radixserve.model.qwen3, normalises each q and k head before RoPE and has no q|k|v bias).

One forward, through layers that picked their kernels when the model was built
(radixserve.model.layers: Triton on CUDA in bfloat16/float16, torch ops elsewhere). Parameters
are fused where the math allows (q|k|v rows in `qkv_proj`, gate|up rows in `gate_up_proj`), so
each layer runs two matmuls fewer; `packed_modules_mapping` tells the loader which checkpoint
tensor fills which shard. The residual add of every sub-block is folded into the next RMSNorm
(this layer's post-attention norm, the next layer's input norm, the final norm). Attention
itself (and the KV cache) belongs to the attention backend passed in.

Layers are called through `.forward`, not `nn.Module.__call__`: a layer makes ten such calls,
and the eager (prefill and mixed) steps are bound by host time, where `__call__`'s hook
bookkeeping would add about half a microsecond to each.

With tensor parallelism (`tp`, see radixserve.model.layers.parallel) each rank builds the same
model over its shard: its query and KV heads (KV heads replicated when there are fewer than
ranks), its MLP columns, its vocabulary rows; o_proj and down_proj end in one all-reduce each,
the embedding in one, and the LM head gathers the logits. Without `tp` the model is built the same
way on `SingleRank`, whose collectives are identities.

With `fp8` every decoder layer's projections hold e4m3 weights (radixserve.model.layers.fp8); the
embedding and the LM head keep `dtype`; with `tp` they shard like the plain weights (rows with
their scales, or input columns), see radixserve.model.layers.parallel. Their activations are
quantized to e4m3 per token: with the Triton kernels (and dynamic activation scales) the input
and post-attention norms write q|k|v's and gate|up's input that way themselves (their input is
replicated on every rank, so under `tp` too), and o_proj and down_proj quantize theirs in front
of their GEMM; the final norm, before the bf16 LM head, writes bf16. A block-wise checkpoint
whose fused shards or rank cuts fall off its block grid is refused before anything is built.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from radixserve.attention.base import AttentionBackend, ForwardBatch
from radixserve.distributed import SingleRank, TensorParallel, head_shard, vocab_shard
from radixserve.distributed.sharding import even_shard
from radixserve.model.config import ModelConfig
from radixserve.model.layers import KernelChoice, Linear, RMSNorm, RotaryEmbedding, SiluAndMul
from radixserve.model.layers.moe import SparseMoeBlock
from radixserve.model.layers.norm import Normed
from radixserve.model.layers.parallel import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                              VocabParallelEmbedding)
from radixserve.model.moe_config import check_moe_layout
from radixserve.model.quantization import Fp8Config, check_block_alignment


class Qwen2Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, attn_backend: AttentionBackend,
                 rotary_emb: RotaryEmbedding, *, dtype: torch.dtype, kernels: KernelChoice,
                 tp: TensorParallel, fp8: Optional[Fp8Config] = None):
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = d = config.head_dim
        heads = head_shard(config.num_attention_heads, config.num_key_value_heads, tp.size, tp.rank)
        self.num_heads, self.num_kv_heads = heads.num_q, heads.num_kv
        self.q_size, self.kv_size = heads.num_q * d, heads.num_kv * d
        kv_rows = (heads.kv_start * d, self.kv_size)
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, {"q": (heads.q_start * d, self.q_size), "k": kv_rows, "v": kv_rows},
            bias=config.qkv_bias, dtype=dtype, kernels=kernels, fp8=fp8)
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, start=heads.q_start * d, dtype=dtype,
                                        kernels=kernels, tp=tp, fp8=fp8)
        # Qwen3: RMSNorm over each head's head_dim values of q and of k, before RoPE; one weight
        # of head_dim per layer, the same on every rank (replicated under tensor parallelism).
        # RoPE applies them (on the Triton path inside its own launch, see RotaryEmbedding).
        self.q_norm: Optional[RMSNorm] = None
        self.k_norm: Optional[RMSNorm] = None
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, kernels=kernels)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, kernels=kernels)
        self._qk_norm = (self.q_norm, self.k_norm) if config.qk_norm else None
        # Plain attributes, never submodules: the backend and the RoPE tables are shared by all
        # layers, and their state must survive the model's meta -> device move.
        object.__setattr__(self, "_backend", attn_backend)
        object.__setattr__(self, "_rotary_emb", rotary_emb)

    def forward(self, x: Normed, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj.forward(x)  # x may be FP8 activations (see Qwen2DecoderLayer.forward)
        t = qkv.shape[0]
        q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        pool = batch.kv_pool
        layer = self.layer_id
        q, k, stored = self._rotary_emb.forward(batch.positions, q, k, v=v, k_buf=pool.k_buffers[layer],
                                                v_buf=pool.v_buffers[layer], loc=batch.out_cache_loc,
                                                kv_scales=(pool.k_scales[layer], pool.v_scales[layer]),
                                                qk_norm=self._qk_norm)
        out = self._backend.forward(q, k, v, self.layer_id, batch, save_kv=not stored)
        return self.o_proj.forward(out.reshape(t, self.q_size))


class Qwen2MLP(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, kernels: KernelChoice,
                 tp: TensorParallel, fp8: Optional[Fp8Config] = None):
        super().__init__()
        inter = config.intermediate_size
        start, size = even_shard(inter, tp.size, tp.rank)
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, {0: (start, size), 1: (start, size)}, bias=False,
                                                 dtype=dtype, kernels=kernels, act=SiluAndMul(kernels=kernels), fp8=fp8)
        self.down_proj = RowParallelLinear(size, config.hidden_size, start=start, dtype=dtype, kernels=kernels, tp=tp,
                                           fp8=fp8)

    @property
    def takes_fp8_activations(self) -> bool:
        return self.gate_up_proj.takes_fp8_activations

    def forward(self, x: Normed) -> torch.Tensor:
        return self.down_proj.forward(self.gate_up_proj.forward(x))


def make_mlp(config: ModelConfig, layer_id: int, *, dtype: torch.dtype, kernels: KernelChoice, tp: TensorParallel,
             fp8: Optional[Fp8Config] = None) -> nn.Module:
    """Layer `layer_id`'s MLP: the routed experts where config.moe makes it sparse (Qwen3-MoE,
    Qwen2-MoE: radixserve.model.layers.moe), else the dense MLP."""
    if not config.is_sparse_layer(layer_id):
        return Qwen2MLP(config, dtype=dtype, kernels=kernels, tp=tp, fp8=fp8)
    moe = config.moe
    return SparseMoeBlock(config.hidden_size, num_experts=moe.num_experts, top_k=moe.top_k,
                          moe_intermediate_size=moe.moe_intermediate_size, norm_topk_prob=moe.norm_topk_prob,
                          dtype=dtype, kernels=kernels, tp=tp, fp8=fp8,
                          shared_expert_intermediate_size=moe.shared_expert_intermediate_size)


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, attn_backend: AttentionBackend,
                 rotary_emb: RotaryEmbedding, *, dtype: torch.dtype, kernels: KernelChoice,
                 tp: TensorParallel, fp8: Optional[Fp8Config] = None):
        super().__init__()
        self.self_attn = Qwen2Attention(config, layer_id, attn_backend, rotary_emb, dtype=dtype, kernels=kernels,
                                        tp=tp, fp8=fp8)
        self.mlp = make_mlp(config, layer_id, dtype=dtype, kernels=kernels, tp=tp, fp8=fp8)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, kernels=kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, kernels=kernels)

    def forward(self, h: torch.Tensor, residual: Optional[torch.Tensor], batch: ForwardBatch
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output not yet added to the residual, the residual stream); the first
        layer gets residual=None and h as the residual stream."""
        # An FP8 q|k|v or gate|up may take its input quantized by the norm (fp8=True): one
        # quantization launch fewer each.
        qkv_fp8 = self.self_attn.qkv_proj.takes_fp8_activations
        if residual is None:
            residual = h
            normed = self.input_layernorm.forward(h, fp8=qkv_fp8)
        else:
            normed, residual = self.input_layernorm.forward(h, residual, fp8=qkv_fp8)
        a = self.self_attn.forward(normed, batch)
        normed, residual = self.post_attention_layernorm.forward(a, residual, fp8=self.mlp.takes_fp8_activations)
        return self.mlp.forward(normed), residual


class Qwen2Model(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, rotary_emb: RotaryEmbedding, *,
                 dtype: torch.dtype, kernels: KernelChoice, tp: TensorParallel,
                 fp8: Optional[Fp8Config] = None):
        super().__init__()
        start, rows, real = vocab_shard(config.vocab_size, tp.size, tp.rank)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, start=start, rows=rows,
                                                   real=real, dtype=dtype, tp=tp)
        self.layers = nn.ModuleList(
            Qwen2DecoderLayer(config, i, attn_backend, rotary_emb, dtype=dtype, kernels=kernels, tp=tp, fp8=fp8)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, kernels=kernels)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states [len(batch.logits_indices), hidden] of the rows whose logits are computed."""
        h = self.embed_tokens(batch.input_ids)
        residual: Optional[torch.Tensor] = None
        for layer in self.layers:
            h, residual = layer.forward(h, residual, batch)
        # The final norm (like lm_head) is row-wise: computing it only for the sampled rows saves
        # a [T, vocab] matmul on every prefill.
        rows = batch.logits_indices
        h, _ = self.norm.forward(h[rows], residual[rows])
        return h


class Qwen2ForCausalLM(nn.Module):
    """Parameters are allocated uninitialised on `device`; `load_model` fills every one of them.

    Parameter names are the checkpoint's (`model.embed_tokens.weight`, `model.layers.{i}...`,
    `model.norm.weight`, `lm_head.weight`) except where projections are fused: see
    `packed_modules_mapping`. With tied embeddings `lm_head.weight` is `model.embed_tokens.weight`.
    `kernels` (default: `KernelChoice.for_device(device, dtype)`) fixes every layer's kernels.
    `tp`: this rank's place in a tensor-parallel group (None: the whole model in this process).
    `fp8`: the projections of every decoder layer hold FP8 weights (sharded like the rest with `tp`).
    `kv_cache_scales`: per layer the (k, v) scales of an FP8 KV cache, 1.0 unless the checkpoint
    carries them (the loader fills them).
    """

    # Checkpoint module name -> (our fused module, the shard it fills).
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Checkpoint tensors holding an FP8 KV cache's scales: (layer, "k" | "v" | "kv"). The fp8 format
    # writes self_attn.k_scale / v_scale (older exports one kv_scale); compressed-tensors writes
    # the k/v projections' output_scale.
    kv_scale_pattern = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k|v|kv)(?:_scale|_proj\.output_scale)$")

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_positions: Optional[int] = None,
                 kernels: Optional[KernelChoice] = None, tp: Optional[TensorParallel] = None,
                 fp8: Optional[Fp8Config] = None):
        super().__init__()
        self.config = config
        self.tp = tp if tp is not None else SingleRank(device)
        tp = self.tp
        self.fp8 = fp8
        self.kv_cache_scales: list[tuple[float, float]] = [(1.0, 1.0)] * config.num_hidden_layers
        object.__setattr__(self, "attn_backend", attn_backend)  # see Qwen2Attention._backend
        self.dtype = dtype
        self.kernels = kernels if kernels is not None else KernelChoice.for_device(device, dtype)
        check_block_alignment(fp8, head_dim=config.head_dim, num_heads=config.num_attention_heads,
                              num_kv_heads=config.num_key_value_heads,
                              intermediate_size=config.dense_intermediate_size, tp_size=tp.size)
        check_moe_layout(config.moe, fp8, tp.size)
        n_pos = max(max_positions or 0, config.max_position_embeddings)
        rotary_emb = RotaryEmbedding(config.head_dim, n_pos, config.rope_theta, dtype=dtype, device=device,
                                     kernels=self.kernels)
        # Built on the meta device, then given real (uninitialised) storage once: no time is spent
        # on random init that the weights would overwrite, and no CPU copy of a GPU model exists.
        with torch.device("meta"):
            self.model = Qwen2Model(config, attn_backend, rotary_emb, dtype=dtype, kernels=self.kernels, tp=tp,
                                    fp8=fp8)
            self.lm_head: Optional[Linear] = None
            if not config.tie_word_embeddings:
                self.lm_head = self._lm_head()
        self.to_empty(device=device)
        # Registered after to_empty, which would replace its computed tables with empty storage.
        self.model.rotary_emb = rotary_emb
        if self.lm_head is None:
            self.lm_head = self._lm_head(weight=self.model.embed_tokens.weight)
        # The routed experts' reference loop (no fused MoE) reads the routing on the host.
        self.graph_capturable = self.kernels.fused_moe or not any(
            config.is_sparse_layer(i) for i in range(config.num_hidden_layers))
        attn = self.model.layers[0].self_attn
        # This rank's attention heads (all of them without tensor parallelism): the KV pool and the
        # attention workspace are sized by them.
        self.local_heads = (attn.num_heads, attn.num_kv_heads)

    def _lm_head(self, weight: Optional[nn.Parameter] = None) -> Linear:
        cfg = self.config
        start, rows, real = vocab_shard(cfg.vocab_size, self.tp.size, self.tp.rank)
        return ParallelLMHead(cfg.hidden_size, cfg.vocab_size, start=start, rows=rows, real=real, dtype=self.dtype,
                              kernels=self.kernels, tp=self.tp, weight=weight)

    @property
    def max_positions(self) -> int:
        return self.model.rotary_emb.max_positions

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in fp32 for the selected token rows."""
        self.attn_backend.init_forward(batch)
        logits = self.lm_head.forward(self.model.forward(batch))
        if batch.logits_out is None:
            return logits.float()
        return batch.logits_out.copy_(logits)  # the conversion to fp32, into the caller's buffer
