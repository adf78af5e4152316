"""Qwen3 dense on the CPU against transformers' Qwen3, through the offline engine, tensor parallelism
over gloo, FP8 and the real server; and the model-family registry that picks it.

The tiny Qwen3 has 4 query heads of head_dim 32 over hidden 64 (heads x head_dim = 128 != hidden),
2 KV heads, tied embeddings, random q/k norm weights: every Qwen3 difference from Qwen2 is on
the path. (tests/test_model.py runs the model-level equivalence tests on Qwen3 variants too.)
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch
import transformers

from conftest import ServerProcess
from test_engine import (GREEDY, check_greedy_cold_then_cached, check_idle, check_logprobs_equal_hf,
                         hf_greedy, make_prompts)
from test_fp8 import FP8_REL_TOL, hf_fake_quant, hf_logits, prefix_extend_decode, rel_max
from test_fp8_block import hf_group_fake_quant
from test_model import random_tokens

from radixserve import Engine
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.model.config import ModelConfig
from radixserve.model.layers.fp8 import FP8_DTYPE
from radixserve.model.loader import load_model
from radixserve.model.qwen3 import Qwen3ForCausalLM
from radixserve.model.registry import FAMILIES, model_class, supported_architectures
from radixserve.testing.fp8_checkpoint import write_fp8_checkpoint
from radixserve.testing.tiny_model import build_tiny_model

pytestmark = pytest.mark.timeout(300)

REPO_ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-4
TINY_QWEN3 = dict(family="qwen3", num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), seed=2, **TINY_QWEN3)
    prompts = make_prompts(512)[:12]  # three shared prefixes, a one-token prompt, a duplicate
    return path, prompts, hf_greedy(path, prompts)


# --------------------------------------------------------------------------- registry and config

def test_the_registry_builds_each_family_and_refuses_others():
    # The hybrids after them: tests/test_hybrid.py.
    assert supported_architectures()[:4] == ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                                             "Qwen2MoeForCausalLM")
    for arch in FAMILIES:
        assert model_class(arch).__name__ == arch
    assert model_class("Qwen3ForCausalLM") is Qwen3ForCausalLM
    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 256}
    cfg = ModelConfig.from_dict({**base, "model_type": "qwen3", "head_dim": 32})  # no architectures
    assert (cfg.architecture, cfg.qk_norm, cfg.qkv_bias, cfg.q_size, cfg.hidden_size) == \
        ("Qwen3ForCausalLM", True, False, 128, 64)
    qwen2 = ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"]})
    assert (qwen2.qk_norm, qwen2.qkv_bias, qwen2.model_type) == (False, True, "qwen2")
    with pytest.raises(ValueError, match=r"LlamaForCausalLM; supported: Qwen2ForCausalLM, Qwen3ForCausalLM"):
        ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="model_type='llama'.*qwen2, qwen3"):
        ModelConfig.from_dict({**base, "model_type": "llama"})
    with pytest.raises(ValueError, match="attention_bias=true is not supported"):
        ModelConfig.from_dict({**base, "architectures": ["Qwen3ForCausalLM"], "attention_bias": True})
    with pytest.raises(ValueError, match="attention_bias must be true or false"):
        ModelConfig.from_dict({**base, "architectures": ["Qwen3ForCausalLM"], "attention_bias": "no"})
    with pytest.raises(ValueError, match="unsupported architecture .LlamaForCausalLM"):
        model_class("LlamaForCausalLM")


def test_the_qwen3_8b_benchmark_config_has_the_published_shape():
    cfg = ModelConfig.from_dir(REPO_ROOT / "benchmarks/configs/qwen3-8b")
    assert (cfg.architecture, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == \
        ("Qwen3ForCausalLM", 4096, 12288, 36)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (32, 8, 128, 151936)
    assert (cfg.rope_theta, cfg.max_position_embeddings, cfg.rms_norm_eps) == (1e6, 40960, 1e-6)
    assert (cfg.tie_word_embeddings, cfg.qkv_bias, cfg.qk_norm, cfg.dtype) == (False, False, True, "bfloat16")


def test_the_qwen3_8b_benchmark_config_builds_its_published_parameter_count():
    """Built on the meta device (no memory): 8.19B parameters, 6.95B without the embedding and the
    LM head, as Qwen3-8B's model card says; the benchmarks' cost model counts the same layers."""
    from radixserve.bench.model_cost import ModelCost

    cfg = ModelConfig.from_dir(REPO_ROOT / "benchmarks/configs/qwen3-8b")
    model = model_class(cfg.architecture)(cfg, TorchAttentionBackend(), dtype=torch.bfloat16, device="meta",
                                          max_positions=64)
    total = sum(p.numel() for p in model.parameters())
    vocab_rows = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    assert (total, total - vocab_rows) == (8_190_735_360, 6_946_075_648)
    assert model.local_heads == (32, 8) and model.model.layers[0].self_attn.q_size == 4096
    assert ModelCost(cfg).matmul_params == total - vocab_rows - cfg.hidden_size  # all but the final norm


def test_tiny_qwen3_checkpoint_is_what_transformers_writes(qwen3):
    path = qwen3[0]
    raw = json.loads((path / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3ForCausalLM"] and raw["head_dim"] * raw["num_attention_heads"] == 128
    assert raw["hidden_size"] == 64 and raw["tie_word_embeddings"] and raw["attention_bias"] is False
    model, cfg = load_model(path, attn_backend=TorchAttentionBackend())
    assert isinstance(model, Qwen3ForCausalLM) and model.lm_head.weight is model.model.embed_tokens.weight
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.bias is None and attn.q_norm.weight.shape == (32,)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    # The norms' random weights (not HF's ones) are loaded where they belong.
    torch.testing.assert_close(attn.k_norm.weight, hf.model.layers[0].self_attn.k_norm.weight, atol=0, rtol=0)
    assert not torch.equal(attn.q_norm.weight, torch.ones(32))


# --------------------------------------------------------------------------- offline engine

def test_greedy_equals_hf_cold_and_with_cached_prefixes(qwen3):
    path, prompts, expected = qwen3
    check_greedy_cold_then_cached(path, prompts, expected)


@pytest.mark.parametrize("settings", [dict(chunked_prefill_size=7, page_size=4),
                                      dict(chunked_prefill_size=16, max_total_tokens=96, schedule_conservativeness=0.0,
                                           disable_overlap_schedule=True)],
                         ids=["chunk7-page4", "small-pool-retracts"])
def test_greedy_equals_hf_over_chunked_prefill_and_retraction(qwen3, settings):
    path, prompts, expected = qwen3
    with Engine(str(path), **{"max_total_tokens": 4096, **settings}) as engine:
        assert [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=GREEDY)] == expected
        if settings.get("max_total_tokens") == 96:
            assert engine.cache_stats()["retractions"] > 0
        check_idle(engine)


def test_logprobs_equal_hf_log_softmax(qwen3):
    path, prompts, _ = qwen3
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    check_logprobs_equal_hf(path, prompts, hf, max_new_tokens=6, atol=ATOL)


def test_tp2_equals_hf_with_replicated_qk_norms(qwen3):
    path, prompts, expected = qwen3
    with Engine(str(path), tp_size=2, max_total_tokens=4096, chunked_prefill_size=7) as engine:
        assert engine.core.model.local_heads == (2, 1)
        attn = engine.core.model.model.layers[1].self_attn
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        # Each rank holds every head_dim weight of the norms, whichever heads it holds.
        torch.testing.assert_close(attn.q_norm.weight, hf.model.layers[1].self_attn.q_norm.weight, atol=0, rtol=0)
        for _ in range(2):  # the second pass runs on a warm cache
            results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            assert [r["output_ids"] for r in results] == expected
        assert sum(r["meta_info"]["cached_tokens"] for r in results) == sum(len(p) - 1 for p in prompts)
        check_idle(engine)


# --------------------------------------------------------------------------- FP8

def test_fp8_quantized_at_load_matches_its_dequantized_reference(qwen3, tmp_path):
    """--quantization fp8: the projections hold e4m3 weights, the q/k norms stay in the model's
    dtype; logits match transformers' Qwen3 on the dequantized weights with e4m3 inputs."""
    path = qwen3[0]
    model, cfg = load_model(path, attn_backend=TorchAttentionBackend(), quantization="fp8")
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.weight.dtype == FP8_DTYPE and attn.q_norm.weight.dtype == torch.float32
    ckpt = write_fp8_checkpoint(path, tmp_path / "channel", fmt="compressed-tensors", per_channel=True)
    ours, seq = prefix_extend_decode(model, cfg, random_tokens(19, cfg.vocab_size, 6))
    assert rel_max(ours, hf_logits(hf_fake_quant(ckpt.dequantized, {}), seq)[:ours.shape[0]]) < FP8_REL_TOL


def test_fp8_block_checkpoint_matches_its_dequantized_reference(qwen3, tmp_path):
    """Block-wise FP8 (the Qwen3 FP8 releases' layout, [32, 32] blocks on the tiny shapes) with
    per-layer KV scales under Qwen3's names."""
    path = qwen3[0]
    ckpt = write_fp8_checkpoint(path, tmp_path / "block", block=(32, 32), kv_scales=[(0.5, 0.25), (1.0, 2.0)])
    model, cfg = load_model(ckpt.path, attn_backend=TorchAttentionBackend())
    assert model.model.layers[0].self_attn.qkv_proj.weight_scale_inv.shape == (8, 2)
    assert model.kv_cache_scales == [(0.5, 0.25), (1.0, 2.0)]
    ours, seq = prefix_extend_decode(model, cfg, random_tokens(21, cfg.vocab_size, 5))
    assert rel_max(ours, hf_logits(hf_group_fake_quant(ckpt.dequantized, 32), seq)) < FP8_REL_TOL


# --------------------------------------------------------------------------- the real server

def test_server_serves_qwen3_like_the_offline_engine(qwen3, server_workdir):
    path, prompts, expected = qwen3
    proc = ServerProcess(["--model-path", str(path), "--device", "cpu", "--max-total-tokens", "4096"],
                         server_workdir).wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused")
        assert client.models.list().data[0].id == path.name
        for _ in range(2):  # the second request finds its prompt cached
            completion = client.completions.create(model=path.name, prompt=prompts[1], temperature=0,
                                                   max_tokens=GREEDY["max_new_tokens"], extra_body={"ignore_eos": True})
            assert completion.choices[0].text == _decode(path, expected[1])
        assert completion.usage.prompt_tokens_details.cached_tokens == len(prompts[1]) - 1
    finally:
        proc.stop()


def _decode(path: Path, ids: list[int]) -> str:
    return transformers.AutoTokenizer.from_pretrained(path).decode(ids)
