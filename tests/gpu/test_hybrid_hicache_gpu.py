"""The host tier of a hybrid model on a CUDA GPU: recurrent-state snapshots go to pinned host
memory with their prefix's KV and come back, their copies queued on the compute stream (a device
slot reused at once after its write-back still gives the host the old state), and the engine's
greedy tokens with a small device pool plus a host tier equal those of a pool that holds
everything and transformers' (90% of them where fla-core runs transformers' side), with CUDA
graphs, overlap on and off. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from radixserve import Engine  # noqa: E402
from radixserve.cache.state_pool import RecurrentStatePool, RecurrentStateSpec  # noqa: E402
from radixserve.cache.state_snapshots import HostStateSnapshots, StateSnapshots  # noqa: E402
from radixserve.testing.tiny_model import build_tiny_model  # noqa: E402

from greedy_oracle import MAX_NEW, hf_greedy_fp32_torch, prompts  # noqa: E402

GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def tiny_dir(request, tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}-hicache-gpu"), family=request.param,
                                layers=4, head_dim=32, seed=2))


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pinned_write_back_then_load_restores_every_layer_even_when_the_slot_is_reused_at_once(ssm_dtype):
    """Qwen3.5-27B's per-layer shapes at tp 8 (6 value heads of 128 x 128), 3 layers."""
    spec = RecurrentStateSpec(num_layers=3, conv_shape=(3, 1280), ssm_shape=(6, 128, 128), conv_dtype=torch.bfloat16,
                              ssm_dtype=ssm_dtype)
    rows = RecurrentStatePool(4, spec, "cuda")
    device = StateSnapshots(4, rows)
    host = HostStateSnapshots(8, device, pin=True)
    assert host.pinned and device.host is host
    expect = []
    for layer in range(3):
        device.conv[layer][1] = torch.randn(spec.conv_shape, device="cuda").to(spec.conv_dtype)
        device.ssm[layer][1] = torch.randn(spec.ssm_shape, device="cuda").to(ssm_dtype)
        expect.append((device.conv[layer][1].clone(), device.ssm[layer][1].clone()))
    host.write_back([1], [5])
    for layer in range(3):  # the freed device slot is reused by the next save, queued after the copy
        device.conv[layer][1].zero_()
        device.ssm[layer][1].zero_()
    host.load([5], [2])
    torch.cuda.synchronize()
    for layer, (conv, ssm) in enumerate(expect):
        assert torch.equal(device.conv[layer][2], conv) and torch.equal(device.ssm[layer][2], ssm)
        assert torch.equal(host.ssm[layer][5], ssm.cpu())
        assert not device.ssm[layer][1].any()


@pytest.mark.parametrize("overlap", [True, False])
def test_fp32_resumed_from_the_host_tier_equals_a_pool_that_holds_everything_and_hf(tiny_dir, overlap):
    """Six prompts under one 50-token system prompt, each with its own system prompt too; a 256-token
    device pool holds a few, the host tier (8x) the rest with their snapshots. The second pass
    resumes from states copied back from pinned memory; every token is the big pool's and
    transformers'. Then, on a fresh engine, a conversation's next turn resumes after its first turn
    went to the host (on the first engine, 24 sequence ends nobody continued have taught the cache
    to keep few such snapshots: its turn 2 resumes at the shared system prompt, by design)."""
    system = prompts(1, 500, seed=11, longest=48)[0][:5] * 10  # 50 tokens
    batch = [system + p for p in prompts(12, 500, seed=12, longest=40)]
    ref = hf_greedy_fp32_torch(tiny_dir, batch)  # our 16-token pieces never take fla's TF32 kernel
    big = Engine(tiny_dir, device="cuda", dtype="float32", max_total_tokens=8192, chunked_prefill_size=16,
                 cuda_graph_max_bs=16, disable_overlap_schedule=not overlap, mamba_cache_size=64)
    cold = [r["output_ids"] for r in big.generate(input_ids=batch, sampling_params=GREEDY)]
    assert cold == ref
    engine = Engine(tiny_dir, device="cuda", dtype="float32", max_total_tokens=256, hicache_ratio=8,
                    chunked_prefill_size=16, cuda_graph_max_bs=16, disable_overlap_schedule=not overlap)
    cache = engine.core.cache
    assert cache.states is not None and cache.host is not None and engine.core.kv_pool.snapshots.host.pinned
    passes = [engine.generate(input_ids=batch, sampling_params=GREEDY) for _ in range(2)]
    for results in passes:
        assert [r["output_ids"] for r in results] == cold
    engine.check_invariants()
    stats = engine.cache_stats()
    assert sum(r["meta_info"]["cached_tokens"] for r in passes[1]) > 0
    assert stats["snapshots_written_back"] > 0 and stats["snapshots_loaded"] > 0 and stats["host_snapshot_hits"] > 0
    assert stats["host_hit_rate"] > 0 and engine.core.runner.num_graph_steps > 0

    engine.check_invariants()

    engine = Engine(tiny_dir, device="cuda", dtype="float32", max_total_tokens=256, hicache_ratio=8,
                    chunked_prefill_size=16, cuda_graph_max_bs=16, disable_overlap_schedule=not overlap)
    cache = engine.core.cache
    assert [r["output_ids"] for r in engine.generate(input_ids=batch[:1], sampling_params=GREEDY)] == cold[:1]
    cache.evict(cache.memory.evictable)
    turn2 = batch[0] + cold[0] + [7, 8, 9, 10]
    hits = engine.cache_stats()["host_snapshot_hits"]
    second = engine.generate(input_ids=[turn2], sampling_params=GREEDY)[0]
    assert second["meta_info"]["cached_tokens"] == len(batch[0]) + MAX_NEW - 1
    assert engine.cache_stats()["host_snapshot_hits"] == hits + 1
    turn2_ref = big.generate(input_ids=[turn2], sampling_params=GREEDY)[0]["output_ids"]
    assert second["output_ids"] == turn2_ref
    engine.check_invariants()
    host = engine.core.kv_pool.snapshots.host
    assert host.free_slots + engine.cache_stats()["host_snapshots_held"] == host.num_slots
