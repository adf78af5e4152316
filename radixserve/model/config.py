"""The model's shape and constants, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from radixserve.model.hybrid_config import HybridConfig
from radixserve.model.moe_config import MoeConfig
from radixserve.model.quantization import Fp8Config, quantization_config
from radixserve.model.registry import family_of
# RoPE variants the model implements; anything else would silently give wrong positions.
SUPPORTED_ROPE_TYPES = (None, "default")

_DTYPE_NAMES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
                "bfloat16": "bfloat16"}


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    # Checkpoint dtype name ("bfloat16", ...) or None when the config does not say.
    dtype: Optional[str] = None
    model_type: str = "qwen2"
    # Family fields (set by the family's hook in radixserve.model.registry): q, k and v projections
    # with a bias (Qwen2), and RMSNorm over each q and k head before RoPE (Qwen3).
    qkv_bias: bool = True
    qk_norm: bool = False
    # Mixture of experts (Qwen3-MoE, Qwen2-MoE): the routed experts and which layers run them;
    # None for a dense model.
    moe: Optional[MoeConfig] = None
    # Hybrid models (Qwen3-Next, Qwen3.5): the layer plan and linear-attention shapes; None for
    # attention-only models.
    hybrid: Optional[HybridConfig] = None
    # The checkpoint's FP8 layout (its quantization_config), None for plain weights.
    quantization: Optional[Fp8Config] = None
    # The parsed config.json, for settings this dataclass does not model.
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep KV in the KV pool: all of them, or a hybrid's full-attention layers."""
        return self.num_hidden_layers if self.hybrid is None else self.hybrid.num_full_layers

    @property
    def has_recurrent_state(self) -> bool:
        """Whether requests carry a recurrent state (linear-attention layers) besides their KV."""
        return self.hybrid is not None and self.hybrid.num_linear_layers > 0

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer` runs the routed experts (else a dense MLP of intermediate_size)."""
        return self.moe is not None and self.moe.is_sparse(layer)

    @property
    def dense_intermediate_size(self) -> int:
        """intermediate_size if any layer runs a dense MLP, else 0 (nothing to split or tile)."""
        if all(self.is_sparse_layer(i) for i in range(self.num_hidden_layers)):
            return 0
        return self.intermediate_size

    @property
    def torch_dtype(self) -> Any:
        """The checkpoint dtype as a torch.dtype, or None."""
        if self.dtype is None:
            return None
        import torch

        return getattr(torch, self.dtype)

    @classmethod
    def from_dir(cls, path: Union[str, os.PathLike]) -> "ModelConfig":
        directory = Path(path)
        if not directory.is_dir():
            raise FileNotFoundError(f"model directory {str(directory)!r} does not exist or is not a directory")
        config_file = directory / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{str(config_file)!r} is missing: a model directory needs a Hugging Face "
                                    "config.json")
        try:
            data = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{str(config_file)!r} is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"{str(config_file)!r} must hold a JSON object")
        return cls.from_dict(data, source=str(config_file))

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> "ModelConfig":
        family = family_of(data, source)
        if family.text_config:
            data = _language_model_config(data, source)

        def need(key: str) -> Any:
            if data.get(key) is None:
                raise ValueError(f"{source}: required key {key!r} is missing")
            return data[key]

        hidden_size = int(need("hidden_size"))
        num_heads = int(need("num_attention_heads"))
        num_kv_heads = int(data.get("num_key_value_heads") or num_heads)
        head_dim = data.get("head_dim")
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"{source}: hidden_size {hidden_size} is not divisible by "
                                 f"num_attention_heads {num_heads} and no head_dim is given")
            head_dim = hidden_size // num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"{source}: num_attention_heads {num_heads} is not a multiple of "
                             f"num_key_value_heads {num_kv_heads}")
        if int(head_dim) % 2:
            raise ValueError(f"{source}: head_dim {head_dim} must be even for rotary embeddings")
        hidden_act = data.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"{source}: hidden_act {hidden_act!r} is not supported (only 'silu')")
        if data.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is not supported (only full attention)")
        num_layers = int(need("num_hidden_layers"))
        fields = family.parse_config(data, source)
        moe = fields.get("moe")
        if data.get("intermediate_size") is None and moe is not None and \
                all(moe.is_sparse(i) for i in range(num_layers)):
            intermediate = 0  # no dense MLP anywhere (Qwen3.5-MoE's configs carry no intermediate_size)
        else:
            intermediate = int(need("intermediate_size"))

        return cls(
            architecture=family.architecture,
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=int(head_dim),
            intermediate_size=intermediate,
            vocab_size=int(need("vocab_size")),
            max_position_embeddings=int(need("max_position_embeddings")),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(data, source),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            eos_token_ids=_int_list(data.get("eos_token_id")),
            bos_token_id=data.get("bos_token_id"),
            pad_token_id=data.get("pad_token_id"),
            dtype=_dtype_name(data.get("dtype", data.get("torch_dtype"))),
            model_type=str(data.get("model_type", family.model_type)),
            quantization=quantization_config(data, source=source),
            raw=data,
            **fields,
        )


def _language_model_config(data: dict[str, Any], source: str) -> dict[str, Any]:
    """A multimodal checkpoint's (...ForConditionalGeneration) language model config: its
    text_config's keys over the top level's (architectures, model_type and what the text config
    leaves out); the vision tower's are not read."""
    text = data.get("text_config")
    if text is None:
        return data
    if not isinstance(text, dict):
        raise ValueError(f"{source}: text_config must be an object")
    top = {k: v for k, v in data.items() if k not in ("text_config", "vision_config")}
    return {**top, **{k: v for k, v in text.items() if k not in ("architectures", "model_type")}}


def _rope_theta(data: dict[str, Any], source: str) -> float:
    # transformers 5 writes rope_parameters = {rope_theta, rope_type}; older configs write a
    # top-level rope_theta and an optional rope_scaling dict.
    params = data.get("rope_parameters") or {}
    scaling = data.get("rope_scaling") or {}
    for spec in (params, scaling):
        rope_type = spec.get("rope_type", spec.get("type"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"{source}: RoPE scaling type {rope_type!r} is not supported "
                             "(only the default RoPE without scaling)")
    theta = params.get("rope_theta", data.get("rope_theta", 10000.0))
    return float(theta)


def _int_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _dtype_name(value: Any) -> Optional[str]:
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {value!r} in config (float32, float16 or bfloat16)")
    return _DTYPE_NAMES[name]
