"""Which quantized formats the model runs, read from config.json's `quantization_config` and the
`--quantization` setting: FP8 (e4m3) weights, or none.

Supported: a bf16/fp16/fp32 checkpoint quantized at load (`quantization="fp8"`: per-output-channel
weight scales, per-token activation scales computed at run time); the `fp8` format (per-tensor
`weight_scale`, `activation_scheme` dynamic, or static with a per-tensor `input_scale`); and
`compressed-tensors` float8 (per-tensor or per-channel `weight_scale`; per-token dynamic or
per-tensor static activations). Every other method (awq, gptq, bitsandbytes, gguf, block-wise
FP8, ...) is a ValueError naming it: running such weights as if they were bf16 gives wrong tokens.

Pure Python (no torch import), so the server's start-up checks read it before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

QUANTIZATION_METHODS = ("fp8",)
SUPPORTED = ("fp8 (quant_method 'fp8': per-tensor weight scales, dynamic or static activations), "
             "compressed-tensors float8 (per-tensor or per-channel weights), or --quantization fp8 "
             "on a bf16/fp16/fp32 checkpoint")
# Modules a checkpoint may leave unquantized that radixserve keeps in bf16 anyway.
_ALWAYS_UNQUANTIZED = ("lm_head", "re:.*lm_head", "model.embed_tokens", "embed_tokens")

ActivationScheme = Literal["dynamic", "static"]


@dataclass(frozen=True)
class Fp8Config:
    """How the projections (every Linear but lm_head) hold FP8 weights.

    from_checkpoint: the checkpoint stores e4m3 weights with `weight_scale` (and, static,
    `input_scale`) tensors; False: it stores bf16/fp16/fp32 weights quantized per output channel
    as they load. weight_scales: "tensor" (one scale per checkpoint tensor) or "channel" (one per
    output row). activations: "dynamic" (a scale per token, computed at run time) or "static"
    (the checkpoint's per-tensor `input_scale`).
    """

    from_checkpoint: bool
    weight_scales: Literal["tensor", "channel"] = "channel"
    activations: ActivationScheme = "dynamic"
    source: str = "--quantization fp8"

    @property
    def static_activations(self) -> bool:
        return self.activations == "static"


def quantization_config(raw: dict[str, Any], requested: Optional[str] = None, *,
                        source: str = "config.json") -> Optional[Fp8Config]:
    """The FP8 layout for a config.json (`raw`) and the --quantization setting, or None for plain
    weights. ValueError names any method or option that is not supported."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={requested!r} is not supported; supported: {', '.join(QUANTIZATION_METHODS)}")
    qc = raw.get("quantization_config")
    if qc is None:
        return Fp8Config(from_checkpoint=False) if requested == "fp8" else None
    if not isinstance(qc, dict):
        raise ValueError(f"{source}: quantization_config must be a JSON object")
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        parsed = _fp8_format(qc, source)
    elif method == "compressed-tensors":
        parsed = _compressed_tensors(qc, source)
    else:
        raise ValueError(f"{source}: quantization method {method or '(none given)'!r} is not supported; "
                         f"supported: {SUPPORTED}")
    return parsed


def _fp8_format(qc: dict[str, Any], source: str) -> Fp8Config:
    if qc.get("weight_block_size") is not None:
        raise ValueError(f"{source}: block-wise FP8 (quant_method 'fp8' with weight_block_size "
                         f"{qc['weight_block_size']}) is not supported; supported: {SUPPORTED}")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"{source}: fp8 activation_scheme {scheme!r} is not supported (dynamic or static)")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{source}: fp8 fmt {fmt!r} is not supported (only e4m3)")
    _check_ignored(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or [], source)
    return Fp8Config(from_checkpoint=True, weight_scales="tensor", activations=scheme, source="quant_method 'fp8'")


def _compressed_tensors(qc: dict[str, Any], source: str) -> Fp8Config:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"{source}: compressed-tensors with {len(groups)} config_groups is not supported "
                         f"(one group of float8 Linear layers); supported: {SUPPORTED}")
    group = next(iter(groups.values()))
    weights = group.get("weights") or {}
    acts = group.get("input_activations") or {}
    name = "compressed-tensors"
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        kind = f"{weights.get('type')}{weights.get('num_bits')}"
        raise ValueError(f"{source}: {name} {kind} weights are not supported; supported: {SUPPORTED}")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel") or weights.get("dynamic") or not weights.get("symmetric", True):
        raise ValueError(f"{source}: {name} float8 weights with strategy {strategy!r} (dynamic="
                         f"{weights.get('dynamic')}, symmetric={weights.get('symmetric', True)}) are not "
                         "supported (static symmetric, strategy tensor or channel)")
    if acts.get("type") != "float" or acts.get("num_bits") != 8:
        raise ValueError(f"{source}: {name} with {acts.get('type')} {acts.get('num_bits')}-bit input activations "
                         "is not supported (float8 activations: weight-only float8 is not implemented)")
    if acts.get("dynamic") and acts.get("strategy") == "token":
        scheme: ActivationScheme = "dynamic"
    elif not acts.get("dynamic") and acts.get("strategy") == "tensor":
        scheme = "static"
    else:
        raise ValueError(f"{source}: {name} float8 input activations with strategy {acts.get('strategy')!r} "
                         f"(dynamic={acts.get('dynamic')}) are not supported (dynamic per token, or static per "
                         "tensor)")
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise ValueError(f"{source}: {name} targets {targets} are not supported (only ['Linear'])")
    _check_ignored(qc.get("ignore") or [], source)
    return Fp8Config(from_checkpoint=True, weight_scales=strategy, activations=scheme, source=name)


def _check_ignored(ignored: list[str], source: str) -> None:
    """The embedding and lm_head stay bf16 here in any case; a checkpoint that keeps other layers
    unquantized would need a per-layer choice, which is not implemented."""
    others = [name for name in ignored if name not in _ALWAYS_UNQUANTIZED]
    if others:
        shown = ", ".join(others[:3]) + (f" (and {len(others) - 3} more)" if len(others) > 3 else "")
        raise ValueError(f"{source}: keeping layers unquantized ({shown}) is not supported; only lm_head and "
                         "the embedding may be left out of FP8")
