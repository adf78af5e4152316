"""The host tier of a hybrid model on a CUDA GPU: recurrent-state snapshots go to pinned host
memory with their prefix's KV and come back, their copies on the host tier's copy stream (they
complete while the compute stream is still busy; a device slot reused at once after a staged
write-back still gives the host the old state, and one written back unstaged is not handed out
before its copy is done), and the engine's
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
from radixserve.cache import state_snapshots  # noqa: E402
from radixserve.cache.factory import host_tier  # noqa: E402
from radixserve.cache.host_pool import CudaCopyEngine  # noqa: E402
from radixserve.cache.kv_pool import KVPool  # noqa: E402
from radixserve.cache.state_pool import RecurrentStatePool, RecurrentStateSpec  # noqa: E402
from radixserve.cache.state_snapshots import StateSnapshots  # noqa: E402
from radixserve.testing.tiny_model import build_tiny_model  # noqa: E402

from greedy_oracle import MAX_NEW, hf_greedy_fp32_torch, prompts  # noqa: E402

GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def tiny_dir(request, tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}-hicache-gpu"), family=request.param,
                                layers=4, head_dim=32, seed=2))


def snapshot_tier(ssm_dtype: torch.dtype, device_slots: int = 4):
    """Qwen3.5-27B's per-layer shapes at tp 8 (6 value heads of 128 x 128), 3 layers, on a CUDA
    KV pool with a host tier of 8 pinned snapshot slots (its copy engine's stream)."""
    spec = RecurrentStateSpec(num_layers=3, conv_shape=(3, 1280), ssm_shape=(6, 128, 128), conv_dtype=torch.bfloat16,
                              ssm_dtype=ssm_dtype)
    rows = RecurrentStatePool(4, spec, "cuda")
    device = StateSnapshots(device_slots, rows)
    pool = KVPool(64, 1, 1, 1, 8, torch.bfloat16, "cuda", state=rows, snapshots=device)
    tier = host_tier(pool, 64, 8)
    host = tier.snapshots
    assert host.pinned and device.host is host and isinstance(tier.copier, CudaCopyEngine)
    for layer in range(3):
        device.conv[layer].copy_(torch.randn(device.conv[layer].shape, device="cuda"))
        device.ssm[layer].copy_(torch.randn(device.ssm[layer].shape, device="cuda"))
    return spec, device, host, tier.copier


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pinned_write_back_then_load_restores_every_layer_even_when_the_slot_is_reused_at_once(ssm_dtype):
    spec, device, host, copier = snapshot_tier(ssm_dtype)
    assert [device.alloc() for _ in range(4)] == [0, 1, 2, 3]
    expect = [(device.conv[layer][1].clone(), device.ssm[layer][1].clone()) for layer in range(3)]
    seq = host.write_back([1], [5])  # staged: the slot is reusable at once
    device.free(1)
    assert device.alloc() == 1
    for layer in range(3):  # reused by the next save, queued on the compute stream after the gather
        device.conv[layer][1].zero_()
        device.ssm[layer][1].zero_()
    loaded = host.load([5], [2])
    assert loaded == seq + 1
    copier.wait(loaded)
    torch.cuda.synchronize()
    for layer, (conv, ssm) in enumerate(expect):
        assert torch.equal(device.conv[layer][2], conv) and torch.equal(device.ssm[layer][2], ssm)
        assert torch.equal(host.ssm[layer][5], ssm.cpu())
        assert not device.ssm[layer][1].any()


def test_an_unstaged_write_back_keeps_its_slot_until_its_copy_is_done(monkeypatch):
    spec, device, host, copier = snapshot_tier(torch.float32)
    monkeypatch.setattr(state_snapshots, "STAGED_WRITE_BACKS", 0)
    assert [device.alloc() for _ in range(4)] == [0, 1, 2, 3]
    expect = device.ssm[0][3].clone()
    torch.cuda._sleep(200_000_000)  # the compute stream busy: the copy stream waits for it first
    seq = host.write_back([3], [4])
    device.free(3)
    assert device.alloc() is None and copier.poll() < seq, "a slot handed out while its copy may read it"
    copier.wait(seq)
    assert device.alloc() == 3
    assert torch.equal(host.ssm[0][4], expect.cpu())


def test_snapshot_copies_run_on_the_copy_stream_beside_the_compute_stream():
    """A write-back and a load complete while a long kernel queued on the compute stream after them
    still runs: neither waits in (nor holds up) the compute stream."""
    spec, device, host, copier = snapshot_tier(torch.bfloat16)
    compute = torch.cuda.current_stream()
    expect = device.ssm[1][0].clone()
    seq = host.write_back([0], [1])
    torch.cuda._sleep(2_000_000_000)  # about a second of the compute stream
    copier.wait(seq)
    assert not compute.query(), "the write-back waited for compute work queued after it"
    torch.cuda.synchronize()
    loaded = host.load([1], [3])
    torch.cuda._sleep(2_000_000_000)
    copier.wait(loaded)
    assert not compute.query(), "the load waited for compute work queued after it"
    torch.cuda.synchronize()
    assert torch.equal(device.ssm[1][3], expect)


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
