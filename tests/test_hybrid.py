"""Hybrid Qwen models (Qwen3-Next, Qwen3.5 and its multimodal checkpoints' language model, and their
MoE forms) on the CPU against transformers: the config keys and the registry, the checkpoints' layouts, logits over
prefill chunks and decode steps, the offline engine cold and resumed from the prefix cache's
recurrent-state snapshots (chunked, paged, retracting, without overlap, taken back after a failed
allocation), a conversation's next turn and requests branching off a shared prompt, resumed from
snapshots that went to the host tier and came back, log probabilities, tensor parallelism over
gloo (with the host tier too), and the real server.

The tiny hybrids (radixserve.testing.tiny_model) alternate Gated DeltaNet and gated attention
layers (4 layers), with 4 query heads of head_dim 32 over hidden 64 (q|gate rows 256), 2 KV heads,
RoPE on 8 of 32 values, and 2 key / 4 value heads of 16 in the linear layers; every norm and bias
random. The MoE forms: 8 experts of 32, top-2, a shared expert of 48 (Qwen3-Next: every second
layer sparse; Qwen3.5-MoE: every layer). A warm pass resumes from snapshots (cached_tokens > 0)
and computes the same tokens as transformers' cold ones.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Callable

import httpx
import openai
import pytest
import torch
import transformers

from conftest import ServerProcess
from test_alloc_failure import FailWhen
from test_engine import GREEDY, check_idle, check_logprobs_equal_hf, hf_greedy, make_prompts
from test_model import PoolHarness

from radixserve import Engine
from radixserve.attention.base import ForwardMode
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.no_cache import NoPrefixCache
from radixserve.cache.radix_cache import PROMPT_END_SLACK
from radixserve.cache.state_pool import RecurrentStatePool, RecurrentStateSpec
from radixserve.cache.stores.snapshots import BRANCH_MIN_TOKENS
from radixserve.engine.messages import EngineStats
from radixserve.engine.model_stack import state_spec
from radixserve.model.config import ModelConfig
from radixserve.model.loader import load_model
from radixserve.model.qwen3_next import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration
from radixserve.model.registry import supported_architectures
from radixserve.server.metrics import ServerMetrics
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
        assert engine.core.cache.states is not None and engine.core.cache.host is None and engine.core.kv_pool.state is not None
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


def test_after_the_warm_up_a_conversations_next_turn_resumes_where_the_last_one_ended(qwen3_5):
    """A CUDA engine serves 34 throw-away prompts at start-up (`warmup`) and flushes them. Their
    snapshots never pay (nobody continues them): had the policy kept what they taught, it would
    refuse the first real conversations their sequence-end snapshots, and turn 2 here would resume
    at turn 1's prompt end (69) instead of its sequence end (93)."""
    path, _, _ = qwen3_5
    rng = random.Random(11)
    system = [rng.randrange(3, 500) for _ in range(5)] * 10
    batch = [system + [rng.randrange(3, 500) for _ in range(rng.randint(5, 20))] for _ in range(6)]
    params = {**GREEDY, "max_new_tokens": 24}
    with Engine(str(path), max_total_tokens=8192, chunked_prefill_size=16, mamba_cache_size=64) as engine:
        engine.core.warmup()
        first = [engine.generate(input_ids=batch, sampling_params=params) for _ in range(2)][0]
        turn2 = batch[0] + first[0]["output_ids"] + [7, 8, 9, 10]
        second = engine.generate(input_ids=[turn2], sampling_params=params)[0]
        check_idle(engine)
    assert second["meta_info"]["cached_tokens"] == len(batch[0]) + 24 - 1
    assert second["output_ids"] == hf_greedy(path, [turn2], max_new=24)[0]


def test_requests_branching_off_a_shared_prompt_resume_at_the_branch_point(qwen3_5):
    """a, b and c share a 60-token system prompt. a computes it all (nothing is cached), keeping
    checkpoints where its first two 16-token chunks end; b resumes at the deeper (32), finds KV past
    it but no state, so its prompt pieces end at the branch point (inside a 16-token chunk) and the
    state there is kept; c resumes at the branch point."""
    path = qwen3_5[0]
    system = [(5 * i) % 90 + 3 for i in range(60)]
    a, b, c = (system + [(k * 7 + j) % 90 + 3 for j in range(9)] for k in range(3))
    with Engine(str(path), max_total_tokens=4096, chunked_prefill_size=16) as engine:
        cache = engine.core.cache
        got = []
        for prompt, cached in ((a, 0), (b, 32)):
            got.append(engine.generate(input_ids=[prompt], sampling_params=GREEDY)[0])
            assert got[-1]["meta_info"]["cached_tokens"] == cached
        assert cache.peek(c[:-1])[0] == len(system)  # the state at the branch point is there
        got.append(engine.generate(input_ids=[c], sampling_params=GREEDY)[0])
        assert got[-1]["meta_info"]["cached_tokens"] == len(system)
        assert engine.cache_stats()["snapshot_hits"] == 2
        check_idle(engine)
    assert [r["output_ids"] for r in got] == hf_greedy(path, [a, b, c])


# Resume points past a 64-token base at these offsets: inside the Gated DeltaNet's 64-token chunks,
# on their boundaries (64, 128) and either side of them.
INSIDE_CHUNK_OFFSETS = (1, 31, 63, 64, 65, 129)


def check_resumes_inside_chunks_equal_transformers(path: Path, offsets, device: str = "cpu",
                                                   oracle: Callable[[Path, list[list[int]]], list[list[int]]] = hf_greedy
                                                   ) -> set[int]:
    """For each offset, three requests share 64 + offset tokens and then differ: the second keeps the
    state at the branch point, the third resumes exactly there, and its tokens are transformers'.
    The prefill computes 64-token chunks from where it resumes, so a resume point inside a chunk
    must be as exact as one on its boundary. A branch point less than BRANCH_MIN_TOKENS past where
    the second request resumed is not worth a piece of its own (the first request's checkpoints lie
    at 32, 64, 128: offsets 15 and 79), so there the third resumes where the second did. Returns
    the positions the third requests resumed at. oracle: transformers' greedy tokens (GREEDY's
    count) of prompts."""
    rng = random.Random(11)
    shared = [rng.randrange(3, 100) for _ in range(64 + max(offsets))]
    cases = [[shared[:64 + k] + [(i * 7 + j) % 90 + 3 for j in range(9)] for i in range(3)] for k in offsets]
    got, resumed = [], set()
    with Engine(str(path), device=device, dtype="float32", max_total_tokens=4096) as engine:
        for k, prompts in zip(offsets, cases):
            engine.core.cache.flush()
            results = [engine.generate(input_ids=[p], sampling_params=GREEDY)[0] for p in prompts]
            second = results[1]["meta_info"]["cached_tokens"]
            expected = 64 + k if 64 + k - second >= BRANCH_MIN_TOKENS else second
            assert results[2]["meta_info"]["cached_tokens"] == expected, (k, [r["meta_info"] for r in results])
            resumed.add(expected)
            got.append(results[2]["output_ids"])
        check_idle(engine)
    assert got == oracle(path, [prompts[2] for prompts in cases])
    return resumed


def test_a_resume_point_inside_a_chunk_is_as_exact_as_one_on_its_boundary(qwen3_5):
    check_resumes_inside_chunks_equal_transformers(qwen3_5[0], INSIDE_CHUNK_OFFSETS)


SECOND_USER_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


@pytest.fixture(scope="module", params=SECOND_USER_FAMILIES)
def second_user(request, tmp_path_factory):
    """A hybrid of each family and pairs of prompts sharing a new prefix of 48, 63, 100 and 300
    tokens, with transformers' greedy tokens for each."""
    path = build(tmp_path_factory, request.param, seed=7)
    rng = random.Random(7)
    pairs = []
    for shared in (48, 63, 100, 300):
        prefix = [rng.randrange(3, 100) for _ in range(shared)]
        pairs.append((shared, [prefix + [rng.randrange(3, 100) for _ in range(n)] for n in (17, 14)]))
    return path, pairs, hf_greedy(path, [p for _, pair in pairs for p in pair])


@pytest.mark.parametrize("settings", [dict(), dict(chunked_prefill_size=20, page_size=4)],
                         ids=["one-piece", "chunk20-page4"])
def test_the_second_request_sharing_a_new_prefix_finds_half_of_it(second_user, settings):
    """Two requests in a row share a prefix nobody computed before (48 to 300 tokens): the second
    finds at least half of it cached, resumed from a checkpoint the first kept on its way (captured
    by the forward pass inside its prompt piece, or where a chunk ended), and every token is
    transformers'."""
    path, pairs, expected = second_user
    got, cached = [], []
    with Engine(str(path), max_total_tokens=4096, **settings) as engine:
        for shared, pair in pairs:
            engine.core.cache.flush()
            for prompt in pair:
                result = engine.generate(input_ids=[prompt], sampling_params=GREEDY)[0]
                got.append(result["output_ids"])
                cached.append(result["meta_info"]["cached_tokens"])
            assert cached[-2] == 0 and shared / 2 <= cached[-1] <= shared, (shared, cached)
        check_idle(engine)
    assert got == expected


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
    """The second big prefill step (the first request's second 400-token chunk, with a checkpoint
    512 tokens in captured inside it) fails in the last layer's MLP, after the linear layers before
    it advanced its chunked request's state and wrote that checkpoint: the request starts over from
    what was kept before that step, and every output is unchanged."""
    path = qwen3_5[0]
    shared = [(5 * i) % 500 + 3 for i in range(900)]
    prompts = [shared + [(7 * i + j) % 500 + 3 for j in range(20 + i)] for i in range(6)]
    params = {**GREEDY, "max_new_tokens": 4}
    with Engine(str(path), max_total_tokens=8192, chunked_prefill_size=400) as engine:
        expected = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]
    with Engine(str(path), max_total_tokens=8192, chunked_prefill_size=400) as engine:
        mlp = engine.core.model.model.layers[-1].mlp
        seen = []

        def second_big_step(args):
            seen.append(args[0].shape[0] > 256)
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
    check_logprobs_equal_hf(path, prompts, hf, max_new_tokens=6, atol=ATOL)


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


# --------------------------------------------------------------------------- the host tier

def snapshot_nodes(cache) -> tuple[int, int]:
    """(nodes holding a device snapshot, nodes holding a host snapshot)."""
    nodes = list(cache.waiting.iter_nodes())
    return (sum(n.state is not None and n.state.slot is not None for n in nodes),
            sum(n.state is not None and n.state.host_slot is not None for n in nodes))


@pytest.mark.parametrize("settings", [dict(), dict(chunked_prefill_size=7, page_size=4, hicache_write_policy="write_through"),
                                      dict(hicache_ratio=2, mamba_host_cache_size=3, disable_overlap_schedule=True)],
                         ids=["default", "chunk7-page4-write-through", "small-host-tier"])
def test_greedy_equals_transformers_resumed_from_snapshots_that_went_to_the_host_tier(qwen3_5, settings):
    """A device pool of 160 tokens holds a few of the prompts; the host tier (8x) takes the rest with
    their snapshots, and the second pass resumes from states copied back from it with every token
    unchanged. The small host tier (2x, 3 snapshots) evicts on the host too."""
    path, prompts, expected = qwen3_5
    with Engine(str(path), **{"max_total_tokens": 160, "hicache_ratio": 8, "chunked_prefill_size": 16,
                              **settings}) as engine:
        cache = engine.core.cache
        assert cache.states is not None and cache.host is not None and not engine.core.kv_pool.snapshots.host.pinned
        cached = []
        for _ in range(2):
            results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            assert [r["output_ids"] for r in results] == expected
            cached.append([r["meta_info"]["cached_tokens"] for r in results])
            check_idle(engine)
        stats = engine.cache_stats()
        assert sum(cached[1]) > 0 and stats["evicted_tokens"] > 0 and stats["loaded_tokens"] > 0
        assert stats["snapshots_written_back"] > 0 and stats["snapshots_loaded"] > 0
        assert stats["host_snapshot_hits"] > 0 and stats["host_hit_rate"] > 0
        if "mamba_host_cache_size" in settings:
            assert stats["host_snapshot_slots"] == settings["mamba_host_cache_size"]
        else:  # 8x --mamba-cache-size, in no more bytes than the tier's KV, at least --mamba-cache-size
            host = engine.core.kv_pool.snapshots.host
            host_kv_bytes = stats["host_pool_tokens"] * HostKVPool.token_bytes(engine.core.kv_pool)
            assert 64 <= stats["host_snapshot_slots"] <= 8 * 64
            assert stats["host_snapshot_slots"] == 64 or host.total_bytes <= host_kv_bytes
        if "mamba_host_cache_size" in settings:
            assert stats["host_snapshot_evictions"] > 0
        assert snapshot_nodes(cache)[1] == stats["host_snapshots_held"] > 0
        assert stats["host_snapshot_bytes"] == stats["host_snapshots_held"] * engine.core.kv_pool.snapshots.bytes_per_slot
        # The counters reach /metrics beside the device snapshots'.
        metrics = ServerMetrics(lambda: EngineStats(time=0.0, values=stats), lambda: True).render().decode()
        for name in ("state_snapshot_host_hits_total", "state_snapshots_written_back_total",
                     "state_snapshots_loaded_total", "state_snapshot_host_evictions_total",
                     "state_snapshot_host_slots", "state_snapshots_host", "state_snapshot_host_bytes"):
            assert re.search(rf"^radixserve:{name} \d", metrics, re.M), name


def test_a_resume_from_a_host_snapshot_counts_as_a_host_hit(qwen3_5):
    """One device snapshot slot: a prefix whose KV stayed on the device but whose state came back
    from the host tier was served by that tier: its tokens count in host_hit_rate (once 0, as only
    copied-back KV counted; the GPU's default of one snapshot per 1,024 pool tokens makes this the
    usual case for a small pool)."""
    path = qwen3_5[0]
    gen = random.Random(11)
    system = [gen.randrange(1, 500) for _ in range(5)] * 10
    prompts = [system + [gen.randrange(1, 500) for _ in range(gen.randint(5, 40))] for _ in range(12)]
    params = {**GREEDY, "max_new_tokens": 8}
    with Engine(str(path), max_total_tokens=256, hicache_ratio=8, chunked_prefill_size=16,
                mamba_cache_size=1) as engine:
        first = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)]
        assert [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)] == first
        stats = engine.cache_stats()
        assert stats["host_snapshot_hits"] > 0 and stats["host_hit_rate"] > 0
        assert stats["hit_rate"] == pytest.approx(stats["device_hit_rate"] + stats["host_hit_rate"])
        check_idle(engine)


def test_a_conversations_next_turn_resumes_from_the_host_tier(qwen3_5):
    """Turn 1 ends, everything is pushed out of the device (its KV and its end's snapshot to the host),
    and turn 2 is copied back and resumes after all turn 1 computed, with transformers' tokens."""
    path, prompts, _ = qwen3_5
    turn1 = prompts[3]
    with Engine(str(path), max_total_tokens=4096, hicache_ratio=1, chunked_prefill_size=16) as engine:
        cache = engine.core.cache
        first = engine.generate(input_ids=[turn1], sampling_params={**GREEDY, "max_new_tokens": 8})[0]
        computed = len(turn1) + len(first["output_ids"]) - 1
        cache.evict(cache.memory.evictable)
        assert cache.memory.evictable == 0 and snapshot_nodes(cache)[0] == 0 and snapshot_nodes(cache)[1] > 0
        turn2 = turn1 + first["output_ids"] + [11, 12, 13, 14, 15, 16, 17]
        assert cache.peek(turn2[:-1])[0] == computed  # found on the host
        second = engine.generate(input_ids=[turn2], sampling_params=GREEDY)[0]
        stats = engine.cache_stats()
        check_idle(engine)
    assert second["meta_info"]["cached_tokens"] == computed
    assert stats["host_snapshot_hits"] == 1 and stats["host_cached_prompt_tokens"] == computed
    assert second["output_ids"] == hf_greedy(path, [turn2])[0]


def test_a_snapshot_the_device_pool_evicts_for_room_waits_on_the_host_tier(qwen3_5):
    """Two device snapshot slots: the next conversations' snapshots push turn 1's to the host tier
    while its KV stays on the device, and turn 2 resumes from the snapshot copied back, after all
    turn 1 computed (its reply of 40 tokens: the snapshot there saves more than the one near its
    prompt's end), with transformers' tokens."""
    path, prompts, _ = qwen3_5
    turn1 = prompts[3]
    with Engine(str(path), max_total_tokens=4096, hicache_ratio=1, chunked_prefill_size=16,
                mamba_cache_size=2) as engine:
        cache = engine.core.cache
        first = engine.generate(input_ids=[turn1], sampling_params={**GREEDY, "max_new_tokens": 40})[0]
        computed = len(turn1) + len(first["output_ids"]) - 1
        # Two later conversations as long: their snapshots, as valuable and newer, push turn 1's out.
        engine.generate(input_ids=prompts[:2], sampling_params={**GREEDY, "max_new_tokens": 40})
        stats = engine.cache_stats()
        assert stats["snapshots_written_back"] > 0 and stats["evicted_tokens"] == 0 and snapshot_nodes(cache)[1] > 0
        turn2 = turn1 + first["output_ids"] + [11, 12, 13, 14, 15, 16, 17]
        second = engine.generate(input_ids=[turn2], sampling_params=GREEDY)[0]
        stats = engine.cache_stats()
        check_idle(engine)
    assert second["meta_info"]["cached_tokens"] == computed
    # Its KV never left the device, but without the host's snapshot none of it could be reused: the
    # host tier served the whole prefix.
    assert stats["host_snapshot_hits"] == 1 and stats["host_cached_prompt_tokens"] == computed
    assert second["output_ids"] == hf_greedy(path, [turn2])[0]


def test_without_host_snapshots_the_host_tier_resumes_nothing_it_holds(qwen3_5):
    """--mamba-host-cache-size 0: a prefix pushed to the host loses its snapshot, so the next turn
    computes it again; the tokens stay transformers'."""
    path, prompts, _ = qwen3_5
    turn1 = prompts[3]
    with Engine(str(path), max_total_tokens=4096, hicache_ratio=1, mamba_host_cache_size=0) as engine:
        cache = engine.core.cache
        assert engine.core.kv_pool.snapshots.host is None
        first = engine.generate(input_ids=[turn1], sampling_params={**GREEDY, "max_new_tokens": 8})[0]
        cache.evict(cache.memory.evictable)
        assert snapshot_nodes(cache) == (0, 0) and cache.host_size > 0
        turn2 = turn1 + first["output_ids"] + [11, 12]
        second = engine.generate(input_ids=[turn2], sampling_params=GREEDY)[0]
        check_idle(engine)
    assert second["meta_info"]["cached_tokens"] == 0 and second["output_ids"] == hf_greedy(path, [turn2])[0]


def test_tp2_copies_each_ranks_share_of_the_snapshots_to_its_host_tier_and_back(qwen3_5):
    """Under tensor parallelism every rank's host tier holds its heads' share of each snapshot: rank
    0's write-backs and loads go to rank 1 with the next step, like its device snapshot copies."""
    path, prompts, expected = qwen3_5
    with Engine(str(path), tp_size=2, max_total_tokens=160, hicache_ratio=8, chunked_prefill_size=16) as engine:
        assert engine.core.kv_pool.snapshots.host.ssm[0].shape[1:] == (2, 16, 16)  # this rank's value heads
        for _ in range(2):
            results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            assert [r["output_ids"] for r in results] == expected
        stats = engine.cache_stats()
        assert stats["snapshots_written_back"] > 0 and stats["host_snapshot_hits"] > 0
        check_idle(engine)


# --------------------------------------------------------------------------- the real server

def test_server_serves_the_multimodal_checkpoint_as_text_and_resumes_from_state_snapshots(tmp_path_factory,
                                                                                           server_workdir):
    """The same prompt three times: the first computes it and keeps its state a few tokens before
    its end (where a next turn, which re-tokenizes the prompt's end, resumes); the second resumes
    there, finds the rest of its KV but no state before its last token, so it keeps one there (a
    prompt piece ends there), the third resumes there; usage and /metrics count only that reuse."""
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
        assert cached == [0, len(prompt) - PROMPT_END_SLACK, len(prompt) - 1]
        with pytest.raises(openai.BadRequestError, match="only text parts are supported, got 'image_url'"):
            client.chat.completions.create(model=path.name, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}])
        metrics = httpx.get(f"{proc.base_url}/metrics").text
        assert 'enable_prefix_caching="True"' in metrics
        assert "radixserve:state_snapshot_slots 8.0" in metrics
        assert "radixserve:state_snapshot_hits_total 2.0" in metrics
        assert re.search(r"^radixserve:state_snapshots [1-8]\.0$", metrics, re.M)
        assert "prefix cache: 8 recurrent-state snapshots" in proc.output()
    finally:
        proc.stop()


def test_the_second_chat_on_a_2048_token_system_prompt_finds_it_cached(tmp_path_factory, server_workdir):
    """Through the chat API: two users ask different questions under the same system prompt of
    over 2,048 tokens. The API marks where the system turn ends; the first request keeps the state
    there, and the second finds the whole system turn cached (an attention model finds the same);
    both replies are transformers' greedy tokens. Then the same through /v1/completions with the
    template rendered by the client, on another system prompt."""
    path = build(tmp_path_factory, "qwen3_5", seed=8)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    system = {"role": "system", "content": " ".join(f"Rule {i}: answer in one short sentence." for i in range(110))}

    def ids(chat: list[dict], add_generation_prompt: bool) -> list[int]:
        text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
        return tok.encode(text, add_special_tokens=False)

    system_turn = ids([system], False)
    assert len(system_turn) >= 2048
    chats = [[system, {"role": "user", "content": question}]
             for question in ("Where should I go in spring?", "What is good to see in winter?")]
    prompts = [ids(chat, True) for chat in chats]
    assert all(prompt[:len(system_turn)] == system_turn for prompt in prompts)
    expected = hf_greedy(path, prompts, max_new=6)
    proc = ServerProcess(["--model-path", str(path), "--device", "cpu", "--max-total-tokens", "16384"],
                         server_workdir).wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused")
        cached = []
        for chat, want in zip(chats, expected):
            reply = client.chat.completions.create(model=path.name, messages=chat, temperature=0, max_tokens=6,
                                                   extra_body={"ignore_eos": True, "skip_special_tokens": False})
            assert reply.choices[0].message.content == tok.decode(want)
            cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        assert cached == [0, len(system_turn)]
        # A client that renders the template itself (/v1/completions): the system turn's end is
        # found in the prompt's tokens, and the second user finds it cached the same.
        other = {"role": "system", "content": " ".join(f"Law {i}: reply in two short words." for i in range(110))}
        texts = [tok.apply_chat_template([other, chat[1]], tokenize=False, add_generation_prompt=True)
                 for chat in chats]
        expected = hf_greedy(path, [tok.encode(text, add_special_tokens=False) for text in texts], max_new=6)
        cached = []
        for text, want in zip(texts, expected):
            reply = client.completions.create(model=path.name, prompt=text, temperature=0, max_tokens=6,
                                              extra_body={"ignore_eos": True, "skip_special_tokens": False})
            assert reply.choices[0].text == tok.decode(want)
            cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        assert cached == [0, len(ids([other], False))]
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
    cost_counts_the_model(cfg, model)


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
    cost = cost_counts_the_model(cfg, model)
    vocab_rows = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    assert cost.active_params + vocab_rows + cfg.hidden_size == 3_454_988_928  # "A3B"


def cost_counts_the_model(cfg: ModelConfig, model):
    """The benchmarks' cost model counts the built model's weights and its state pool's bytes."""
    from radixserve.bench.model_cost import ModelCost

    cost = ModelCost(cfg)
    vocab_rows = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    assert cost.matmul_params == sum(p.numel() for p in model.parameters()) - vocab_rows - cfg.hidden_size
    assert cost.state_bytes_per_request == state_spec(model).bytes_per_row
    assert ModelCost(cfg, ssm_elem=2).state_bytes_per_request == state_spec(model, torch.bfloat16).bytes_per_row
    return cost


def test_bench_one_batch_runs_a_hybrid_over_random_states(tmp_path_factory):
    """bench_one_batch's workload for a hybrid (on the CPU here; the timings need CUDA: tests/gpu):
    the state pool it costs is the one the model asks for, filled with random states, and the
    model's prefill and decode batches run over it (a prefill starts its rows from zeros, a decode
    step continues them)."""
    from radixserve.bench.model_cost import ModelCost
    from radixserve.bench_one_batch import Workload, state_pool_spec

    path = build(tmp_path_factory, "qwen3_5_moe")
    model, cfg = load_model(path, attn_backend=TorchAttentionBackend())
    spec = state_pool_spec(ModelCost(cfg), torch.float32, conv_dtype=torch.float32)
    assert spec == state_spec(model)
    work = Workload(cfg, 4, 64, 32, 256, torch.device("cpu"), seed=0, dtype=torch.float32, state=spec)
    assert len(work.pool.k_buffers) == cfg.num_kv_layers == 2 and work.pool.state.num_rows == 4
    random_state = work.pool.state.ssm[0][:3].clone()
    logits = model(work.extend_batch(3, 0, 20))
    prefilled = work.pool.state.ssm[0][:3].clone()
    assert torch.isfinite(logits).all() and logits.shape[0] == 3 and not torch.equal(prefilled, random_state)
    assert torch.isfinite(model(work.decode_batch(3, 21))).all()
    assert not torch.equal(work.pool.state.ssm[0][:3], prefilled)


# Three linear layers, then one full: hidden 64, 4 query heads / 2 KV heads of 16, linear 2 key /
# 4 value heads of 8 / 16, conv kernel 4, a dense MLP of 128, 512 tokens.
TINY_COSTED = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 16, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
               "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
               "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "vocab_size": 512,
               "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000, "partial_rotary_factor": 0.25}}


def test_the_cost_model_of_a_hybrid_by_hand():
    """bench_one_batch's floors of a hybrid, worked out by hand on a tiny shape."""
    from radixserve.bench.model_cost import ModelCost

    cfg = ModelConfig.from_dict(TINY_COSTED)
    cost = ModelCost(cfg)
    # A linear layer: q|k|v 2 x 16 + 64 = 96 conv channels, in_proj rows 96 + z 64 + b 4 + a 4 = 168.
    assert (cost.linear_conv_channels, cost.linear_in_rows) == (96, 168)
    assert cost.linear_projection_params == 64 * 168 + 64 * 64 == 14_848
    assert cost.layer_other_params(0) == 96 * 4 + 2 * 4 + 16 + 2 * 64 == 536  # conv, A_log|dt_bias, norm, norms
    # The full layer: q|gate 2 x 64 rows, k and v 32 each, o 64 x 64; q and k norms of 16.
    assert cost.attention_projection_params == 64 * (128 + 64) + 64 * 64 == 16_384
    assert cost.layer_other_params(3) == 2 * 16 + 2 * 64 == 160
    mlp = 3 * 64 * 128
    assert cost.matmul_params == cost.active_params == 3 * (14_848 + mlp + 536) + 16_384 + mlp + 160 == 161_000
    # Decode: the weights (+ final norm, lm_head) in bf16, KV of the one full layer, and per request
    # 3 layers x (conv window 3 x 96 bf16 + state 4 x 8 x 16 float32), read and written.
    assert cost.decode_weight_bytes == (161_000 + 64 + 512 * 64) * 2 == 387_664
    assert cost.kv_bytes_per_token == 2 * 1 * 2 * 16 * 2 == 128 and cost.kv_bytes_per_token_layer() == 128
    assert cost.state_bytes_per_request == 3 * (3 * 96 * 2 + 4 * 8 * 16 * 4) == 7_872
    assert cost.decode_bytes(4, 100) == 387_664 + 4 * 100 * 128 + 4 * 2 * 7_872 == 501_840
    assert cost.decode_floor_ms(4, 100, 1e9, 1e9) == pytest.approx(501_840 / 1e9 * 1e3)
    # Prefill of 100 tokens: projections, causal attention in the full layer (5050 pairs), and per
    # linear layer the conv (2 x 4 x 96 a token) and the chunked rule: 2 chunks of 64 per value head,
    # each 64^2 (6 x 8 + 4 x 16) + 6 x 64 x 8 x 16 + 64^3 / 3; the last token's logits.
    chunk = 64 ** 2 * (6 * 8 + 4 * 16) + 6 * 64 * 8 * 16 + 64 ** 3 / 3
    assert cost.linear_attention_flops_layer(100) == pytest.approx(2 * 4 * 96 * 100 + 4 * 2 * chunk)
    expected = 2 * 161_000 * 100 + 4 * 4 * 16 * 5050 + 3 * (2 * 4 * 96 * 100 + 4 * 2 * chunk) + 2 * 64 * 512
    assert cost.prefill_flops(1, 100) == pytest.approx(expected) and expected == pytest.approx(48_075_584)
    # At tp 2 a GPU holds half the heads of both kinds, so half of each state.
    half = ModelCost(cfg, tp=2)
    assert (half.linear_conv_channels, half.state_bytes_per_request) == (48, 7_872 // 2)
    assert half.kv_bytes_per_token == 64 and half.attention_projection_params == 16_384 // 2
