"""The model families radixserve runs: config.json's architecture -> the model class that runs it,
and what that family reads from config.json beyond the fields every family shares.

Adding a family is one `ModelFamily` entry in `FAMILIES`: its architecture name (as config.json's
`architectures` lists it), its `model_type` (for a config.json without `architectures`), where its
model class lives, and a hook that turns the family's own config.json keys into `ModelConfig`
fields (refusing, by name, any value the class does not implement). `ModelConfig.from_dict`
validates against this table, and `radixserve.model.loader` builds the class it names.

Pure Python (no torch import): the class is named by module and attribute and imported only when
a model is built (`model_class`), so a config check runs where torch is not loaded, and the model
modules (which import ModelConfig) are not imported by the config module they import.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from radixserve.model.hybrid_config import FULL_ATTENTION, LINEAR_ATTENTION, HybridConfig
from radixserve.model.moe_config import parse_moe

# config.json (the parsed dict), its source for messages -> the family's ModelConfig fields.
ConfigHook = Callable[[dict[str, Any], str], dict[str, Any]]


@dataclass(frozen=True)
class ModelFamily:
    architecture: str  # an entry of config.json's "architectures"
    model_type: str  # config.json's "model_type", which picks the family when "architectures" is absent
    model_class: str  # "package.module:ClassName", imported by model_class()
    parse_config: ConfigHook
    # A multimodal checkpoint (...ForConditionalGeneration): the language model's keys are under
    # config.json's text_config (radixserve.model.config reads them from there).
    text_config: bool = False


def _flag(data: dict[str, Any], key: str, default: bool, source: str) -> bool:
    value = data.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{source}: {key} must be true or false, got {value!r}")
    return value


def _qwen2_fields(data: dict[str, Any], source: str) -> dict[str, Any]:
    # Qwen2 / Qwen2.5: q, k and v carry a bias (o_proj none); no norm on q and k.
    return {"qkv_bias": True, "qk_norm": False}


def _qwen3_fields(data: dict[str, Any], source: str) -> dict[str, Any]:
    # Qwen3 dense: RMSNorm over each q and k head before RoPE; `attention_bias` (false in every
    # published Qwen3) would put a bias on q, k, v and o_proj, and o_proj's under tensor
    # parallelism would need adding once after the all-reduce: not implemented, so refused.
    if _flag(data, "attention_bias", False, source):
        raise ValueError(f"{source}: attention_bias=true is not supported for Qwen3ForCausalLM "
                         "(only attention without biases, as every published Qwen3 has)")
    return {"qkv_bias": False, "qk_norm": True}


def _qwen3_moe_fields(data: dict[str, Any], source: str) -> dict[str, Any]:
    # Qwen3 attention (q/k norms, no bias); routed experts without a shared expert.
    return {**_qwen3_fields(data, source), "moe": parse_moe(data, source, shared_expert=False)}


def _qwen2_moe_fields(data: dict[str, Any], source: str) -> dict[str, Any]:
    # Qwen2 attention (q|k|v bias unless qkv_bias is false); routed experts plus a shared expert.
    return {"qkv_bias": _flag(data, "qkv_bias", True, source), "qk_norm": False,
            "moe": parse_moe(data, source, shared_expert=True)}


def _positive_int(data: dict[str, Any], key: str, default: int, source: str) -> int:
    value = data.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def _layer_types(data: dict[str, Any], source: str) -> tuple[str, ...]:
    """config.json's layer_types, or (older configs) every full_attention_interval-th layer full
    attention and the rest linear, as transformers derives it."""
    layers = _positive_int(data, "num_hidden_layers", 1, source)
    types = data.get("layer_types")
    if types is None:
        interval = _positive_int(data, "full_attention_interval", 4, source)
        return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers))
    if not isinstance(types, list) or len(types) != layers:
        raise ValueError(f"{source}: layer_types must list one type for each of the {layers} layers")
    bad = sorted({str(t) for t in types} - {FULL_ATTENTION, LINEAR_ATTENTION})
    if bad:
        raise ValueError(f"{source}: layer_types {', '.join(bad)} not supported (only {LINEAR_ATTENTION} and "
                         f"{FULL_ATTENTION})")
    return tuple(types)


# transformers' defaults for the MoE keys a hybrid's config.json leaves out: Qwen3-Next's (which
# layers are sparse follows decoder_sparse_step and mlp_only_layers), Qwen3.5-MoE's (every layer
# sparse, the top-k probabilities always renormalised: its router ignores norm_topk_prob).
QWEN3_NEXT_MOE = {"num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
                  "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1}
QWEN3_5_MOE = {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
               "shared_expert_intermediate_size": 512}


def _hybrid_moe(data: dict[str, Any], source: str, *, architecture: str, every_layer: bool):
    """The routed experts (with Qwen3-Next's shared expert and its sigmoid gate) of a hybrid MoE."""
    if every_layer:
        moe_keys = {**QWEN3_5_MOE, **{k: v for k, v in data.items() if k in QWEN3_5_MOE and v is not None},
                    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    else:
        moe_keys = {**QWEN3_NEXT_MOE, **{k: v for k, v in data.items() if v is not None}}
    moe = parse_moe(moe_keys, source, shared_expert=True)
    if not moe.shared_expert_intermediate_size:
        raise ValueError(f"{source}: shared_expert_intermediate_size must be positive for {architecture} "
                         "(its sparse blocks all have a shared expert)")
    return moe if moe.num_experts else None


def _hybrid_fields(data: dict[str, Any], source: str, *, architecture: str, layout: str,
                   moe: str = "") -> dict[str, Any]:
    """Qwen3-Next / Qwen3.5 (`moe`: "" dense, "qwen3_next" or "every_layer" for Qwen3.5-MoE): Gated
    DeltaNet layers and gated full-attention layers (q/k RMSNorm, partial RoPE, a sigmoid output
    gate); transformers' defaults for keys a config leaves out."""
    if _flag(data, "attention_bias", False, source):
        raise ValueError(f"{source}: attention_bias=true is not supported for {architecture}")
    if data.get("attn_output_gate", True) is not True:
        raise ValueError(f"{source}: attn_output_gate={data.get('attn_output_gate')!r} is not supported for "
                         f"{architecture} (only the gated attention of the published models)")
    layer_types = _layer_types(data, source)
    experts = _hybrid_moe(data, source, architecture=architecture, every_layer=moe == "every_layer") if moe else None
    hk = _positive_int(data, "linear_num_key_heads", 16, source)
    hv = _positive_int(data, "linear_num_value_heads", 32, source)
    if hv % hk:
        raise ValueError(f"{source}: linear_num_value_heads {hv} is not a multiple of linear_num_key_heads {hk}")
    heads = _positive_int(data, "num_attention_heads", 1, source)
    head_dim = data.get("head_dim") or _positive_int(data, "hidden_size", heads, source) // heads
    params = data.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", data.get("partial_rotary_factor", 0.25))
    rotary_dim = int(head_dim * float(factor))
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"{source}: partial_rotary_factor {factor} gives {rotary_dim} rotary dimensions of "
                         f"head_dim {head_dim}; expected an even number in 2..head_dim")
    kernel = _positive_int(data, "linear_conv_kernel_dim", 4, source)
    if kernel < 2:
        raise ValueError(f"{source}: linear_conv_kernel_dim must be at least 2, got {kernel}")
    hybrid = HybridConfig(layer_types=layer_types, linear_num_k_heads=hk, linear_num_v_heads=hv,
                          linear_k_head_dim=_positive_int(data, "linear_key_head_dim", 128, source),
                          linear_v_head_dim=_positive_int(data, "linear_value_head_dim", 128, source),
                          conv_kernel=kernel, rotary_dim=rotary_dim, projection_layout=layout)
    return {"qkv_bias": False, "qk_norm": True, "hybrid": hybrid, "moe": experts}


def _qwen3_next_fields(data: dict[str, Any], source: str) -> dict[str, Any]:
    return _hybrid_fields(data, source, architecture="Qwen3NextForCausalLM", layout="qkvz", moe="qwen3_next")


# Qwen3.5's rope_parameters carry mrope_section / mrope_interleaved for its vision inputs; text
# positions are the same on all three axes, where multimodal RoPE is plain RoPE.
def _qwen3_5_fields(data: dict[str, Any], source: str) -> dict[str, Any]:
    return _hybrid_fields(data, source, architecture="Qwen3_5ForCausalLM", layout="split")


def _qwen3_5_moe_fields(data: dict[str, Any], source: str) -> dict[str, Any]:
    return _hybrid_fields(data, source, architecture="Qwen3_5MoeForCausalLM", layout="split", moe="every_layer")


_HYBRID = "radixserve.model.qwen3_next"

FAMILIES: dict[str, ModelFamily] = {f.architecture: f for f in (
    ModelFamily("Qwen2ForCausalLM", "qwen2", "radixserve.model.qwen2:Qwen2ForCausalLM", _qwen2_fields),
    ModelFamily("Qwen3ForCausalLM", "qwen3", "radixserve.model.qwen3:Qwen3ForCausalLM", _qwen3_fields),
    ModelFamily("Qwen3MoeForCausalLM", "qwen3_moe", "radixserve.model.qwen_moe:Qwen3MoeForCausalLM",
                _qwen3_moe_fields),
    ModelFamily("Qwen2MoeForCausalLM", "qwen2_moe", "radixserve.model.qwen_moe:Qwen2MoeForCausalLM",
                _qwen2_moe_fields),
    ModelFamily("Qwen3NextForCausalLM", "qwen3_next", f"{_HYBRID}:Qwen3NextForCausalLM", _qwen3_next_fields),
    ModelFamily("Qwen3_5ForCausalLM", "qwen3_5_text", f"{_HYBRID}:Qwen3_5ForCausalLM", _qwen3_5_fields),
    # The multimodal checkpoints' language model (config.json's text_config); the vision tower is
    # not loaded, and an image or video part of a request is refused by its type.
    ModelFamily("Qwen3_5ForConditionalGeneration", "qwen3_5", f"{_HYBRID}:Qwen3_5ForConditionalGeneration",
                _qwen3_5_fields, text_config=True),
    ModelFamily("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", f"{_HYBRID}:Qwen3_5MoeForCausalLM",
                _qwen3_5_moe_fields),
    ModelFamily("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", f"{_HYBRID}:Qwen3_5MoeForConditionalGeneration",
                _qwen3_5_moe_fields, text_config=True),
)}


def supported_architectures() -> tuple[str, ...]:
    return tuple(FAMILIES)


def supported_model_types() -> tuple[str, ...]:
    return tuple(f.model_type for f in FAMILIES.values())


def family_of(data: dict[str, Any], source: str = "config") -> ModelFamily:
    """The family that runs this config.json: the first of its `architectures` listed here, or, with
    no `architectures`, the one of its `model_type`. ValueError names what it found and what is
    supported."""
    architectures = data.get("architectures") or []
    if not isinstance(architectures, list):
        raise ValueError(f"{source}: architectures must be a list of names, got {architectures!r}")
    for arch in architectures:
        if arch in FAMILIES:
            return FAMILIES[arch]
    if not architectures:
        for family in FAMILIES.values():
            if data.get("model_type") == family.model_type:
                return family
    found = ", ".join(map(str, architectures)) if architectures else f"model_type={data.get('model_type')!r}"
    raise ValueError(f"{source}: unsupported architecture {found}; supported: {', '.join(supported_architectures())} "
                     f"(model_type {', '.join(supported_model_types())})")


def model_class(architecture: str) -> type:
    """The model class of a registered architecture (imports its module)."""
    if architecture not in FAMILIES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}")
    module, _, name = FAMILIES[architecture].model_class.partition(":")
    return getattr(importlib.import_module(module), name)
