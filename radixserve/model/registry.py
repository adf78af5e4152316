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

from radixserve.model.moe_config import parse_moe

# config.json (the parsed dict), its source for messages -> the family's ModelConfig fields.
ConfigHook = Callable[[dict[str, Any], str], dict[str, Any]]


@dataclass(frozen=True)
class ModelFamily:
    architecture: str  # an entry of config.json's "architectures"
    model_type: str  # config.json's "model_type", which picks the family when "architectures" is absent
    model_class: str  # "package.module:ClassName", imported by model_class()
    parse_config: ConfigHook


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


FAMILIES: dict[str, ModelFamily] = {f.architecture: f for f in (
    ModelFamily("Qwen2ForCausalLM", "qwen2", "radixserve.model.qwen2:Qwen2ForCausalLM", _qwen2_fields),
    ModelFamily("Qwen3ForCausalLM", "qwen3", "radixserve.model.qwen3:Qwen3ForCausalLM", _qwen3_fields),
    ModelFamily("Qwen3MoeForCausalLM", "qwen3_moe", "radixserve.model.qwen_moe:Qwen3MoeForCausalLM",
                _qwen3_moe_fields),
    ModelFamily("Qwen2MoeForCausalLM", "qwen2_moe", "radixserve.model.qwen_moe:Qwen2MoeForCausalLM",
                _qwen2_moe_fields),
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
