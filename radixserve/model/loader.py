"""Build a model on its device and fill it from safetensors or with dummy weights.

The loader knows no model's names: each checkpoint tensor goes to the parameter of the same name,
or, for projections the model fuses, to the shard its `packed_modules_mapping` declares, through
the owning layer's `load_weight`. A tensor-parallel layer (`reads_slices`) is handed a lazy
safetensors slice and reads only its rank's part of the tensor.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Literal, Optional, Union

import torch
from torch import nn

from radixserve.attention.base import AttentionBackend
from radixserve.distributed import TensorParallel
from radixserve.model.config import ModelConfig
from radixserve.model.layers import KernelChoice, ShardId, copy_weight
from radixserve.model.qwen2 import Qwen2ForCausalLM
from radixserve.model.quantization import quantization_config
from radixserve.model.registry import model_class
from radixserve.settings import DECODE_GEMM_MAX_ROWS

logger = logging.getLogger(__name__)

LoadFormat = Literal["auto", "safetensors", "dummy"]
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DUMMY_STD = 0.02


# Checkpoint tensors that carry nothing the model needs (recomputed buffers).
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|rotary_emb\.cos_cached|rotary_emb\.sin_cached)$")


def load_model(model_path: Union[str, os.PathLike], *, load_format: LoadFormat = "auto",
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               attn_backend: AttentionBackend, seed: int = 0, context_length: Optional[int] = None,
               triton_kernels: Optional[bool] = None, decode_gemm_max_rows: int = DECODE_GEMM_MAX_ROWS,
               tp: Optional[TensorParallel] = None, quantization: Optional[str] = None
               ) -> tuple[Qwen2ForCausalLM, ModelConfig]:
    """The model in eval mode with every parameter set, and its config.

    `quantization="fp8"` quantizes a bf16/fp16/fp32 checkpoint's projections to FP8 as they load;
    a checkpoint whose config.json declares FP8 (radixserve.model.quantization) loads as FP8
    without it; any other quantization_config is a ValueError.
    `context_length` (if larger than the config's max_position_embeddings) extends the RoPE table.
    `triton_kernels` and `decode_gemm_max_rows` fix the layers' kernels (`KernelChoice.for_device`:
    by default Triton on CUDA in bfloat16/float16, torch ops elsewhere; False forces the torch
    reference path). `tp`: build and load this rank's shard of a tensor-parallel model (dummy
    weights are then random per rank, not a sharding of the tp_size 1 model's).
    """
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format {load_format!r} is not one of auto, safetensors, dummy")
    config = ModelConfig.from_dir(model_path)
    weight_files = [] if load_format == "dummy" else safetensors_files(model_path)
    fp8 = quantization_config(config.raw, quantization, source=f"{model_path}/config.json")
    kernels = KernelChoice.for_device(device, dtype, triton=triton_kernels, decode_gemm_max_rows=decode_gemm_max_rows)
    # The class config.json's architecture names (radixserve.model.registry; ModelConfig refused any other).
    model = model_class(config.architecture)(config, attn_backend, dtype=dtype, device=device,
                                             max_positions=context_length, kernels=kernels, tp=tp, fp8=fp8)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_safetensors_weights(model, weight_files)
    for module in model.modules():
        finish = getattr(module, "finish_loading", None)
        if finish is not None:
            finish()
    model.eval()
    model.requires_grad_(False)
    return model, config


def safetensors_files(model_path: Union[str, os.PathLike]) -> list[Path]:
    """The checkpoint's safetensors files: from the index if there is one, else model.safetensors."""
    directory = Path(model_path)
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}")
        if files:
            return files
    single = directory / SINGLE_FILE
    if single.is_file():
        return [single]
    # Some exports name the file differently and ship no index.
    others = sorted(directory.glob("*.safetensors"))
    if others:
        return others
    raise FileNotFoundError(f"no safetensors weights in {str(directory)!r}: expected {SINGLE_FILE} or {INDEX_FILE} "
                            "with its shards (or use load_format='dummy' for random weights)")


def checkpoint_targets(model: nn.Module) -> dict[str, tuple[str, Optional[ShardId]]]:
    """Checkpoint tensor name -> (parameter name, shard id or None) for every tensor the model needs.

    A parameter's checkpoint name is its own name, except inside a fused module that the model's
    `packed_modules_mapping` ({checkpoint module: (fused module, shard id)}) lists: each of its
    sources fills one shard of it; and except in a module that names its checkpoint tensors itself
    (`checkpoint_tensors()`: {name under the module: (its parameter, shard id)}, e.g. the routed
    experts, whose per-expert tensors fill one stacked parameter).
    """
    sources: dict[str, list[tuple[str, ShardId]]] = {}
    for source, (fused, shard_id) in getattr(model, "packed_modules_mapping", {}).items():
        sources.setdefault(fused, []).append((source, shard_id))
    targets: dict[str, tuple[str, Optional[ShardId]]] = {}
    owned: set[str] = set()
    for module_name, module in model.named_modules():
        own = getattr(module, "checkpoint_tensors", None)
        if own is None:
            continue
        for source, (param, shard_id) in own().items():
            targets[f"{module_name}.{source}"] = (f"{module_name}.{param}", shard_id)
        owned.update(f"{module_name}.{p}" for p, _ in module.named_parameters())
    for name, _ in model.named_parameters():
        if name in owned:
            continue
        module_path, _, leaf = name.rpartition(".")
        parent, _, module_name = module_path.rpartition(".")
        for source, shard_id in sources.get(module_name, ()):
            targets[f"{parent}.{source}.{leaf}" if parent else f"{source}.{leaf}"] = (name, shard_id)
        if module_name not in sources:
            targets[name] = (name, None)
    return targets


def _tied_aliases(model: nn.Module) -> set[str]:
    """Names of parameters that are another parameter (a tied lm_head): a checkpoint may carry them,
    the model reads the one they share."""
    unique = {name for name, _ in model.named_parameters()}
    return {name for name, _ in model.named_parameters(remove_duplicate=False)} - unique


def _load_one(model: nn.Module, param_name: str, shard_id: Optional[ShardId], f, name: str) -> None:
    """Checkpoint tensor `name` of open file `f` into its parameter: as a lazy slice for a layer
    that reads only its part (tensor parallelism), else read whole."""
    module_path, _, leaf = param_name.rpartition(".")
    module = model.get_submodule(module_path)
    load_weight = getattr(module, "load_weight", None)
    if load_weight is not None:
        load_weight(leaf, f.get_slice(name) if getattr(module, "reads_slices", False) else f.get_tensor(name),
                    shard_id)
    else:
        copy_weight(getattr(module, leaf), f.get_tensor(name))


@torch.no_grad()
def load_safetensors_weights(model: nn.Module, files: list[Path]) -> None:
    """Copy every tensor into its place (cast to the model's dtype, moved to its device); ValueError
    names a missing or misshapen tensor."""
    from safetensors import safe_open

    targets = checkpoint_targets(model)
    ignored = _tied_aliases(model)
    kv_scales = getattr(model, "kv_scale_pattern", None)
    # A model whose checkpoint names differ from its own (a multimodal checkpoint's language model)
    # maps them; None: a tensor it does not read (a vision tower), skipped without a warning.
    rename = getattr(model, "checkpoint_name", None)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for stored in f.keys():
                name = rename(stored) if rename is not None else stored
                if name is None:
                    continue
                if name not in targets:
                    match = kv_scales.match(name) if kv_scales is not None else None
                    if match is not None:
                        _set_kv_scale(model, int(match.group(1)), match.group(2), f.get_tensor(stored), name)
                    elif not (_IGNORED.search(name) or name in ignored):
                        unexpected.append(name)
                    continue
                param_name, shard_id = targets[name]
                try:
                    _load_one(model, param_name, shard_id, f, stored)
                except ValueError as e:
                    raise ValueError(f"tensor {stored!r} in {file.name} {e}") from None
                loaded.add(name)
    missing = [name for name in targets if name not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing tensor(s): {shown}")
    if unexpected:
        logger.warning("ignored %d checkpoint tensor(s) the model does not use: %s", len(unexpected),
                       ", ".join(unexpected[:5]))


def _set_kv_scale(model: nn.Module, layer: int, which: str, tensor: torch.Tensor, name: str) -> None:
    """One layer's FP8 KV-cache scale ("k", "v", or "kv" for both) into model.kv_cache_scales."""
    scales = model.kv_cache_scales
    if not 0 <= layer < len(scales) or tensor.numel() != 1:
        raise ValueError(f"tensor {name!r} is not a scale of one of the model's {len(scales)} layers "
                         f"(shape {tuple(tensor.shape)}; expected one value)")
    value = float(tensor.float().reshape(-1)[0])
    if not value > 0 or value == float("inf"):
        raise ValueError(f"tensor {name!r}: a KV cache scale must be positive and finite, got {value}")
    k, v = scales[layer]
    scales[layer] = (value if which in ("k", "kv") else k, value if which in ("v", "kv") else v)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights in place on the model's device and dtype, the same for the same seed.

    Norm weights are 1 (as in a freshly initialised HF model); everything else is N(0, 0.02)
    (a quantized weight format fills its layer's parameters itself, `fill_dummy`: N(0, 0.02)
    quantized per output row or per block).
    """
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    quantized: set[str] = set()
    for module_name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and method.quantized:
            method.fill_dummy(module, generator, DUMMY_STD)
            quantized.update(f"{module_name}.{p}" for p, _ in module.named_parameters(recurse=False))
    for name, param in model.named_parameters():  # registration order: deterministic
        if name in quantized:
            continue
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, DUMMY_STD, generator=generator)
