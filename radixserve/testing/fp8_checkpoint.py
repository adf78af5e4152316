"""FP8 checkpoints made from a plain one (the tiny model), in the layouts published FP8 Qwen2
checkpoints use, plus the dequantized checkpoint they stand for: the oracle of the FP8 tests.

- "fp8": quantization_config {quant_method: fp8, activation_scheme: dynamic | static}; one
  float32 `weight_scale` per projection tensor (shape []), static: an `input_scale` per tensor.
  Block-wise (`block=(bn, bk)`, dynamic only): `weight_block_size` [bn, bk] in the config and a
  float32 `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] per tensor, one scale per block.
- "compressed-tensors": one config group of float8 Linear weights, strategy "tensor"
  (`weight_scale` [1]) or "channel" (`weight_scale` [N, 1]), per-token dynamic activations.

Optionally per-layer KV cache scales (`self_attn.k_scale` / `v_scale`). lm_head and the embedding
stay as they were. Written with safetensors and json only (no radixserve import): the format is
what is under test.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
Format = Literal["fp8", "compressed-tensors"]


@dataclass
class Fp8Checkpoint:
    """Where the FP8 checkpoint and its dequantized twin were written, and the static scales."""
    path: Path
    dequantized: Path
    # Projection module name (model.layers.{i}.self_attn.q_proj, ...) -> its static input scale.
    input_scales: dict[str, float] = field(default_factory=dict)


def _is_projection(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in PROJECTIONS and parts[-1] == "weight"


def quantize_tensor(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale [N, 1] per channel or [] per tensor) with max |w| -> 448."""
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    scale = (amax / FP8_MAX).clamp_min(1e-12)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale [ceil(N/bn), ceil(K/bk)]) with each block's max |w| -> 448."""
    bn, bk = block
    w = w.float()
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = w.abs()
    scale = (padded.view(rows, bn, cols, bk).amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)
    full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
    return (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_blocks(wq: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = wq.shape
    return wq.float() * scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]


def write_fp8_checkpoint(source: Union[str, Path], dest: Union[str, Path], *, fmt: Format = "fp8",
                         per_channel: bool = False, static_activations: bool = False,
                         block: Optional[tuple[int, int]] = None,
                         kv_scales: Optional[list[tuple[float, float]]] = None) -> Fp8Checkpoint:
    """Quantize `source` (a plain checkpoint directory, one model.safetensors) into `dest` in the
    given layout, and write `dest`-dequantized: the same model with every projection weight
    replaced by weight * scale in float32 (what the FP8 weights stand for), and the same KV
    scales."""
    from safetensors.torch import load_file, save_file

    if fmt == "fp8" and per_channel:
        raise ValueError("the fp8 format has per-tensor (or block-wise) weight scales only")
    if block is not None and (fmt != "fp8" or static_activations):
        raise ValueError("block-wise scales are written in the fp8 format, with dynamic activations")
    if fmt == "compressed-tensors" and static_activations:
        raise ValueError("these compressed-tensors checkpoints use dynamic per-token activations")
    source, dest = Path(source), Path(dest)
    dequant_dir = dest.parent / f"{dest.name}-dequantized"
    for out in (dest, dequant_dir):
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(source, out)
        for old in out.glob("*.safetensors*"):
            old.unlink()
    tensors = load_file(str(source / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    result = Fp8Checkpoint(dest, dequant_dir)
    for i, (name, w) in enumerate(sorted(tensors.items())):
        if not _is_projection(name):
            quantized[name] = w
            dequantized[name] = w.float()
            continue
        module = name[:-len(".weight")]
        if block is not None:
            wq, scale = quantize_blocks(w, block)
            quantized[name] = wq
            quantized[f"{module}.weight_scale_inv"] = scale
            dequantized[name] = dequantize_blocks(wq, scale, block)
            continue
        wq, scale = quantize_tensor(w, per_channel)
        quantized[name] = wq
        quantized[f"{module}.weight_scale"] = scale.reshape(-1, 1) if per_channel else (
            scale.reshape(1) if fmt == "compressed-tensors" else scale.reshape(()))
        dequantized[name] = wq.float() * scale
        if static_activations:
            # Distinct per tensor (q, k and v of one layer differ), around the activations' range.
            value = 0.01 + 0.001 * (i % 7)
            quantized[f"{module}.input_scale"] = torch.tensor(value, dtype=torch.float32)
            result.input_scales[module] = value
    for layer, (k, v) in enumerate(kv_scales or []):
        for out in (quantized, dequantized):  # the KV scales belong to both
            out[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k, dtype=torch.float32)
            out[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v, dtype=torch.float32)
    save_file(quantized, str(dest / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(dequant_dir / "model.safetensors"), metadata={"format": "pt"})

    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = _quantization_config(fmt, per_channel, static_activations)
    if block is not None:
        config["quantization_config"]["weight_block_size"] = list(block)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    plain = json.loads((source / "config.json").read_text())
    plain["dtype"] = "float32"
    plain.pop("torch_dtype", None)
    (dequant_dir / "config.json").write_text(json.dumps(plain, indent=2) + "\n")
    return result


def _quantization_config(fmt: Format, per_channel: bool, static_activations: bool) -> dict:
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "static" if static_activations else "dynamic",
                "ignored_layers": ["lm_head"]}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel" if per_channel else "tensor",
                        "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                  "dynamic": True},
        }},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }
