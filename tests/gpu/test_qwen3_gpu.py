"""Qwen3 dense on a CUDA GPU: the tiny Qwen3 (heads x head_dim wider than hidden, tied embeddings,
random q/k norm weights) gives transformers' greedy tokens in fp32 with CUDA graphs and overlap on
and off; in bf16 (the Triton kernels: the q/k norms inside the RoPE kernel) graphs change no
token and most tokens agree with transformers' bf16; a Qwen3-0.6B-shaped model (head_dim 128,
16 x 128 = 2048 query width over hidden 1024) runs with dummy weights through graphs and prefix
hits with the Triton layers close to the torch layers. Skipped without CUDA.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")


from radixserve import Engine  # noqa: E402
from radixserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from radixserve.cache.kv_pool import KVPool  # noqa: E402
from radixserve.model.loader import load_model  # noqa: E402
from radixserve.model.qwen3 import Qwen3ForCausalLM  # noqa: E402
from radixserve.testing.tiny_model import build_tiny_model  # noqa: E402

from greedy_oracle import (check_bf16_graphs_change_no_token,  # noqa: E402
                           check_fp32_cached_prefix_gives_the_same_tokens, engine_greedy, hf_greedy,
                           prompts)
from test_engine_gpu import _logits  # noqa: E402

# Qwen3-0.6B's published shape with 2 of its 28 layers.
QWEN3_0_6B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
              "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
              "num_attention_heads": 16, "num_hidden_layers": 2, "num_key_value_heads": 8, "rms_norm_eps": 1e-6,
              "rope_theta": 1000000, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
              "use_sliding_window": False, "vocab_size": 151936, "eos_token_id": 151645}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-gpu"), family="qwen3", num_heads=4,
                                num_kv_heads=2, head_dim=32, tie_word_embeddings=True, seed=2))


@pytest.fixture(scope="module")
def qwen3_06b_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-0.6b-2-layers")
    (path / "config.json").write_text(json.dumps(QWEN3_0_6B))
    return str(path)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("n", [1, 3, 8])  # 3: padded to the 4-row graph
def test_fp32_greedy_equals_hf(tiny_dir, graphs, n, overlap):
    batch = prompts(n, 500, seed=n)
    ours, engine = engine_greedy(tiny_dir, "float32", batch, disable_cuda_graph=not graphs,
                                 disable_overlap_schedule=not overlap)
    assert isinstance(engine.core.model, Qwen3ForCausalLM)
    runner = engine.core.runner
    assert (runner.graphs is not None) == graphs
    if graphs:
        assert runner.num_graph_steps > 0
    assert ours == hf_greedy(tiny_dir, torch.float32, batch, "Qwen3ForCausalLM")


def test_fp32_cached_prefix_gives_the_same_tokens(tiny_dir):
    check_fp32_cached_prefix_gives_the_same_tokens(tiny_dir, "Qwen3ForCausalLM")


def test_bf16_graphs_on_off_same_tokens_and_close_to_hf(tiny_dir):
    check_bf16_graphs_change_no_token(tiny_dir)


def test_qwen3_0_6b_shape_triton_layers_close_to_torch_layers(qwen3_06b_dir):
    """head_dim 128 with 16 query heads over hidden 1024: the attention kernels, RoPE and the q/k
    norms at the published shape, dummy weights (the same seed in both models)."""
    batch = prompts(5, 150000, seed=3)
    out = {}
    for triton_kernels in (None, False):
        model, cfg = load_model(qwen3_06b_dir, load_format="dummy", dtype=torch.bfloat16, device="cuda",
                                attn_backend=TritonAttentionBackend(), triton_kernels=triton_kernels, seed=5)
        assert model.model.layers[0].self_attn.q_size == 2048 != cfg.hidden_size
        pool = KVPool(4096, 1, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16, "cuda")
        out[triton_kernels] = _logits(model, pool, batch)
    ref = out[False].double()
    assert torch.isfinite(out[None]).all()
    assert float((out[None].double() - ref).norm() / ref.norm()) < 2e-2


def test_qwen3_0_6b_shape_serves_with_graphs_and_prefix_hits(qwen3_06b_dir):
    """Dummy weights give nearly flat logits, where bf16 rounding picks among near-ties: the
    tokens are only checked to be tokens; their equality with transformers is the tiny model's."""
    batch = prompts(8, 150000, seed=4)
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    engine = Engine(qwen3_06b_dir, load_format="dummy", device="cuda", dtype="bfloat16", max_total_tokens=16384,
                    cuda_graph_max_bs=16)
    for _ in range(2):  # the second pass finds every prompt cached but its last token
        results = engine.generate(input_ids=batch, sampling_params=params)
        assert all(len(r["output_ids"]) == 16 and all(0 <= t < 151936 for t in r["output_ids"]) for r in results)
    assert engine.core.runner.num_graph_steps > 0
    assert sum(r["meta_info"]["cached_tokens"] for r in results) == sum(len(p) - 1 for p in batch)
    engine.check_invariants()
