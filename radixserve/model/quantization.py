"""Which quantized formats the model runs, read from config.json's `quantization_config` and the
`--quantization` setting: FP8 (e4m3) weights, or none.

Supported: a bf16/fp16/fp32 checkpoint quantized at load (`quantization="fp8"`: per-output-channel
weight scales, per-token activation scales computed at run time); the `fp8` format (per-tensor
`weight_scale`, `activation_scheme` dynamic, or static with a per-tensor `input_scale`); and
`compressed-tensors` float8 (per-tensor or per-channel `weight_scale`; per-token dynamic or
per-tensor static activations); and block-wise `fp8` (`weight_block_size` [bn, bk]: one
`weight_scale_inv` per bn x bk block of the weight, activations quantized per token per bk
columns, the DeepSeek-V3 / Qwen3-FP8 layout). Every other method (awq, gptq, bitsandbytes,
gguf, ...) is a ValueError naming it: running such weights as if they were bf16 gives wrong
tokens.

Pure Python (no torch import), so the server's start-up checks read it before anything loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Optional

QUANTIZATION_METHODS = ("fp8",)
SUPPORTED = ("fp8 (quant_method 'fp8': per-tensor weight scales, dynamic or static activations; or "
             "block-wise weight_block_size [bn, bk] scales with dynamic activations), compressed-tensors "
             "float8 (per-tensor or per-channel weights), or --quantization fp8 on a bf16/fp16/fp32 checkpoint")
# Modules a checkpoint may leave unquantized that radixserve keeps in bf16 anyway.
_ALWAYS_UNQUANTIZED = ("lm_head", "re:.*lm_head", "model.embed_tokens", "embed_tokens")
# ... and a mixture-of-experts layer's router gate and shared-expert gate (mlp.gate,
# mlp.shared_expert_gate), by module name or as a compressed-tensors "re:" pattern.
_ROUTER_GATE = re.compile(r"^(re:\.\*)?(.*\.)?mlp\.(gate|shared_expert_gate)\$?$")

ActivationScheme = Literal["dynamic", "static"]


@dataclass(frozen=True)
class Fp8Config:
    """How the projections (every Linear but lm_head) hold FP8 weights.

    from_checkpoint: the checkpoint stores e4m3 weights with `weight_scale` (and, static,
    `input_scale`) tensors; False: it stores bf16/fp16/fp32 weights quantized per output channel
    as they load. weight_scales: "tensor" (one scale per checkpoint tensor), "channel" (one per
    output row) or "block" (one `weight_scale_inv` per `block` = (bn, bk) rows x columns of the
    weight; activations then get a scale per token per bk columns). activations: "dynamic" (a
    scale per token, computed at run time) or "static" (the checkpoint's per-tensor `input_scale`).
    """

    from_checkpoint: bool
    weight_scales: Literal["tensor", "channel", "block"] = "channel"
    activations: ActivationScheme = "dynamic"
    source: str = "--quantization fp8"
    block: Optional[tuple[int, int]] = None

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
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"{source}: fp8 activation_scheme {scheme!r} is not supported (dynamic or static)")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{source}: fp8 fmt {fmt!r} is not supported (only e4m3)")
    _check_ignored(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or [], source)
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Config(from_checkpoint=True, weight_scales="tensor", activations=scheme,
                         source="quant_method 'fp8'")
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"{source}: fp8 weight_block_size {block!r} is not supported (two positive integers, "
                         "[rows, columns] of a weight block)")
    if scheme != "dynamic":
        raise ValueError(f"{source}: block-wise FP8 (weight_block_size {list(block)}) with activation_scheme "
                         f"{scheme!r} is not supported; supported: {SUPPORTED}")
    return Fp8Config(from_checkpoint=True, weight_scales="block", activations="dynamic",
                     source="quant_method 'fp8' (block-wise)", block=(block[0], block[1]))


def check_block_alignment(fp8: Optional[Fp8Config], *, head_dim: int, num_heads: int, num_kv_heads: int,
                          intermediate_size: int, tp_size: int = 1, source: str = "config.json") -> None:
    """ValueError when a block-wise checkpoint's blocks would straddle a cut radixserve makes:
    the shards of the fused q|k|v and gate|up weights (each shard must start on a bn-row block),
    and with tensor parallelism each rank's rows (q|k|v, gate|up) and input columns (o_proj,
    down_proj). Rank-independent, so every rank (and the server before starting them) agrees."""
    if fp8 is None or fp8.block is None:
        return
    bn, bk = fp8.block
    q = num_heads // tp_size * head_dim
    kv = max(num_kv_heads // tp_size, 1) * head_dim
    inter = intermediate_size // tp_size
    cuts = [("q_proj rows", q, bn), ("k_proj rows", kv, bn), ("gate_proj rows", inter, bn)]
    if tp_size > 1:
        cuts += [("o_proj input columns", q, bk), ("down_proj input columns", inter, bk)]
    bad = [f"{name} {size}" for name, size, block in cuts if size % block]
    if not bad:
        return
    where = f"tp_size={tp_size} gives each rank" if tp_size > 1 else "the fused q|k|v and gate|up weights hold"
    raise ValueError(f"{source}: block-wise FP8 (weight_block_size [{bn}, {bk}]): {where} {', '.join(bad)}, "
                     f"not a whole number of blocks, so a block's scale would cover two shards"
                     + ("; use a tp_size that keeps whole blocks on each rank, or tp_size 1" if tp_size > 1 else
                        "; requantizing such checkpoints is not implemented"))


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
    others = [name for name in ignored if name not in _ALWAYS_UNQUANTIZED and not _ROUTER_GATE.match(name)]
    if others:
        shown = ", ".join(others[:3]) + (f" (and {len(others) - 3} more)" if len(others) > 3 else "")
        raise ValueError(f"{source}: keeping layers unquantized ({shown}) is not supported; only lm_head, "
                         "the embedding and mixture-of-experts router gates may be left out of FP8")
