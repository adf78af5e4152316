"""Hybrid Qwen models (Qwen3-Next, Qwen3.5 and its multimodal checkpoints' language model, and their
MoE forms) on the CPU against transformers: the config keys and the registry, the checkpoints' layouts, logits over
prefill chunks and decode steps, the offline engine cold and resumed from the prefix cache's
recurrent-state snapshots (chunked, paged, retracting, without overlap, taken back after a failed
allocation), a conversation's next turn and requests branching off a shared prompt, log
probabilities, tensor parallelism over gloo, and the real server.

The tiny hybrids (radixserve.testing.tiny_model) alternate Gated DeltaNet and gated attention
layers (4 layers), with 4 query heads of head_dim 32 over hidden 64 (q|gate rows 256), 2 KV heads,
RoPE on 8 of 32 values, and 2 key / 4 value heads of 16 in the linear layers; every norm and bias
random. The MoE forms: 8 experts of 32, top-2, a shared expert of 48 (Qwen3-Next: every second
layer sparse; Qwen3.5-MoE: every layer). A warm pass resumes from snapshots (cached_tokens > 0)
and computes the same tokens as transformers' cold ones.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from conftest import ServerProcess
from test_alloc_failure import FailWhen
from test_engine import GREEDY, check_idle, hf_greedy, make_prompts
from test_model import PoolHarness

from radixserve import Engine
from radixserve.attention.base import ForwardMode
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.no_cache import NoPrefixCache
from radixserve.cache.snapshot_cache import SnapshotRadixCache
from radixserve.cache.state_pool import RecurrentStatePool, RecurrentStateSpec
from radixserve.engine.model_stack import state_spec
from radixserve.model.config import ModelConfig
from radixserve.model.loader import load_model
from radixserve.model.qwen3_next import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration
from radixserve.model.registry import supported_architectures
from radixserve.testing.tiny_model import TinyMoe, build_tiny_model

pytestmark = pytest.mark.timeout(600)

ATOL = 1e-4
FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_vl", "qwen3_next_moe", "qwen3_5_moe")
# Test name -> (the tiny model's family, its experts).
BUILDS = {"qwen3_next_moe": ("qwen3_next", TinyMoe(sparse_step=2)), "qwen3_5_moe": ("qwen3_5_moe", TinyMoe())}
BASE = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 256}


def build(tmp_path_factory, name: str, seed: int = 3) -> Path:
    family, moe = BUILDS.get(name, (name, None))
    return build_tiny_model(tmp_path_factory.mktemp(f"tiny-{name}"), family=family, layers=4, head_dim=32,
                            seed=seed, moe=moe)


def hf_model(path: Path):
    cls = transformers.Qwen3_5ForConditionalGeneration if "ForConditionalGeneration" in \
        json.loads((path / "config.json").read_text())["architectures"][0] else transformers.AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=FAMILIES)
def hybrid(request, tmp_path_factory):
    return build(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    path = build(tmp_path_factory, "qwen3_5", seed=4)
    prompts = make_prompts(512)[:10]  # shared prefixes, a one-token prompt, a duplicate
    return path, prompts, hf_greedy(path, prompts)


# --------------------------------------------------------------------------- config and registry

def test_the_registry_has_the_hybrids_and_refuses_what_they_do_not_implement():
    assert supported_architectures()[4:] == ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM",
                                             "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                                             "Qwen3_5MoeForConditionalGeneration")
    cfg = ModelConfig.from_dict({**BASE, "architectures": ["Qwen3_5ForCausalLM"],
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                                     "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                                                     "mrope_interleaved": True}})
    h = cfg.hybrid
    # No layer_types: every 4th layer full attention (full_attention_interval's default).
    assert h.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (cfg.num_kv_layers, cfg.has_recurrent_state, h.rotary_dim, cfg.rope_theta) == (1, True, 8, 1e7)
    assert (h.linear_num_k_heads, h.linear_num_v_heads, h.linear_k_head_dim, h.conv_kernel) == (16, 32, 128, 4)
    assert (cfg.qk_norm, cfg.qkv_bias, h.projection_layout) == (True, False, "split")
    interval = ModelConfig.from_dict({**BASE, "architectures": ["Qwen3NextForCausalLM"], "num_experts": 0,
                                      "full_attention_interval": 2})
    assert interval.hybrid.layer_types[1::2] == ("full_attention",) * 2 and interval.hybrid.projection_layout == "qkvz"
    assert interval.moe is None
    # Qwen3-Next without MoE keys: transformers' defaults (512 experts, top-10, shared expert 512).
    nxt = ModelConfig.from_dict({**BASE, "architectures": ["Qwen3NextForCausalLM"], "mlp_only_layers": [0]})
    assert (nxt.moe.num_experts, nxt.moe.top_k, nxt.moe.shared_expert_intermediate_size) == (512, 10, 512)
    assert [nxt.is_sparse_layer(i) for i in range(4)] == [False, True, True, True]
    # Qwen3.5-MoE: every layer sparse whatever the keys say, top-k renormalised, no intermediate_size needed.
    base = {k: v for k, v in BASE.items() if k != "intermediate_size"}
    moe = ModelConfig.from_dict({**base, "architectures": ["Qwen3_5MoeForCausalLM"], "num_experts": 8,
                                 "num_experts_per_tok": 2, "norm_topk_prob": False, "mlp_only_layers": [1]})
    assert (moe.moe.num_experts, moe.moe.top_k, moe.moe.norm_topk_prob, moe.dense_intermediate_size) == (8, 2, True, 0)
    assert all(moe.is_sparse_layer(i) for i in range(4))
    refused = {
        "shared_expert_intermediate_size must be positive": {
            "architectures": ["Qwen3NextForCausalLM"], "shared_expert_intermediate_size": 0},
        "attention_bias=true is not supported": {"architectures": ["Qwen3_5ForCausalLM"], "attention_bias": True},
        "attn_output_gate=False is not supported": {"architectures": ["Qwen3_5ForCausalLM"], "attn_output_gate": False},
        "layer_types sliding_attention not supported": {"architectures": ["Qwen3_5ForCausalLM"],
                                                        "layer_types": ["sliding_attention"] * 4},
        "layer_types must list one type for each of the 4 layers": {"architectures": ["Qwen3_5ForCausalLM"],
                                                                    "layer_types": ["full_attention"]},
        "linear_num_value_heads 24 is not a multiple of linear_num_key_heads 16": {
            "architectures": ["Qwen3_5ForCausalLM"], "linear_num_value_heads": 24},
        "RoPE scaling type 'yarn' is not supported": {"architectures": ["Qwen3_5ForCausalLM"],
                                                      "rope_parameters": {"rope_type": "yarn"}},
    }
    for message, keys in refused.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            ModelConfig.from_dict({**BASE, **keys})
    with pytest.raises(ValueError, match="Qwen3NextForConditionalGeneration; supported: "):
        ModelConfig.from_dict({**BASE, "architectures": ["Qwen3NextForConditionalGeneration"]})


def test_a_multimodal_config_is_read_from_its_text_config():
    cfg = ModelConfig.from_dict({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                                 "tie_word_embeddings": False, "vision_config": {"depth": 27, "hidden_size": 1152},
                                 "text_config": {**BASE, "eos_token_id": 7, "model_type": "qwen3_5_text"}})
    assert (cfg.architecture, cfg.model_type, cfg.hidden_size, cfg.eos_token_ids) == \
        ("Qwen3_5ForConditionalGeneration", "qwen3_5", 64, [7])
    assert "vision_config" not in cfg.raw and cfg.hybrid.num_full_layers == 1


# --------------------------------------------------------------------------- checkpoints and logits

def test_each_checkpoint_layout_loads_where_transformers_has_it(hybrid):
    """Qwen3.5's split projections, Qwen3-Next's per-key-head interleaved ones and the multimodal
    checkpoint's `model.language_model.` names all land in the same fused layout."""
    model, cfg = load_model(hybrid, attn_backend=TorchAttentionBackend())
    hf = hf_model(hybrid)
    lm = hf.model.language_model if isinstance(model, Qwen3_5ForConditionalGeneration) else hf.model
    ours, theirs = model.model.layers[0].linear_attn, lm.layers[0].linear_attn
    h = ours.heads
    w = ours.in_proj.weight
    if hasattr(theirs, "in_proj_qkv"):
        qkv, z = theirs.in_proj_qkv.weight, theirs.in_proj_z.weight
        b, a = theirs.in_proj_b.weight, theirs.in_proj_a.weight
    else:  # de-interleave transformers' way
        dummy = torch.eye(cfg.hidden_size)[None]
        q, k, v, zz, bb, aa = theirs.fix_query_key_value_ordering(theirs.in_proj_qkvz(dummy), theirs.in_proj_ba(dummy))
        qkv = torch.cat([x.reshape(cfg.hidden_size, -1) for x in (q, k, v)], dim=1).t()
        z, b, a = zz.reshape(cfg.hidden_size, -1).t(), bb[0].t(), aa[0].t()
    torch.testing.assert_close(w[:h.conv_dim], qkv, atol=1e-6, rtol=0)
    torch.testing.assert_close(w[h.conv_dim:h.conv_dim + h.value_dim], z, atol=1e-6, rtol=0)
    torch.testing.assert_close(w[h.conv_dim + h.value_dim:], torch.cat([b, a]), atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.conv1d.weight, theirs.conv1d.weight[:, 0], atol=0, rtol=0)
    attn = model.model.layers[1].self_attn
    torch.testing.assert_close(attn.q_norm.scale, 1 + lm.layers[1].self_attn.q_norm.weight, atol=0, rtol=0)
    assert attn.qkv_proj.weight.shape == (2 * 4 * 32 + 2 * 2 * 32, 64)  # q|gate rows, then k, v
    # The KV pool holds the two full-attention layers; the state pool one row per request of the two others.
    assert cfg.num_kv_layers == len(model.kv_cache_scales) == 2
    spec = state_spec(model)
    assert (spec.num_layers, spec.conv_shape, spec.ssm_shape) == (2, (3, 2 * 2 * 16 + 4 * 16), (4, 16, 16))


def harness(model, cfg) -> PoolHarness:
    h = PoolHarness(model, cfg)
    h.pool = KVPool(4096, 1, cfg.num_kv_layers, cfg.num_key_value_heads, cfg.head_dim, model.dtype, "cpu")
    h.pool.state = RecurrentStatePool(16, RecurrentStateSpec(**model.recurrent_state_shape), "cpu")
    h._free_pages = h.pool.allocator.alloc_pages(h.pool.allocator.num_pages)
    return h


def test_logits_equal_transformers_over_prefill_chunks_mixed_steps_and_decode(hybrid):
    """Request a: a 40-token prefill, a 59-token chunk on its state, then decode; request b starts
    in the step where a decodes (a mixed batch). Every new token's logits against transformers'."""
    model, cfg = load_model(hybrid, attn_backend=TorchAttentionBackend())
    hf = hf_model(hybrid)
    g = torch.Generator().manual_seed(0)
    a = torch.randint(3, cfg.vocab_size, (103,), generator=g).tolist()
    b = torch.randint(3, cfg.vocab_size, (30,), generator=g).tolist()
    h = harness(model, cfg)
    got_a = [h.step({"a": a[:40]})["a"], h.step({"a": a[40:99]})["a"]]
    mixed = h.step({"a": a[99:100], "b": b})
    got_a.append(mixed["a"])
    got_b = [mixed["b"]]
    for t in range(100, 103):
        step = h.step({"a": a[t:t + 1], "b": [t]}, mode=ForwardMode.DECODE)
        got_a.append(step["a"])
        got_b.append(step["b"])
    b += [100, 101, 102]
    with torch.no_grad():
        ref_a, ref_b = hf(torch.tensor([a])).logits[0], hf(torch.tensor([b])).logits[0]
    torch.testing.assert_close(torch.cat(got_a), ref_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got_b), ref_b, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------- the offline engine

@pytest.mark.parametrize("settings", [dict(), dict(chunked_prefill_size=7, page_size=4),
                                      dict(chunked_prefill_size=7, disable_overlap_schedule=True),
                                      dict(chunked_prefill_size=16, max_total_tokens=96, schedule_conservativeness=0.0,
                                           disable_overlap_schedule=True)],
                         ids=["default", "chunk7-page4", "chunk7-no-overlap", "small-pool-retracts"])
def test_greedy_equals_transformers_cold_and_resumed_from_state_snapshots(qwen3_5, settings):
    """The second pass resumes each prompt at the deepest snapshot of its prefix (a branch point
    taken by the first pass: 40 falls inside a 7-token chunk, which ends there) and keeps every
    token; the small pool retracts, and a retracted request resumes from its own snapshot."""
    path, prompts, expected = qwen3_5
    with Engine(str(path), **{"max_total_tokens": 4096, **settings}) as engine:
        assert isinstance(engine.core.cache, SnapshotRadixCache) and engine.core.kv_pool.state is not None
        cached = []
        for _ in range(2):
            results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            assert [r["output_ids"] for r in results] == expected
            cached.append([r["meta_info"]["cached_tokens"] for r in results])
            check_idle(engine)
        stats = engine.cache_stats()
        page = engine.settings.page_size
        assert all(c % page == 0 and c < len(p) for c, p in zip(cached[1], prompts))
        if settings.get("max_total_tokens") == 96:
            assert stats["retractions"] > 0
        else:
            assert sum(cached[1]) > sum(cached[0]) and stats["snapshot_hits"] >= sum(c > 0 for c in cached[1]) > 0
            assert stats["cached_prompt_tokens"] == sum(map(sum, cached))
        assert stats["snapshots_taken"] > 0 and stats["snapshot_bytes"] == \
            stats["snapshots_held"] * engine.core.kv_pool.snapshots.bytes_per_slot


def test_without_snapshots_nothing_is_reused(qwen3_5):
    """--mamba-cache-size 0: no snapshot pool, the cache that keeps nothing, the same tokens."""
    path, prompts, expected = qwen3_5
    with Engine(str(path), max_total_tokens=4096, mamba_cache_size=0) as engine:
        assert isinstance(engine.core.cache, NoPrefixCache) and engine.core.kv_pool.snapshots is None
        for _ in range(2):
            results = engine.generate(input_ids=prompts[:4], sampling_params=GREEDY)
            assert [r["output_ids"] for r in results] == expected[:4]
            assert sum(r["meta_info"]["cached_tokens"] for r in results) == 0
        check_idle(engine)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_conversations_next_turn_resumes_where_the_last_one_ended(qwen3_5, page_size):
    """Turn 2 = turn 1's prompt + its output + new text: it resumes after everything turn 1
    computed (its last output token never was: turn 2 computes it), 49 + 8 - 1 = 56 positions, a
    whole number of pages. (A request's row holds one state, after its last computed position: with
    pages of several tokens a sequence's end is kept only where it ends a page.)"""
    path, prompts, _ = qwen3_5
    turn1 = prompts[3]
    with Engine(str(path), max_total_tokens=4096, chunked_prefill_size=16, page_size=page_size) as engine:
        first = engine.generate(input_ids=[turn1], sampling_params={**GREEDY, "max_new_tokens": 8})[0]
        turn2 = turn1 + first["output_ids"] + [11, 12, 13, 14, 15, 16, 17]
        second = engine.generate(input_ids=[turn2], sampling_params=GREEDY)[0]
        check_idle(engine)
    computed = len(turn1) + len(first["output_ids"]) - 1
    assert computed == 56 and first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == computed
    assert second["output_ids"] == hf_greedy(path, [turn2])[0]


def test_requests_branching_off_a_shared_prompt_resume_at_the_branch_point(qwen3_5):
    """a, b and c share a 40-token system prompt. a computes it all (nothing is cached); b finds its
    KV but no state there, so its prompt pieces end at the branch point (inside a 16-token chunk)
    and the state there is kept; c resumes at the branch point."""
    path = qwen3_5[0]
    system = [(5 * i) % 90 + 3 for i in range(40)]
    a, b, c = (system + [(k * 7 + j) % 90 + 3 for j in range(9)] for k in range(3))
    with Engine(str(path), max_total_tokens=4096, chunked_prefill_size=16) as engine:
        cache = engine.core.cache
        got = []
        for prompt in (a, b):
            got.append(engine.generate(input_ids=[prompt], sampling_params=GREEDY)[0])
            assert got[-1]["meta_info"]["cached_tokens"] == 0
        assert cache.peek(c[:-1])[0] == len(system)  # the state at the branch point is there
        got.append(engine.generate(input_ids=[c], sampling_params=GREEDY)[0])
        assert got[-1]["meta_info"]["cached_tokens"] == len(system)
        assert engine.cache_stats()["snapshot_hits"] == 1
        check_idle(engine)
    assert [r["output_ids"] for r in got] == hf_greedy(path, [a, b, c])


def test_bfloat16_states_halve_the_pool_and_keep_the_tokens(qwen3_5):
    """--mamba-ssm-dtype bfloat16: half the bytes a request; the kernels still compute in float32,
    rounding the state once a step (on the tiny model no greedy token changes)."""
    path, prompts, expected = qwen3_5
    with Engine(str(path), max_total_tokens=4096, chunked_prefill_size=7, mamba_ssm_dtype="bfloat16") as engine:
        state = engine.core.kv_pool.state
        assert state.ssm[0].dtype == torch.bfloat16 and state.conv[0].dtype == torch.float32
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        got = [r["output_ids"] for r in results]
        same = sum(next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), len(e)) for g, e in zip(got, expected))
        assert same / sum(map(len, expected)) >= 0.8
        check_idle(engine)


def test_a_step_that_cannot_allocate_restarts_the_requests_whose_states_it_moved(qwen3_5):
    """The second big prefill step fails in the last layer's MLP, after the linear layers before it
    advanced its chunked requests' states: those requests start over, and every output is
    unchanged."""
    path = qwen3_5[0]
    shared = [(5 * i) % 500 + 3 for i in range(300)]
    prompts = [shared + [(7 * i + j) % 500 + 3 for j in range(20 + i)] for i in range(6)]
    params = {**GREEDY, "max_new_tokens": 4}
    with Engine(str(path), max_total_tokens=8192, chunked_prefill_size=1024) as engine:
        expected = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]
    with Engine(str(path), max_total_tokens=8192, chunked_prefill_size=1024) as engine:
        mlp = engine.core.model.model.layers[-1].mlp
        seen = []

        def second_big_step(args):
            seen.append(args[0].shape[0] > 300)
            return seen.count(True) == 2

        mlp.forward = FailWhen(mlp.forward, second_big_step, 1)
        got = engine.generate(input_ids=prompts, sampling_params=params)
        assert mlp.forward.raised == 1 and engine.cache_stats()["alloc_failures"] == 1
        assert engine.cache_stats()["retractions"] >= 1  # the chunked request mid-prompt started over
        assert [r["output_ids"] for r in got] == expected
        check_idle(engine)


def test_logprobs_equal_transformers_log_softmax(qwen3_5):
    path, prompts, _ = qwen3_5
    hf = hf_model(path)
    batch = [prompts[1], prompts[2], prompts[5]]
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "return_logprob": True,
              "top_logprobs_num": 3, "logprob_start_len": 0}
    with Engine(str(path), max_total_tokens=4096, chunked_prefill_size=16) as engine:
        results = engine.generate(input_ids=batch, sampling_params=params)
    for prompt, result in zip(batch, results):
        meta, out = result["meta_info"], result["output_ids"]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt + out])).logits[0].float(), dim=-1)
        for k, (value, token, _) in enumerate(meta["input_token_logprobs"][1:], start=1):
            assert value == pytest.approx(ref[k - 1, token].item(), abs=ATOL)
        for k, ((value, token, _), top) in enumerate(zip(meta["output_token_logprobs"], meta["output_top_logprobs"])):
            row = ref[len(prompt) - 1 + k]
            assert token == out[k] and value == pytest.approx(row[token].item(), abs=ATOL)
            assert [v for v, _, _ in top] == pytest.approx(row.topk(3).values.tolist(), abs=ATOL)


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next_moe"])
def moe_hybrid(request, tmp_path_factory):
    path = build(tmp_path_factory, request.param, seed=5)
    prompts = make_prompts(512)[1:8]  # three share a 33-token system prompt, two a 21-token one
    return request.param, path, prompts, hf_greedy(path, prompts)


def test_moe_hybrids_resume_from_state_snapshots_with_transformers_tokens(moe_hybrid):
    """Qwen3.5-MoE and Qwen3-Next, chunked in 5-token pieces (the branch points fall inside them)."""
    _, path, prompts, expected = moe_hybrid
    with Engine(str(path), max_total_tokens=4096, chunked_prefill_size=5) as engine:
        passes = [engine.generate(input_ids=prompts, sampling_params=GREEDY) for _ in range(2)]
        for results in passes:
            assert [r["output_ids"] for r in results] == expected
        assert sum(r["meta_info"]["cached_tokens"] for r in passes[1]) > 0
        check_idle(engine)


def test_tp2_shards_both_layer_kinds_and_the_experts_and_resumes_with_transformers_tokens(moe_hybrid):
    """Every rank holds its heads' share of each snapshot: rank 0's copies (restores at admission,
    states taken at chunk ends and sequence ends) go to rank 1 with the next step."""
    _, path, prompts, expected = moe_hybrid
    with Engine(str(path), tp_size=2, max_total_tokens=4096, chunked_prefill_size=7) as engine:
        model = engine.core.model
        assert model.local_heads == (2, 1)
        linear = model.model.layers[0].linear_attn
        assert (linear.heads.num_k, linear.heads.num_v, linear.heads.k_start) == (1, 2, 0)
        assert engine.core.kv_pool.state.ssm[0].shape[1:] == (2, 16, 16)  # this rank's value heads
        assert engine.core.kv_pool.snapshots.ssm[0].shape[1:] == (2, 16, 16)
        experts = model.model.layers[1].mlp.experts  # a sparse layer: every expert's intermediate split
        assert experts.w13_weight.shape == (8, 2 * 16, 64) and model.model.layers[1].mlp.shared_expert is not None
        cached = 0
        for _ in range(2):
            results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            assert [r["output_ids"] for r in results] == expected
            cached = sum(r["meta_info"]["cached_tokens"] for r in results)
        assert cached > 0 and engine.cache_stats()["snapshot_hits"] > 0
        check_idle(engine)


# --------------------------------------------------------------------------- the real server

def test_server_serves_the_multimodal_checkpoint_as_text_and_resumes_from_state_snapshots(tmp_path_factory,
                                                                                           server_workdir):
    """The same prompt three times: the first computes it, the second finds its KV but no state
    before its last token, so it keeps one there (a prompt piece ends there), the third resumes there;
    usage and /metrics count only that reuse."""
    path = build(tmp_path_factory, "qwen3_5_vl", seed=6)
    prompt = make_prompts(512)[1]
    expected = hf_greedy(path, [prompt])[0]
    proc = ServerProcess(["--model-path", str(path), "--device", "cpu", "--max-total-tokens", "4096",
                          "--mamba-cache-size", "8"], server_workdir).wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused")
        cached = []
        for _ in range(3):
            completion = client.completions.create(model=path.name, prompt=prompt, temperature=0,
                                                   max_tokens=GREEDY["max_new_tokens"], extra_body={"ignore_eos": True})
            assert completion.choices[0].text == transformers.AutoTokenizer.from_pretrained(path).decode(expected)
            cached.append(completion.usage.prompt_tokens_details.cached_tokens)
        assert cached == [0, 0, len(prompt) - 1]
        with pytest.raises(openai.BadRequestError, match="only text parts are supported, got 'image_url'"):
            client.chat.completions.create(model=path.name, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}])
        metrics = httpx.get(f"{proc.base_url}/metrics").text
        assert 'enable_prefix_caching="True"' in metrics
        assert "radixserve:state_snapshot_slots 8.0" in metrics
        assert "radixserve:state_snapshot_hits_total 1.0" in metrics
        assert re.search(r"^radixserve:state_snapshots [1-8]\.0$", metrics, re.M)
        assert "prefix cache: 8 recurrent-state snapshots" in proc.output()
    finally:
        proc.stop()


# --------------------------------------------------------------------------- benchmark configs

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_the_qwen3_5_27b_benchmark_config_builds_its_published_language_model():
    """Built on the meta device: the language model's 26.90B parameters (transformers'
    Qwen3_5ForConditionalGeneration on this config counts the same outside `model.visual`; the
    published 27.8B adds the vision tower and the MTP layer), 48 linear and 16 full layers."""
    cfg = ModelConfig.from_dir(REPO_ROOT / "benchmarks/configs/qwen3.5-27b")
    assert (cfg.architecture, cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == \
        ("Qwen3_5ForConditionalGeneration", 5120, 64, 17408)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hybrid.rotary_dim) == (24, 4, 256, 64)
    h = cfg.hybrid
    assert (h.num_linear_layers, h.num_full_layers, h.linear_num_k_heads, h.linear_num_v_heads) == (48, 16, 16, 48)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.rope_theta, cfg.tie_word_embeddings) == \
        (248320, 262144, 1e7, False)
    model = Qwen3_5ForConditionalGeneration(cfg, TorchAttentionBackend(), dtype=torch.bfloat16, device="meta",
                                            max_positions=64)
    assert sum(p.numel() for p in model.parameters()) == 26_895_998_464
    # Per request: 48 layers x (48 x 128 x 128 float32 state + 3 x 10,240 bf16 conv window).
    assert state_spec(model).bytes_per_row == 48 * (48 * 128 * 128 * 4 + 3 * 10240 * 2)


def test_the_qwen3_6_35b_a3b_benchmark_config_builds_its_published_language_model():
    """Built on the meta device: the language model's 34.66B parameters (transformers' count outside
    `model.visual` on this config; 35B with the vision tower), every layer 256 experts of 512, top-8,
    and a shared expert of 512."""
    cfg = ModelConfig.from_dir(REPO_ROOT / "benchmarks/configs/qwen3.6-35b-a3b")
    moe = cfg.moe
    assert (cfg.architecture, cfg.hidden_size, cfg.num_hidden_layers, cfg.dense_intermediate_size) == \
        ("Qwen3_5MoeForConditionalGeneration", 2048, 40, 0)
    assert (moe.num_experts, moe.top_k, moe.moe_intermediate_size, moe.shared_expert_intermediate_size,
            moe.norm_topk_prob) == (256, 8, 512, 512, True)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hybrid.linear_num_v_heads) == \
        (16, 2, 256, 32)
    model = Qwen3_5MoeForConditionalGeneration(cfg, TorchAttentionBackend(), dtype=torch.bfloat16, device="meta",
                                               max_positions=64)
    assert sum(p.numel() for p in model.parameters()) == 34_660_610_688
    assert all(type(layer.mlp).__name__ == "SparseMoeBlock" for layer in model.model.layers)
