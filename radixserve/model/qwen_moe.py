"""Mixture-of-experts Qwen: Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B) and
Qwen2-MoE (Qwen2-57B-A14B, Qwen1.5-MoE-A2.7B).

Both are Qwen2's decoder (radixserve.model.qwen2) with the MLP of some layers replaced by routed
experts (radixserve.model.layers.moe, `SparseMoeBlock`); config.json's `decoder_sparse_step` and
`mlp_only_layers` say which (radixserve.model.moe_config), the others keep a dense MLP of
`intermediate_size`. What each family reads from config.json is in radixserve.model.registry:

- Qwen3-MoE: Qwen3's attention (RMSNorm over each q and k head before RoPE, no q|k|v bias);
  `num_experts` experts of `moe_intermediate_size`, `num_experts_per_tok` per token, their
  probabilities renormalised with `norm_topk_prob`; no shared expert.
- Qwen2-MoE: Qwen2's attention (q|k|v bias); the routed experts plus a shared expert (a dense MLP
  of `shared_expert_intermediate_size`) whose output is scaled by sigmoid(shared_expert_gate(x)).

Checkpoint names are transformers': `mlp.gate.weight` (the router), `mlp.experts.{e}.gate_proj /
up_proj / down_proj.weight` (stacked into one gate|up and one down tensor per layer as they
load), `mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`. Under tensor parallelism each rank
holds a slice of every expert's intermediate; FP8 holds e4m3 experts per channel or per block.
"""

from __future__ import annotations

from radixserve.model.qwen2 import Qwen2ForCausalLM


class Qwen3MoeForCausalLM(Qwen2ForCausalLM):
    """See the module docstring; built and loaded as Qwen2ForCausalLM."""


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    """See the module docstring; built and loaded as Qwen2ForCausalLM."""
