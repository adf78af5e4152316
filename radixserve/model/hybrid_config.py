"""A hybrid model's layer plan (which decoder layers are linear attention, which full attention)
and its linear-attention shapes: plain data, read from config.json by the family hooks of
radixserve.model.registry and held by ModelConfig (torch-free, so both can import it)."""

from __future__ import annotations

from dataclasses import dataclass

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


@dataclass(frozen=True)
class HybridConfig:
    """A hybrid model's layer plan and its linear-attention (Gated DeltaNet) shapes, read from
    config.json by the family's hook (radixserve.model.registry): `layer_types` names each
    decoder layer's token mixer; the full-attention layers are gated (a sigmoid gate from the q
    projection on their output) with RoPE on the first `rotary_dim` values of each head."""
    layer_types: tuple[str, ...]
    linear_num_k_heads: int
    linear_num_v_heads: int
    linear_k_head_dim: int
    linear_v_head_dim: int
    conv_kernel: int
    rotary_dim: int
    # How the checkpoint stores the linear layers' input projection: "qkvz" (Qwen3-Next:
    # in_proj_qkvz and in_proj_ba, interleaved per key head) or "split" (Qwen3.5: in_proj_qkv,
    # in_proj_z, in_proj_b, in_proj_a).
    projection_layout: str

    @property
    def num_linear_layers(self) -> int:
        return self.layer_types.count(LINEAR_ATTENTION)

    @property
    def num_full_layers(self) -> int:
        return self.layer_types.count(FULL_ATTENTION)
