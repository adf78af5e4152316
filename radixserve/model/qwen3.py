"""Qwen3 dense (Qwen3-0.6B ... 32B): Qwen2's decoder with two differences, both read from
config.json by the family's hook in radixserve.model.registry, so the layers are Qwen2's:

- RMSNorm over each head of q and of k (weights `self_attn.q_norm` / `k_norm`, head_dim values,
  replicated on every tensor-parallel rank) between the q|k|v projection and RoPE;
- no bias on q, k and v (`attention_bias` false).

`head_dim` comes from config.json and need not be hidden_size / num_attention_heads (Qwen3-0.6B:
hidden 1024, 16 heads of 128): the attention width is heads x head_dim throughout, and o_proj
maps it back to hidden_size. The small sizes tie the LM head to the embedding, as Qwen2's do.
Checkpoint names, the fused q|k|v and gate|up, FP8 and the KV-scale names are Qwen2's.
"""

from __future__ import annotations

from radixserve.model.qwen2 import Qwen2ForCausalLM


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    """See the module docstring; built and loaded exactly as Qwen2ForCausalLM."""
