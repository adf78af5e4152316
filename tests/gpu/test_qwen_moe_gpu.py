"""Qwen3-MoE and Qwen2-MoE on a CUDA GPU: the tiny MoE models give transformers' greedy tokens in
fp32 (the fused MoE in IEEE float32) with CUDA graphs and overlap on and off and with a cached
prefix; in bf16 graphs change no token and most tokens agree with transformers' bf16; a
Qwen3-30B-A3B-shaped model (2 of its 48 layers, 128 experts, top-8) runs with dummy weights
through the fused layers close to the reference layers, and through the engine with graphs,
prefix hits and the memory plan. Skipped without CUDA.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")


from radixserve import Engine  # noqa: E402
from radixserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from radixserve.cache.kv_pool import KVPool  # noqa: E402
from radixserve.model.layers.moe import SparseMoeBlock  # noqa: E402
from radixserve.model.loader import load_model  # noqa: E402
from radixserve.testing.tiny_model import TinyMoe, build_tiny_model  # noqa: E402

from greedy_oracle import (check_bf16_graphs_change_no_token,  # noqa: E402
                           check_fp32_cached_prefix_gives_the_same_tokens, engine_greedy, hf_greedy,
                           prompts)
from test_engine_gpu import _logits  # noqa: E402

TINY = {
    "qwen3_moe": dict(family="qwen3_moe", layers=3, num_heads=4, num_kv_heads=2, head_dim=32, seed=5,
                      moe=TinyMoe(mlp_only_layers=(1,))),
    "qwen2_moe": dict(family="qwen2_moe", layers=3, seed=6, moe=TinyMoe(sparse_step=2, norm_topk_prob=False)),
}
CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks/configs"
QWEN3_30B_2_LAYERS = {**json.loads((CONFIGS / "qwen3-30b-a3b/config.json").read_text()), "num_hidden_layers": 2}


@pytest.fixture(scope="module", params=list(TINY))
def tiny_dir(request, tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp(request.param), **TINY[request.param]))


@pytest.fixture(scope="module")
def qwen3_30b_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-30b-a3b-2-layers")
    (path / "config.json").write_text(json.dumps(QWEN3_30B_2_LAYERS))
    return str(path)


@pytest.mark.parametrize("graphs,overlap", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("n", [3, 8])  # 3: padded to the 4-row graph
def test_fp32_greedy_equals_hf(tiny_dir, graphs, n, overlap):
    batch = prompts(n, 500, seed=n)
    ours, engine = engine_greedy(tiny_dir, "float32", batch, disable_cuda_graph=not graphs,
                                 disable_overlap_schedule=not overlap)
    model = engine.core.model
    assert model.kernels.fused_moe and not model.kernels.triton and model.graph_capturable
    assert any(isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers)
    runner = engine.core.runner
    assert (runner.graphs is not None) == graphs
    if graphs:
        assert runner.num_graph_steps > 0
    assert ours == hf_greedy(tiny_dir, torch.float32, batch)


def test_fp32_cached_prefix_gives_the_same_tokens(tiny_dir):
    check_fp32_cached_prefix_gives_the_same_tokens(tiny_dir)


def test_bf16_graphs_on_off_same_tokens_and_close_to_hf(tiny_dir):
    check_bf16_graphs_change_no_token(tiny_dir)


def test_qwen3_30b_shape_fused_layers_close_to_the_reference_layers(qwen3_30b_dir):
    """128 experts, top-8, hidden 2048, moe_intermediate 768, dummy weights (the same seed in both
    models): the fused MoE against transformers' expert loop, the Triton layers against torch's."""
    batch = prompts(5, 150000, seed=3)
    out = {}
    for triton_kernels in (None, False):
        model, cfg = load_model(qwen3_30b_dir, load_format="dummy", dtype=torch.bfloat16, device="cuda",
                                attn_backend=TritonAttentionBackend(), triton_kernels=triton_kernels, seed=5)
        assert model.kernels.fused_moe == (triton_kernels is None)
        pool = KVPool(4096, 1, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16, "cuda")
        out[triton_kernels] = _logits(model, pool, batch)
        del model
        torch.cuda.empty_cache()
    ref = out[False].double()
    assert torch.isfinite(out[None]).all()
    assert float((out[None].double() - ref).norm() / ref.norm()) < 2e-2


def test_qwen3_30b_shape_serves_with_graphs_prefix_hits_and_the_memory_plan(qwen3_30b_dir):
    """The memory plan (no --max-total-tokens) measures the MoE step's working set and counts the
    experts' weights: bf16, 2 x 623M layer weights + the vocabulary's 2 x 311M (3.48 GiB) plus what
    else torch holds by then (the RoPE tables: 3.52 GiB on an H200 run alone; more when an earlier
    test of the process still holds tensors); FP8 experts one byte each (2.46 GiB: 1.06 less).
    Dummy weights give nearly flat logits: tokens are only checked to be tokens; their equality
    with transformers is the tiny models'."""
    batch = prompts(8, 150000, seed=4)
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    weights = {}
    for quantization in (None, "fp8"):
        engine = Engine(qwen3_30b_dir, load_format="dummy", device="cuda", dtype="bfloat16", cuda_graph_max_bs=64,
                        mem_fraction_static=0.5, chunked_prefill_size=2048, max_running_requests=64,
                        quantization=quantization)
        plan = engine.core.memory_plan
        assert plan is not None and plan.kv_pool_tokens > 0
        weights[quantization] = plan.weights_bytes / 2 ** 30
        print(f"\nQwen3-30B-A3B, 2 layers, {quantization or 'bf16'}: {plan.describe()}")
        for _ in range(2):  # the second pass finds every prompt cached but its last token
            results = engine.generate(input_ids=batch, sampling_params=params)
            assert all(len(r["output_ids"]) == 16 and all(0 <= t < 151936 for t in r["output_ids"])
                       for r in results)
        assert engine.core.runner.num_graph_steps > 0
        assert sum(r["meta_info"]["cached_tokens"] for r in results) == sum(len(p) - 1 for p in batch)
        engine.check_invariants()
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()
    layers_and_vocab = (2 * 623_120_640 + 2 * 311_164_928) * 2 / 2 ** 30
    assert layers_and_vocab < weights[None] < layers_and_vocab + 0.75, weights
    experts_saved = 2 * 128 * 3 * 768 * 2048 / 2 ** 30  # a byte a weight instead of two
    assert weights[None] - weights["fp8"] > 0.9 * experts_saved, weights
