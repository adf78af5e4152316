"""The mixture-of-experts layers (radixserve.model.layers.moe) on the CPU reference path against
transformers' own MoE blocks (Qwen3-MoE: router + experts; Qwen2-MoE: + the shared expert and its
sigmoid gate), in float32: the routed experts run the same ops in the same order, so their outputs
are equal; the shared expert's fused gate|up GEMM rounds apart from transformers' two.

FP8 experts against the reference on their dequantized weights (the FP8 reference is that, by
construction: weights dequantized, activations kept), and the loading paths each layout takes.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from radixserve.distributed import SingleRank
from radixserve.model.layers import KernelChoice
from radixserve.model.layers.fp8 import FP8_DTYPE
from radixserve.model.layers.fp8_block import quantize_blocks
from radixserve.model.layers.moe import SparseMoeBlock, experts_reference, route_reference
from radixserve.model.moe_config import check_expert_blocks
from radixserve.model.quantization import Fp8Config

H, I, E, TOP_K = 32, 16, 8, 2
CPU = KernelChoice(triton=False)


def hf_block(kind: str, seed: int = 0, norm_topk_prob: bool = True, shared: int = 24):
    torch.manual_seed(seed)
    common = dict(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=TOP_K,
                  norm_topk_prob=norm_topk_prob, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)
    if kind == "qwen3":
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**common))
    else:
        block = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(**common, shared_expert_intermediate_size=shared))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.3)
    return block.eval()


def checkpoint_tensors(hf) -> dict[str, torch.Tensor]:
    """The block's tensors under their checkpoint names (per expert, as save_pretrained writes them)."""
    out = {"gate.weight": hf.gate.weight.detach().clone()}
    gate_up, down = hf.experts.gate_up_proj.detach(), hf.experts.down_proj.detach()
    for e in range(E):
        out[f"experts.{e}.gate_proj.weight"] = gate_up[e, :I].clone()
        out[f"experts.{e}.up_proj.weight"] = gate_up[e, I:].clone()
        out[f"experts.{e}.down_proj.weight"] = down[e].clone()
    if hasattr(hf, "shared_expert"):
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"shared_expert.{name}.weight"] = getattr(hf.shared_expert, name).weight.detach().clone()
        out["shared_expert_gate.weight"] = hf.shared_expert_gate.weight.detach().clone()
    return out


@torch.no_grad()
def load_block(block: SparseMoeBlock, tensors: dict[str, torch.Tensor]) -> None:
    """Each tensor through the layer that owns it, as the loader routes them."""
    packed = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    own = block.experts.checkpoint_tensors()
    for name, t in tensors.items():
        if name.startswith("experts."):
            param, shard = own[name[len("experts."):]]
            block.experts.load_weight(param, t, shard)
        elif name.startswith("shared_expert."):
            _, module, leaf = name.split(".")
            fused, shard = packed.get(module, (module, None))
            getattr(block.shared_expert, fused).load_weight(leaf, t, shard)
        else:
            module, leaf = name.split(".")
            getattr(block, module).load_weight(leaf, t)
    block.experts.finish_loading()


def our_block(hf, *, shared: int = 0, fp8=None, norm_topk_prob: bool = True) -> SparseMoeBlock:
    block = SparseMoeBlock(H, num_experts=E, top_k=TOP_K, moe_intermediate_size=I, norm_topk_prob=norm_topk_prob,
                           dtype=torch.float32, kernels=CPU, tp=SingleRank("cpu"), fp8=fp8,
                           shared_expert_intermediate_size=shared)
    load_block(block, checkpoint_tensors(hf))
    return block


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_block_equals_transformers(norm_topk_prob):
    hf = hf_block("qwen3", norm_topk_prob=norm_topk_prob)
    ours = our_block(hf, norm_topk_prob=norm_topk_prob)
    x = torch.randn(37, H)
    with torch.no_grad():
        ref = hf(x[None])[0]
        logits, hf_weights, hf_ids = hf.gate(x)
        weights, ids = route_reference(ours.gate.forward(x), TOP_K, norm_topk_prob)
        out = ours.forward(x)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
    assert torch.equal(out, ref), (out - ref).abs().max()


def test_qwen2_moe_block_with_shared_expert_equals_transformers():
    hf = hf_block("qwen2", norm_topk_prob=False)
    ours = our_block(hf, shared=24, norm_topk_prob=False)
    x = torch.randn(29, H)
    with torch.no_grad():
        ref = hf(x[None])[0]
        out = ours.forward(x)
    # The shared expert runs gate|up as one GEMM where transformers runs two: float32 rounding apart.
    assert torch.allclose(out, ref, rtol=0, atol=1e-5), (out - ref).abs().max()


def test_experts_reference_equals_transformers_expert_module():
    """The routed part alone, fed the same routing: transformers' Qwen3MoeExperts vs ours."""
    hf = hf_block("qwen3")
    ours = our_block(hf)
    x = torch.randn(50, H)
    weights, ids = route_reference(torch.randn(50, E), TOP_K, True)
    with torch.no_grad():
        ref = hf.experts(x, ids, weights)
        out = experts_reference(x, weights, ids, E, ours.experts.expert_weights)
        fused_api = ours.experts.forward(x, weights, ids)
    assert torch.equal(out, ref) and torch.equal(fused_api, ref)


def test_tokens_no_expert_gets_and_empty_batches():
    hf = hf_block("qwen3", seed=3)
    ours = our_block(hf)
    x = torch.randn(3, H)
    ids = torch.tensor([[0, 1], [0, 1], [1, 0]])  # experts 2..7 get nothing
    weights = torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.9, 0.1]])
    with torch.no_grad():
        assert torch.equal(ours.experts.forward(x, weights, ids), hf.experts(x, ids, weights))
        assert ours.forward(torch.empty(0, H)).shape == (0, H)


def dequantized_block(fp8_block: SparseMoeBlock, hf) -> SparseMoeBlock:
    """A plain block whose experts are the FP8 block's experts dequantized (its reference)."""
    plain = our_block(hf)
    with torch.no_grad():
        for e in range(E):
            w13, w2 = fp8_block.experts.expert_weights(e)
            plain.experts.w13_weight[e].copy_(w13)
            plain.experts.w2_weight[e].copy_(w2)
    return plain


def test_fp8_experts_quantized_at_load_match_their_dequantized_reference():
    hf = hf_block("qwen3", seed=5)
    ours = our_block(hf, fp8=Fp8Config(from_checkpoint=False))
    ex = ours.experts
    assert ex.w13_weight.dtype == FP8_DTYPE and ex.w13_weight_scale.shape == (E, 2 * I)
    assert ex.w2_weight_scale.shape == (E, H)
    # Per expert, per output row: row r of expert e's gate is hf's gate row r quantized with max |w| -> 448.
    gate = hf.experts.gate_up_proj.detach()[3, :I]
    scale = gate.abs().amax(dim=1) / 448.0
    assert torch.allclose(ex.w13_weight_scale[3, :I], scale)
    w13, _ = ex.expert_weights(3)
    assert (w13[:I] - gate).abs().max() <= (scale[:, None] * 448 / 16).max()  # e4m3: 3 mantissa bits
    x = torch.randn(21, H)
    with torch.no_grad():
        out = ours.forward(x)
        ref = dequantized_block(ours, hf).forward(x)
        exact = hf(x[None])[0]
    assert torch.equal(out, ref)
    assert (out - exact).norm() / exact.norm() < 0.05  # what FP8 weights cost


def test_fp8_experts_from_block_wise_checkpoint_tensors():
    block = (8, 16)
    hf = hf_block("qwen3", seed=6)
    ours = SparseMoeBlock(H, num_experts=E, top_k=TOP_K, moe_intermediate_size=I, norm_topk_prob=True,
                          dtype=torch.float32, kernels=CPU, tp=SingleRank("cpu"),
                          fp8=Fp8Config(from_checkpoint=True, weight_scales="block", block=block, source="test"))
    tensors = {}
    for name, t in checkpoint_tensors(hf).items():
        if name.startswith("experts."):
            wq, scale = quantize_blocks(t, block)
            tensors[name] = wq
            tensors[name.replace(".weight", ".weight_scale_inv")] = scale
        else:
            tensors[name] = t
    load_block(ours, tensors)
    ex = ours.experts
    assert ex.w13_weight_scale_inv.shape == (E, 2 * I // 8, H // 16) and ex.w2_weight_scale_inv.shape == (E, 4, 1)
    w13, w2 = ex.expert_weights(2)
    gq, gs = quantize_blocks(hf.experts.gate_up_proj.detach()[2, I:], block)  # the up half
    assert torch.equal(w13[I:], gq.float() * gs.repeat_interleave(8, 0).repeat_interleave(16, 1))
    x = torch.randn(13, H)
    with torch.no_grad():
        assert torch.equal(ours.forward(x), dequantized_block(ours, hf).forward(x))


def test_fp8_layouts_the_experts_refuse():
    with pytest.raises(ValueError, match="gate_proj rows 24"):
        check_expert_blocks((16, 16), 24, 1)
    with pytest.raises(ValueError, match="tp_size=2 gives each rank's slice of moe_intermediate_size "
                                         "gate_proj rows 96.*down_proj input"):
        check_expert_blocks((128, 128), 192, 2)
    check_expert_blocks((128, 128), 768, 2)  # Qwen3-30B-A3B at tp 2: 384 = 3 blocks a rank
    with pytest.raises(ValueError, match="static activation scales"):
        SparseMoeBlock(H, num_experts=E, top_k=TOP_K, moe_intermediate_size=I, norm_topk_prob=True,
                       dtype=torch.float32, kernels=CPU, tp=SingleRank("cpu"),
                       fp8=Fp8Config(from_checkpoint=True, weight_scales="tensor", activations="static"))
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        SparseMoeBlock(H, num_experts=E, top_k=9, moe_intermediate_size=I, norm_topk_prob=True,
                       dtype=torch.float32, kernels=CPU, tp=SingleRank("cpu"))


def test_checkpoint_names_of_the_experts():
    hf = hf_block("qwen3")
    ours = our_block(hf)
    names = ours.experts.checkpoint_tensors()
    assert len(names) == 3 * E
    assert names["5.gate_proj.weight"] == ("w13_weight", (5, "gate"))
    assert names["5.down_proj.weight"] == ("w2_weight", (5, "down"))
    with pytest.raises(ValueError, match="has shape"):
        ours.experts.load_weight("w13_weight", torch.zeros(I + 1, H), (0, "gate"))


def test_fp8_checkpoints_may_keep_the_router_gates_unquantized():
    from radixserve.model.quantization import quantization_config

    qc = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
          "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.shared_expert_gate"]}
    assert quantization_config({"quantization_config": qc}).block == (128, 128)
    ct = {"quant_method": "compressed-tensors", "ignore": ["lm_head", "re:.*mlp.gate$"], "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
        "input_activations": {"type": "float", "num_bits": 8, "dynamic": True, "strategy": "token"}}}}
    assert quantization_config({"quantization_config": ct}).weight_scales == "channel"
    qc["modules_to_not_convert"] = ["model.layers.0.mlp.experts.0.gate_proj"]
    with pytest.raises(ValueError, match="experts.0.gate_proj"):
        quantization_config({"quantization_config": qc})
