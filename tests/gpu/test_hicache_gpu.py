"""The host tier's copy-stream path on a CUDA GPU: write-backs and loads move the right bytes
through pinned memory in any KV dtype, a load does not block the compute stream, and the engine's
greedy tokens with a small device pool plus a host tier equal those of a pool that holds
everything. Skipped without CUDA.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from radixserve import Engine  # noqa: E402
from radixserve.cache.host_pool import CudaCopyEngine, HostKVPool  # noqa: E402
from radixserve.cache.kv_pool import KVPool  # noqa: E402
from radixserve.cache.factory import host_tier, tree_cache  # noqa: E402
from radixserve.testing.tiny_model import build_tiny_model  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32] + (
    [torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])


def as_bytes(buffer: torch.Tensor) -> torch.Tensor:
    return buffer.view(torch.uint8)  # index ops on bytes work for every dtype (fp8 included)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_back_then_load_restores_every_layer(dtype):
    pool = KVPool(4096, 16, 4, 2, 64, dtype, "cuda")
    host = HostKVPool(8192, pool, pin=True)
    assert host.pinned
    copier = CudaCopyEngine(pool, host)
    slots = pool.allocator.pages_to_slots(pool.allocator.alloc_pages(64))  # 1,024 tokens
    idx = slots.cuda()
    expect = []
    for buffer in pool.k_buffers + pool.v_buffers:
        data = torch.randint(0, 256, (len(slots),) + as_bytes(buffer).shape[1:], dtype=torch.uint8, device="cuda")
        as_bytes(buffer)[idx] = data
        expect.append(data)
    host_slots = host.alloc(len(slots))
    copier.write_back(slots, host_slots)
    for buffer in pool.k_buffers + pool.v_buffers:  # the next step reuses the slots at once
        as_bytes(buffer)[idx] = 0
    dest = pool.allocator.pages_to_slots(pool.allocator.alloc_pages(64))
    seq = copier.load(host_slots, dest)
    copier.wait(seq)
    assert copier.done_seq == seq and copier.stats.load_bandwidth > 0
    for buffer, data in zip(pool.k_buffers + pool.v_buffers, expect):
        assert torch.equal(as_bytes(buffer)[dest.cuda()], data)


def test_a_load_runs_beside_the_compute_stream():
    """While a 1 GiB load is in flight, work on the compute stream completes without waiting for it."""
    pool = KVPool(65536, 16, 8, 8, 128, torch.bfloat16, "cuda")
    cache = tree_cache(pool, host_tier(pool, 65536))
    tokens = list(range(32768))
    slots = pool.allocator.pages_to_slots(pool.allocator.alloc_pages(len(tokens) // 16))
    cache.insert(tokens, slots)
    assert cache.evict(len(tokens)) == len(tokens)
    cache.copier.wait_all()
    cache.waiting.poll()
    x = torch.randn(64, 64, device="cuda")
    (x @ x).sum()
    torch.cuda.synchronize()  # cuBLAS set up before the load, so the step below is microseconds
    assert cache.load(tokens + [1], spare_only=False) == len(tokens)
    load_end = cache.copier._pending[-1][2]
    computed = torch.cuda.Event()
    (x @ x).sum()
    computed.record()
    computed.synchronize()
    assert not load_end.query(), "the compute stream waited for the load"
    assert cache.match(tokens + [1]).length == 0  # not usable before poll sees it done
    cache.copier.wait_all()
    cache.waiting.poll()
    assert cache.loading_tokens == 0 and cache.match(tokens + [1]).length == len(tokens)
    cache.memory.check()


def test_greedy_tokens_with_a_host_tier_equal_a_pool_that_holds_everything(tmp_path):
    model = str(build_tiny_model(tmp_path))
    rng = random.Random(0)
    systems = [[rng.randrange(3, 500) for _ in range(48)] for _ in range(8)]
    prompts = [s + [rng.randrange(3, 500) for _ in range(rng.randint(1, 20))] for s in systems for _ in range(4)]
    greedy = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    # float32: the two engines batch the prompts differently (a 256-token pool runs a few at a time),
    # and in bf16 a random model's near-ties flip on that alone; in float32 only the cache differs.
    ref = Engine(model, device="cuda", dtype="float32", max_total_tokens=8192).generate(
        input_ids=prompts, sampling_params=greedy)
    for page_size in (1, 16):
        engine = Engine(model, device="cuda", dtype="float32", max_total_tokens=256, hicache_ratio=8,
                        page_size=page_size)
        for _ in range(2):
            out = engine.generate(input_ids=prompts, sampling_params=greedy)
            assert [r["output_ids"] for r in out] == [r["output_ids"] for r in ref]
            engine.check_invariants()
        stats = engine.cache_stats()
        assert stats["host_hit_rate"] > 0 and stats["loaded_bytes"] > 0 and stats["load_bandwidth_gbps"] > 0
