"""Build a Qwen2ForCausalLM on its device and fill it from safetensors or with dummy weights."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Literal, Optional, Union

import torch

from radixserve.attention.base import AttentionBackend
from radixserve.model.config import ModelConfig
from radixserve.model.qwen2 import Qwen2ForCausalLM

logger = logging.getLogger(__name__)

LoadFormat = Literal["auto", "safetensors", "dummy"]
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DUMMY_STD = 0.02

# Checkpoint tensors that carry nothing the model needs (recomputed buffers).
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|rotary_emb\.cos_cached|rotary_emb\.sin_cached)$")


def load_model(model_path: Union[str, os.PathLike], *, load_format: LoadFormat = "auto",
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               attn_backend: AttentionBackend, seed: int = 0,
               context_length: Optional[int] = None) -> tuple[Qwen2ForCausalLM, ModelConfig]:
    """The model in eval mode with every parameter set, and its config.

    `context_length` (if larger than the config's max_position_embeddings) extends the RoPE table.
    """
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format {load_format!r} is not one of auto, safetensors, dummy")
    config = ModelConfig.from_dir(model_path)
    weight_files = [] if load_format == "dummy" else safetensors_files(model_path)
    model = Qwen2ForCausalLM(config, attn_backend, dtype=dtype, device=device, max_positions=context_length)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_safetensors_weights(model, weight_files)
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


def _weight_targets(model: Qwen2ForCausalLM) -> dict[str, tuple[str, int, int]]:
    """HF tensor name -> (our parameter name, first row, end row) inside the (possibly fused) parameter."""
    cfg = model.config
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    targets: dict[str, tuple[str, int, int]] = {
        "model.embed_tokens.weight": ("embed_tokens.weight", 0, vocab),
        "model.norm.weight": ("norm.weight", 0, hidden),
    }
    if model.lm_head is not None:
        targets["lm_head.weight"] = ("lm_head.weight", 0, vocab)
    for i in range(cfg.num_hidden_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            qkv = f"{ours}self_attn.qkv_proj.{kind}"
            targets[f"{hf}self_attn.q_proj.{kind}"] = (qkv, 0, q)
            targets[f"{hf}self_attn.k_proj.{kind}"] = (qkv, q, q + kv)
            targets[f"{hf}self_attn.v_proj.{kind}"] = (qkv, q + kv, q + 2 * kv)
        targets[f"{hf}self_attn.o_proj.weight"] = (f"{ours}self_attn.o_proj.weight", 0, hidden)
        targets[f"{hf}mlp.gate_proj.weight"] = (f"{ours}mlp.gate_up_proj.weight", 0, inter)
        targets[f"{hf}mlp.up_proj.weight"] = (f"{ours}mlp.gate_up_proj.weight", inter, 2 * inter)
        targets[f"{hf}mlp.down_proj.weight"] = (f"{ours}mlp.down_proj.weight", 0, hidden)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            targets[f"{hf}{norm}.weight"] = (f"{ours}{norm}.weight", 0, hidden)
    return targets


@torch.no_grad()
def load_safetensors_weights(model: Qwen2ForCausalLM, files: list[Path]) -> None:
    """Copy every tensor into its place; ValueError names a missing or misshapen tensor."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    targets = _weight_targets(model)
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name not in targets:
                    # A tied checkpoint may still carry lm_head.weight; the model uses the embedding.
                    if not (_IGNORED.search(name) or name == "lm_head.weight"):
                        unexpected.append(name)
                    continue
                param_name, start, end = targets[name]
                dest = params[param_name][start:end]
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ValueError(f"tensor {name!r} in {file.name} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(dest.shape)} from config.json")
                dest.copy_(tensor)  # casts to the model dtype and moves to its device
                loaded.add(name)
    missing = [name for name in targets if name not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing tensor(s): {shown}")
    if unexpected:
        logger.warning("ignored %d checkpoint tensor(s) the model does not use: %s", len(unexpected),
                       ", ".join(unexpected[:5]))


@torch.no_grad()
def init_dummy_weights(model: Qwen2ForCausalLM, seed: int) -> None:
    """Random weights in place on the model's device and dtype, the same for the same seed.

    Norm weights are 1 (as in a freshly initialised HF model); everything else is N(0, 0.02).
    """
    device = model.embed_tokens.weight.device
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    for name, param in model.named_parameters():  # registration order: deterministic
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, DUMMY_STD, generator=generator)
