"""The host tier with tensor parallelism on the CPU: 2 rank processes over gloo, each with a host
pool for its own KV shard (one of the tiny model's two KV heads), rank 1 replaying the copies rank
0's tree issues.

Greedy tokens with a device pool too small for the workload and a host tier equal tp 1's without
a tier, and Hugging Face's; a second pass over prompts the device evicted finds them on the host
and computes no prefill (their loads start while nothing runs, so they reach rank 1 in a message
of their own), and decodes what the first pass decoded; --hicache-size is per rank, in the rank's
shard bytes; an FP8 KV pool's bytes round-trip through both ranks' host tiers. Rank 1's KV head differs from rank 0's, so a copy it missed or ran out of
order would change the tokens. Without processes: a replayed copy moves the replaying rank's own
bytes between the same slots, and a rank whose copies diverged from rank 0's stops with an error.
"""

from __future__ import annotations

import random

import pytest
import torch

from test_engine import GREEDY, check_idle, hf_greedy, make_prompts

from radixserve.cache.copy_log import CopyLog, replay
from radixserve import Engine
from radixserve.cache.host_pool import HostKVPool, make_copy_engine
from radixserve.cache.kv_pool import KVPool
from radixserve.engine.messages import GenerateRequest
from radixserve.sampling_params import SamplingParams
from radixserve.testing.tiny_model import build_tiny_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def gqa2(tmp_path_factory):
    """4 query heads, 2 KV heads: one KV head per rank."""
    path = build_tiny_model(tmp_path_factory.mktemp("tp-hicache"), num_heads=4, num_kv_heads=2)
    prompts = make_prompts(512)
    return path, prompts, hf_greedy(path, prompts)


@pytest.mark.parametrize("config", [
    dict(page_size=1),
    dict(page_size=4, chunked_prefill_size=7, hicache_write_policy="write_through"),
])
def test_tp2_with_a_small_pool_and_a_host_tier_equals_tp1_and_hf(gqa2, config):
    path, prompts, expected = gqa2
    with Engine(str(path), max_total_tokens=4096, page_size=config["page_size"]) as single:
        assert [r["output_ids"] for r in single.generate(input_ids=prompts, sampling_params=GREEDY)] == expected
    # 160 device tokens hold a few of the 24 prompts; the host tier (8x, on each rank) holds them all.
    with Engine(str(path), tp_size=2, max_total_tokens=160, hicache_ratio=8, **config) as engine:
        assert engine.core.kv_pool.k_buffers[0].shape[1] == 1  # this rank's KV head
        for _ in range(2):
            results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            assert [r["output_ids"] for r in results] == expected
            check_idle(engine)
        stats = engine.cache_stats()
    assert stats["host_pool_tokens"] == 8 * 160
    assert stats["evicted_tokens"] > 0 and stats["written_back_bytes"] > 0
    assert stats["loaded_tokens"] > 0 and stats["host_hit_rate"] > 0


def serve_one_by_one(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[int], int]:
    """Serve prompts one after the other: (tokens of each, cached tokens of each, prompt tokens computed)."""
    core = engine.core
    tokens, cached, computed = [], [], 0
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        rid, out_ids = f"r{i}-{random.random()}", []
        core.add_request(GenerateRequest(rid=rid, input_ids=prompt, sampling_params=params))
        while core.has_work:
            for out in core.step():
                out_ids += out.new_token_ids
                if out.finished:
                    cached.append(out.cached_tokens)
            if core.last_step.batch is not None:
                computed += core.last_step.batch.num_new_tokens
        tokens.append(out_ids)
    return tokens, cached, computed


@pytest.mark.parametrize("settings", [
    # --hicache-size is per rank, in this rank's bytes: 2 layers x k|v x 1 KV head of 16 fp32 = 256 B
    # a token (tp 1: 512 B), so 400 KB hold 1,560 tokens (whole pages of 4).
    dict(page_size=4, hicache_size=0.0004),
    dict(page_size=1, hicache_ratio=8, kv_cache_dtype="fp8_e4m3"),  # FP8 bytes move unchanged on every rank
], ids=["page4-size", "fp8-kv-ratio"])
def test_tp2_second_pass_over_evicted_prompts_is_cached_and_decodes_the_same(gqa2, settings):
    path = gqa2[0]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(64)] for _ in range(8)]  # 512 tokens, pool of 128
    aligned = (64 - 1) // settings["page_size"] * settings["page_size"]
    with Engine(str(path), tp_size=2, max_total_tokens=128, **settings) as engine:
        if "hicache_size" in settings:
            assert HostKVPool.token_bytes(engine.core.kv_pool) == 256
            assert engine.cache_stats()["host_pool_tokens"] == 1560
        first, cached, computed = serve_one_by_one(engine, prompts)
        assert cached == [0] * 8
        second, cached, computed_again = serve_one_by_one(engine, prompts)
        assert cached == [aligned] * 8  # every prompt found again, though the device held two at a time
        assert computed_again == computed - 8 * aligned  # only the tokens after the cached pages
        assert second == first
        stats = engine.cache_stats()
        assert stats["host_cached_prompt_tokens"] == 8 * aligned and stats["loaded_tokens"] >= 8 * aligned
        check_idle(engine)


def test_a_replayed_copy_moves_this_ranks_shard_between_rank_0s_slots():
    shards = [KVPool(64, 4, 2, 1, 8, torch.float32, "cpu") for _ in range(2)]
    first, other = (make_copy_engine(pool, HostKVPool(128, pool, pin=False)) for pool in shards)
    first.log = CopyLog()
    for rank, pool in enumerate(shards):
        for buffer in pool.k_buffers + pool.v_buffers:
            buffer[8:16] = rank + torch.arange(8.0)[:, None, None]
    first.write_back(torch.arange(8, 16), first.host.alloc(8))
    first.load(torch.arange(4, 12), torch.arange(20, 28))  # host slots 4..11 hold device slots 8..15
    orders = first.log.take()
    replay(orders, other, None)
    other.compute_waits_for(first.issued_seq)
    for rank, pool in enumerate(shards):
        for buffer in pool.k_buffers + pool.v_buffers:
            assert torch.equal(buffer[20:28], buffer[8:16]) and buffer[20, 0, 0] == rank
    stale = orders[0]
    with pytest.raises(RuntimeError, match="diverged"):
        other.replay(stale)
