"""The host tier end to end on the CPU (the "host" is a second CPU pool): greedy tokens against
Hugging Face with a device pool too small for the workload, no prefill for prompts copied back
from the host, and the server's /metrics."""

from __future__ import annotations

import dataclasses
import random

import httpx
import pytest

from radixserve import Engine
from radixserve.engine.messages import GenerateRequest
from radixserve.sampling_params import SamplingParams
from radixserve.testing.tiny_model import build_tiny_model
from test_engine import GREEDY, check_idle, hf_greedy, make_prompts
from test_server_api import metric_values

from conftest import ServerProcess

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-hicache"))


@pytest.fixture(scope="module")
def oracle(tiny_dir):
    prompts = make_prompts(512)
    return tiny_dir, prompts, hf_greedy(tiny_dir, prompts)


@pytest.mark.parametrize("config", [
    dict(page_size=1),
    dict(page_size=4, chunked_prefill_size=7),
    dict(page_size=1, hicache_write_policy="write_through", disable_overlap_schedule=True),
    dict(page_size=2, hicache_ratio=0.5),  # a host tier too small as well: it evicts too
])
def test_greedy_equals_hf_with_a_small_device_pool_and_a_host_tier(oracle, config):
    path, prompts, expected = oracle
    # 160 device tokens hold a few of the 24 prompts; the host tier (8x) holds them all.
    engine = Engine(str(path), max_total_tokens=160, **{"hicache_ratio": 8, **config})
    for _ in range(2):
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [r["output_ids"] for r in results] == expected
        check_idle(engine)
    stats = engine.cache_stats()
    assert stats["evicted_tokens"] > 0 and stats["written_back_bytes"] > 0
    assert stats["loaded_tokens"] > 0 and stats["host_hit_rate"] > 0
    assert stats["hit_rate"] == pytest.approx(stats["device_hit_rate"] + stats["host_hit_rate"])


def test_memory_pressure_retracts_with_a_host_tier_without_changing_output(oracle):
    path, prompts, expected = oracle
    engine = Engine(str(path), max_total_tokens=96, chunked_prefill_size=16, schedule_conservativeness=0.0,
                    hicache_ratio=4)
    for _ in range(2):
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [r["output_ids"] for r in results] == expected
        check_idle(engine)
    stats = engine.cache_stats()
    assert stats["retractions"] > 0 and stats["loaded_tokens"] > 0


def evict_to_host(engine: Engine, prompt: list[int]) -> None:
    """Serve prompt, then push it out of the device pool into the host tier."""
    engine.generate(input_ids=[prompt], sampling_params={"max_new_tokens": 1, "temperature": 0})
    cache = engine.core.cache
    cache.evict(cache.memory.evictable)
    assert cache.memory.evictable == 0 and cache.host_size > 0


def test_a_request_waiting_for_its_load_does_not_hold_up_others(tiny_dir):
    engine = Engine(str(tiny_dir), max_total_tokens=512, hicache_ratio=4, page_size=4)
    rng = random.Random(7)
    on_host = [rng.randrange(3, 500) for _ in range(80)]
    evict_to_host(engine, on_host)
    core, params = engine.core, SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    core.add_request(GenerateRequest(rid="host-hit", input_ids=on_host, sampling_params=params))
    core.add_request(GenerateRequest(rid="fresh", input_ids=[rng.randrange(3, 500) for _ in range(20)],
                                     sampling_params=params))
    core.step()  # its load is issued at once; the other request is admitted meanwhile
    assert [r.rid for r in core.scheduler.running] == ["fresh"]
    assert core.cache.loading_tokens == 76 and [r.rid for r in core.scheduler.waiting] == ["host-hit"]
    core.step()  # the copy is done: admitted with its whole prefix cached
    assert {r.rid for r in core.scheduler.running} == {"fresh", "host-hit"}
    assert core.scheduler.reqs["host-hit"].cached_tokens == 76
    while core.has_work:
        core.step()
    check_idle(engine)


def run_one_by_one(engine: Engine, prompts: list[list[int]]) -> tuple[list[int], int]:
    """Serve prompts one after the other; (cached tokens of each, prompt tokens computed in all)."""
    core = engine.core
    cached, computed = [], 0
    params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        outputs = {}
        core.add_request(GenerateRequest(rid=f"r{i}-{random.random()}", input_ids=prompt, sampling_params=params))
        while core.has_work:
            for out in core.step():
                outputs[out.rid] = out
            if core.last_step.batch is not None:
                computed += core.last_step.batch.num_new_tokens
        (out,) = outputs.values()
        cached.append(out.cached_tokens)
    return cached, computed


@pytest.mark.parametrize("page_size", [1, 4])
def test_second_pass_over_evicted_prompts_is_cached_and_computes_no_prefill(tiny_dir, page_size):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(64)] for _ in range(8)]  # 512 tokens, pool of 128
    aligned = (64 - 1) // page_size * page_size  # all but the last token, in whole pages
    tiered = Engine(str(tiny_dir), max_total_tokens=128, hicache_ratio=8, page_size=page_size)
    plain = Engine(str(tiny_dir), max_total_tokens=128, page_size=page_size)
    for engine in (tiered, plain):
        first, computed = run_one_by_one(engine, prompts)
        assert first == [0] * 8 and computed == 8 * 64
    cached, computed = run_one_by_one(tiered, prompts)
    assert cached == [aligned] * 8  # every prompt found again, though the device held two at a time
    assert computed == 8 * (64 - aligned)  # only the tokens after the cached pages
    stats = tiered.cache_stats()
    assert stats["host_cached_prompt_tokens"] == 8 * aligned and stats["loaded_tokens"] >= 8 * aligned
    check_idle(tiered)
    cached, computed = run_one_by_one(plain, prompts)  # without the tier: evicted, computed again
    assert cached == [0] * 8 and computed == 8 * 64


def test_hicache_settings_are_checked(tiny_dir):
    with pytest.raises(ValueError, match="not both"):
        Engine(str(tiny_dir), hicache_size=1.0, hicache_ratio=2.0)
    with pytest.raises(ValueError, match="needs the radix cache"):
        Engine(str(tiny_dir), hicache_ratio=2.0, disable_radix_cache=True)
    with pytest.raises(ValueError, match="hicache_write_policy"):
        Engine(str(tiny_dir), hicache_ratio=2.0, hicache_write_policy="sometimes")


def test_server_metrics_show_the_host_tier(server_model_dir, tmp_path):
    server = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--max-total-tokens", "256",
                            "--hicache-size", "0.001"], tmp_path).wait_ready()
    try:
        rng = random.Random(5)
        prompts = [[rng.randrange(3, 500) for _ in range(100)] for _ in range(4)]
        with server.client() as http:
            for _ in range(2):
                for prompt in prompts:
                    reply = http.post("/generate", json={"input_ids": prompt, "sampling_params": {
                        "max_new_tokens": 2, "temperature": 0}})
                    assert reply.status_code == 200, reply.text
            last = reply.json()["meta_info"]["cached_tokens"]
        assert last == 99  # the second pass found it, on the host
        values = metric_values(server.base_url)
        assert values["radixserve:hicache_pool_tokens"] > 0
        assert values["radixserve:hicache_loaded_bytes_total"] > 0
        assert values["radixserve:hicache_written_back_bytes_total"] > 0
        assert values["radixserve:host_cached_prompt_tokens_total"] >= 4 * 99
        assert values["radixserve:host_hit_rate"] > 0
        assert values["radixserve:hicache_load_bandwidth_gbps"] > 0
        assert values["radixserve:prefix_hit_rate"] == pytest.approx(
            values["radixserve:device_hit_rate"] + values["radixserve:host_hit_rate"])
        info = httpx.get(f"{server.base_url}/server_info", timeout=10).json()
        assert info["stats"]["host_pool_tokens"] == values["radixserve:hicache_pool_tokens"]
    finally:
        server.stop()


def test_agent_sessions_under_pressure_keep_their_prefixes_on_the_host():
    """The seed's scenario scaled down, through the real scheduler and cache (no model): with a
    host tier 4x the pool, later turns find their conversation again instead of computing it."""
    from radixserve.bench.scheduler_sim import SimConfig, agent_sessions, simulate

    cfg = SimConfig(sessions=64, turns=5, systems=4, system_len=512, user_len=64, assistant_len=32,
                    output_len=32, pool=14000, think_s=0.1, prefix_hold_s=0.0)
    sessions = agent_sessions(cfg)
    plain = simulate(cfg, sessions)
    tiered = simulate(dataclasses.replace(cfg, host_ratio=4.0), sessions)
    assert tiered["hit_rate"] >= plain["hit_rate"] + 0.05, (tiered, plain)
    assert tiered["host_hit_rate"] > 0
    assert tiered["turns_that_lost_the_previous_prompt"] < plain["turns_that_lost_the_previous_prompt"]


def test_prompts_started_beside_a_chunk_keep_the_host_tiers_turns():
    """The same sessions in 512-token steps, where most prompts are computed in pieces beside
    another's chunk: a waiting request is started beside a long prompt only while that prompt
    has more than a step left, and host copies start only for requests admission takes. Starting
    every waiting prompt beside every chunk lost 18 later turns' previous prompts here (5 now)."""
    from radixserve.bench.scheduler_sim import SimConfig, agent_sessions, simulate

    cfg = SimConfig(sessions=64, turns=5, systems=4, system_len=512, user_len=64, assistant_len=32,
                    output_len=32, pool=14000, think_s=0.1, prefix_hold_s=0.0, chunk=512, host_ratio=4.0)
    tiered = simulate(cfg, agent_sessions(cfg))
    assert tiered["turns_that_lost_the_previous_prompt"] <= 8, tiered
    assert tiered["hit_rate"] >= 0.865, tiered
