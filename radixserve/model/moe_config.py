"""The mixture-of-experts fields of a Qwen3-MoE or Qwen2-MoE config.json, and the tensor-parallel
and block-wise FP8 layouts their experts can take.

Which layers are sparse follows transformers: layer i runs the experts unless i is in
`mlp_only_layers`, when `num_experts` > 0 and (i + 1) is a multiple of `decoder_sparse_step`;
every other layer runs a dense MLP of `intermediate_size`.

Pure Python (no torch import): the server checks a config before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from radixserve.model.quantization import Fp8Config


@dataclass(frozen=True)
class MoeConfig:
    """num_experts routed experts of moe_intermediate_size, top_k of them per token, their
    probabilities renormalised to sum to 1 when norm_topk_prob; a shared expert (a dense MLP of
    shared_expert_intermediate_size with a sigmoid gate, Qwen2-MoE) when that is > 0."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0

    def is_sparse(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    def sparse_layers(self, num_layers: int) -> list[int]:
        return [i for i in range(num_layers) if self.is_sparse(i)]


def _int(data: dict[str, Any], key: str, source: str, *, default: Optional[int] = None, low: int = 0) -> int:
    value = data.get(key, default)
    if value is None:
        raise ValueError(f"{source}: required key {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{source}: {key} must be an integer >= {low}, got {value!r}")
    return value


def parse_moe(data: dict[str, Any], source: str, *, shared_expert: bool) -> MoeConfig:
    """The MoE fields of a config.json; ValueError names a missing or malformed one.
    `shared_expert`: the family has one (Qwen2-MoE), read from shared_expert_intermediate_size."""
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; the releases write num_experts.
    experts_key = "num_experts" if data.get("num_experts") is not None else "num_local_experts"
    num_experts = _int(data, experts_key, source)
    top_k = _int(data, "num_experts_per_tok", source, low=1)
    if num_experts and top_k > num_experts:
        raise ValueError(f"{source}: num_experts_per_tok {top_k} is more than {experts_key} {num_experts}")
    norm = data.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ValueError(f"{source}: norm_topk_prob must be true or false, got {norm!r}")
    layers = data.get("mlp_only_layers") or []
    if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise ValueError(f"{source}: mlp_only_layers must be a list of layer indices, got {layers!r}")
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        moe_intermediate_size=_int(data, "moe_intermediate_size", source, low=1),
        norm_topk_prob=norm,
        decoder_sparse_step=_int(data, "decoder_sparse_step", source, default=1, low=1),
        mlp_only_layers=tuple(layers),
        shared_expert_intermediate_size=_int(data, "shared_expert_intermediate_size", source) if shared_expert else 0,
    )


def check_expert_blocks(block: Optional[tuple[int, int]], intermediate_size: int, tp_size: int, *,
                        name: str = "moe_intermediate_size", source: str = "config.json") -> None:
    """ValueError when block-wise scales of an MLP's weights would straddle a cut: the gate and up
    halves of its fused gate|up weight (each I / tp rows) and, under tensor parallelism, each
    rank's slice of the intermediate (down's input columns)."""
    if block is None:
        return
    bn, bk = block
    inter = intermediate_size // tp_size
    bad = [f"gate_proj rows {inter}"] if inter % bn else []
    if tp_size > 1 and inter % bk:
        bad.append(f"down_proj input columns {inter}")
    if bad:
        where = f"tp_size={tp_size} gives each rank's slice of {name}" if tp_size > 1 else \
            f"the fused gate|up weights of {name} hold"
        raise ValueError(f"{source}: block-wise FP8 (weight_block_size [{bn}, {bk}]): {where} "
                         f"{', '.join(bad)}, not a whole number of blocks, so a block's scale would cover two shards"
                         + ("; use a tp_size that keeps whole blocks on each rank" if tp_size > 1 else ""))


def check_moe_layout(moe: Optional[MoeConfig], fp8: Optional[Fp8Config], tp_size: int,
                     source: str = "config.json") -> None:
    """ValueError naming the expert dimension `tp_size` cannot split, or the block-wise FP8 cut it
    would make (the routed experts and the shared expert); nothing for a model without experts."""
    if moe is None:
        return
    parts = [("moe_intermediate_size", moe.moe_intermediate_size)]
    if moe.shared_expert_intermediate_size:
        parts.append(("shared_expert_intermediate_size", moe.shared_expert_intermediate_size))
    for name, size in parts:
        if size % tp_size:
            raise ValueError(f"tp_size={tp_size} does not divide the model's {name} {size}")
        check_expert_blocks(fp8.block if fp8 is not None else None, size, tp_size, name=name, source=source)
