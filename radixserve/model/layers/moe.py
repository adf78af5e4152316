"""Mixture-of-experts MLP layers (Qwen3-MoE, Qwen2-MoE): the router, the routed experts stored
stacked per layer, and the sparse block that joins them (with Qwen2-MoE's shared expert).

- The router: logits = x @ gate^T in the model dtype, softmax in float32, the top-k experts and
  their probabilities (renormalised to sum to 1 with `norm_topk_prob`), cast to the model dtype:
  transformers' router, op for op (`TopKRouting`; one Triton kernel on CUDA). Replicated.
- `FusedExperts`: every expert's gate|up weight in one [E, 2I, H] tensor (gate rows, then up
  rows) and its down weight in one [E, H, I] tensor, filled from the checkpoint's per-expert
  tensors (`experts.{e}.gate_proj/up_proj/down_proj.weight`). On CUDA (any dtype, unless the
  Triton kernels are turned off: KernelChoice.fused_moe) the forward is the fused MoE
  (radixserve.kernels.fused_moe: tokens sorted by expert, two grouped GEMMs, no host sync, so
  CUDA graphs capture it); elsewhere it is transformers' expert loop (the reference: the same
  ops in the same order, so float32 results match it exactly).
- `SparseMoeBlock`: router + experts (+ the shared expert, a dense MLP whose output is scaled by
  sigmoid(shared_expert_gate(x)) and added), one all-reduce at the end.

Tensor parallelism: each rank holds a slice of every expert's intermediate dimension (gate|up
rows, down input columns) and of the shared expert's, like the dense MLP; the router and the
shared expert's gate are replicated. Each rank's output is a partial sum over its slices; the
routed and shared partial sums are added and reduced with one all-reduce, as the dense MLP's
down_proj does.

FP8 experts (radixserve.model.layers.moe_fp8): e4m3 weights with a scale per expert per output
channel (quantized at load from bf16, or a checkpoint's per-tensor/per-channel scales), or per
128 x 128 block (`weight_scale_inv`, as the Qwen3 FP8 releases publish). The fused kernel reads
them as one byte each and keeps the activations in the model dtype; the reference dequantizes
each expert's weights and runs the same loop.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed import TensorParallel
from radixserve.distributed.sharding import even_shard
from radixserve.model.layers.activation import SiluAndMul
from radixserve.model.layers.kernel_choice import KernelChoice
from radixserve.model.layers.linear import Linear, ShardId
from radixserve.model.layers.parallel import ColumnParallelLinear, RowParallelLinear
from radixserve.model.layers.param_sharding import Cut, Destination, Loaded, Span, load_param
from radixserve.model.layers.quant_method import ExpertsMethod, experts_method
from radixserve.model.quantization import Fp8Config

# Checkpoint module of each of an expert's three weights -> (our tensor, the part it fills).
EXPERT_PROJECTIONS = (("gate_proj", "w13", "gate"), ("up_proj", "w13", "up"), ("down_proj", "w2", "down"))


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] in the logits' dtype, expert ids [T, top_k] int64): transformers'
    router after its linear (softmax in float32, top-k, renormalised, cast back)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def experts_reference(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                      expert_weights) -> torch.Tensor:
    """transformers' expert loop: for each expert that any token picked, in expert order, its
    tokens' silu(gate) * up through down, times the routing weight, added into the output.
    `expert_weights(e)` -> (w13 [2I, H], w2 [H, I]) of expert e in x's dtype."""
    out = torch.zeros_like(x)
    mask = F.one_hot(topk_ids.long(), num_classes=num_experts + 1).permute(2, 1, 0)  # [E + 1, top_k, T]
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit.flatten().tolist():
        if e == num_experts:
            continue
        pos, tokens = torch.where(mask[e])
        w13, w2 = expert_weights(e)
        gate, up = F.linear(x[tokens], w13).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2)
        h = h * topk_weights[tokens, pos, None]
        out.index_add_(0, tokens, h.to(out.dtype))
    return out


class TopKRouting:
    """Router logits [T, E] -> (routing weights [T, top_k] in the logits' dtype, expert ids
    [T, top_k]), highest first: the Triton kernel with the Triton kernels, else route_reference."""

    def __init__(self, num_experts: int, top_k: int, renormalize: bool, *, kernels: KernelChoice):
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self._topk = None
        if kernels.fused_moe:
            from radixserve.kernels.fused_moe import topk_softmax

            self._topk = topk_softmax

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._topk is not None:
            return self._topk(logits, self.top_k, self.renormalize)
        return route_reference(logits, self.top_k, self.renormalize)


class FusedExperts(nn.Module):
    """This rank's slice of every routed expert (see the module docstring).

    Parameters: `w13_weight` [E, 2 I_r, H] (this rank's I_r gate rows, then its I_r up rows, of each
    expert) and `w2_weight` [E, H, I_r] (its input columns of each down weight), in `dtype`, or
    e4m3 with their scales under `fp8`: the weight format (`self.quant_method`,
    radixserve.model.layers.quant_method.experts_method) creates them and declares how each
    shards; this layer says which part of each per-expert tensor the rank holds (a gate or up
    weight: its rows of the intermediate; a down weight: its columns). `forward(x, topk_weights,
    topk_ids)` returns this rank's partial sum [T, H].
    """

    reads_slices = True

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype,
                 kernels: KernelChoice, tp: TensorParallel, fp8: Optional[Fp8Config] = None):
        super().__init__()
        if intermediate_size % tp.size:
            raise ValueError(f"tp_size={tp.size} does not divide the model's moe_intermediate_size "
                             f"{intermediate_size}")
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.inter_start, self.inter = even_shard(intermediate_size, tp.size, tp.rank)
        self.tp_size = tp.size
        self.dtype = dtype
        self.quant_method: ExpertsMethod = experts_method(fp8, dtype, tp_size=tp.size, triton=kernels.triton)
        self.quant_method.create_weights(self)
        self._fused = None
        if kernels.fused_moe:
            from radixserve.kernels.fused_moe import fused_moe
            from radixserve.kernels.fused_moe_config import config_for

            self._fused, self._config_for = fused_moe, config_for
            self._configs: dict[tuple[int, int], tuple] = {}

    # ------------------------------------------------------------------ loading
    def checkpoint_tensors(self) -> dict[str, tuple[str, ShardId]]:
        """Checkpoint tensor name (relative to this module) -> (our parameter, its shard id
        (expert, "gate" | "up" | "down")): the loader routes each per-expert tensor here."""
        names: dict[str, tuple[str, ShardId]] = {}
        for e in range(self.num_experts):
            for module, ours, part in EXPERT_PROJECTIONS:
                for suffix in self.quant_method.checkpoint_suffixes:
                    names[f"{e}.{module}.{suffix}"] = (f"{ours}_{suffix}", (e, part))
        return names

    def checkpoint_place(self, shard_id: ShardId) -> tuple[Cut, Destination]:
        """A gate or up tensor [I, H]: this rank's rows of the intermediate, into the gate or the
        up half of the expert's w13 rows; a down tensor [H, I]: its columns, into every w2 row."""
        parts = ("gate", "up", "down")
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and 0 <= shard_id[0] < self.num_experts
                and shard_id[1] in parts):
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r} (expert, one of {parts})")
        expert, part = shard_id
        span = Span(self.inter_start, self.inter, total=self.inter * self.tp_size)
        if part == "down":
            return Cut(cols=span), Destination((0, self.hidden_size), expert=expert)
        return Cut(rows=span), Destination((0 if part == "gate" else self.inter, self.inter), expert=expert)

    def load_weight(self, param: str, loaded: Loaded, shard_id: Optional[ShardId] = None) -> None:
        cut, dest = self.checkpoint_place(shard_id)
        load_param(self, self.quant_method.params, param, loaded, cut, dest)

    def finish_loading(self) -> None:
        self.quant_method.finish_loading(self)

    # ------------------------------------------------------------------ forward
    def expert_weights(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [2 I_r, H], w2 [H, I_r]) of expert e in the model dtype (FP8: dequantized)."""
        return self.quant_method.dequantized(self, e)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self._fused is None:
            return experts_reference(x, topk_weights, topk_ids, self.num_experts, self._reference_weights(x.dtype))
        t, top_k = topk_ids.shape
        key = (t, top_k)
        configs = self._configs.get(key)
        if configs is None:
            configs = self._configs[key] = self._pick_configs(t, top_k)
        return self._fused(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, *configs,
                           **self.quant_method.kernel_args(self))

    def _reference_weights(self, dtype: torch.dtype):
        def weights(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            w13, w2 = self.expert_weights(e)
            return w13.to(dtype), w2.to(dtype)
        return weights

    def _pick_configs(self, tokens: int, top_k: int) -> tuple:
        """The gate|up and down GEMMs' tiles for a step of `tokens` tokens (one block_m: both walk
        the same alignment)."""
        e, n13, h = self.w13_weight.shape
        wbytes = self.w13_weight.element_size()
        c13 = self._config_for(e, n13, h, tokens, top_k, wbytes)
        c2 = self._config_for(e, h, self.inter, tokens, top_k, wbytes)
        if c2.block_m != c13.block_m:
            from dataclasses import replace

            c2 = replace(c2, block_m=c13.block_m)
        return self.quant_method.fit_configs(c13, c2)


class SharedExpert(nn.Module):
    """A dense MLP of `intermediate_size` (Qwen2-MoE's shared expert), this rank's columns; its
    output is the rank's partial sum (the sparse block reduces it with the routed experts')."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype: torch.dtype, kernels: KernelChoice,
                 tp: TensorParallel, fp8: Optional[Fp8Config] = None):
        super().__init__()
        if intermediate_size % tp.size:
            raise ValueError(f"tp_size={tp.size} does not divide the model's shared_expert_intermediate_size "
                             f"{intermediate_size}")
        start, size = even_shard(intermediate_size, tp.size, tp.rank)
        self.gate_up_proj = ColumnParallelLinear(hidden_size, {0: (start, size), 1: (start, size)}, bias=False,
                                                 dtype=dtype, kernels=kernels, act=SiluAndMul(kernels=kernels),
                                                 fp8=fp8)
        self.down_proj = RowParallelLinear(size, hidden_size, start=start, dtype=dtype, kernels=kernels, tp=tp,
                                           fp8=fp8, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.gate_up_proj.forward(x))


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer: x [T, H] -> sum of the top-k experts' outputs weighted by the
    router (+ sigmoid(shared_expert_gate(x)) * shared_expert(x)), all-reduced over the ranks.

    Parameter names follow the checkpoint: `gate` (the router's linear), `experts` (loaded from
    `experts.{e}.*`), `shared_expert.*`, `shared_expert_gate`. Its input is the post-attention
    norm's output in the model dtype (the routed experts take no FP8 activations;
    `takes_fp8_activations` is False).
    """

    takes_fp8_activations = False

    def __init__(self, hidden_size: int, *, num_experts: int, top_k: int, moe_intermediate_size: int,
                 norm_topk_prob: bool, dtype: torch.dtype, kernels: KernelChoice, tp: TensorParallel,
                 fp8: Optional[Fp8Config] = None, shared_expert_intermediate_size: int = 0):
        super().__init__()
        # The router's linear: replicated, and in the model dtype under FP8 too (published FP8
        # checkpoints keep it so).
        self.gate = Linear(hidden_size, num_experts, bias=False, dtype=dtype, kernels=kernels)
        self.routing = TopKRouting(num_experts, top_k, norm_topk_prob, kernels=kernels)
        self.experts = FusedExperts(num_experts, hidden_size, moe_intermediate_size, dtype=dtype, kernels=kernels,
                                    tp=tp, fp8=fp8)
        self.shared_expert: Optional[SharedExpert] = None
        self.shared_expert_gate: Optional[Linear] = None
        if shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(hidden_size, shared_expert_intermediate_size, dtype=dtype,
                                              kernels=kernels, tp=tp, fp8=fp8)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False, dtype=dtype, kernels=kernels)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.routing(self.gate.forward(x))
        out = self.experts.forward(x, topk_weights, topk_ids)
        if self.shared_expert is not None:
            shared = torch.sigmoid(self.shared_expert_gate.forward(x)) * self.shared_expert.forward(x)
            out = out + shared
        return self.tp.all_reduce(out)
