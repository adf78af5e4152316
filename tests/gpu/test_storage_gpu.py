"""The storage tier on a CUDA GPU: pages (and a hybrid's recurrent-state snapshots) go device ->
pinned host -> disk -> back, their copies on the host tier's copy stream and the disk's I/O thread,
with CUDA graphs and the overlap schedule; greedy float32 tokens equal the same engine's without any tier (which
agrees with transformers' float32 torch path on at least nine prompts of ten), twice (the second
pass served from what came back), and a restart on the same directory resumes from disk. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from radixserve import Engine  # noqa: E402
from radixserve.testing.tiny_model import build_tiny_model  # noqa: E402

from greedy_oracle import MAX_NEW, hf_greedy_fp32_torch  # noqa: E402
from test_storage_tier import PAGE, READS_PAY, long_prompts  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
PARAMS = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["qwen2", "qwen3_5"])
def oracle(request, tmp_path_factory):
    """The tokens the same engine gives with no tier below the device and room for every prompt:
    what the tiers must not change. (On an H100 one prompt of these ten, Qwen2's prompt 5, parts
    from transformers' float32 tokens after 7 equal ones with or without any tier, at chunked
    prefill 32: the tiers' test compares the engine with itself; transformers' agreement is
    the other GPU tests'.)"""
    hybrid = {"layers": 4, "head_dim": 32} if request.param == "qwen3_5" else {}
    path = str(build_tiny_model(tmp_path_factory.mktemp(f"tiny-storage-gpu-{request.param}"), family=request.param,
                                hidden=256, intermediate=1024, num_heads=4, num_kv_heads=2, seed=4, **hybrid))
    batch = long_prompts(10, seed=5, lengths=(80, 150))
    untiered = Engine(path, device="cuda", dtype="float32", max_total_tokens=4096, page_size=PAGE,
                      chunked_prefill_size=32, cuda_graph_max_bs=16)
    try:
        expected = [r["output_ids"] for r in untiered.generate(input_ids=batch, sampling_params=PARAMS)]
    finally:
        untiered.shutdown()
    agree = sum(e == h for e, h in zip(expected, hf_greedy_fp32_torch(path, batch)))
    assert agree >= len(batch) - 1, f"the untiered engine agrees with transformers on {agree} of {len(batch)} prompts"
    return path, batch, expected


def storage_engine(path: str, directory, overlap: bool) -> Engine:
    # 256 device tokens and a host tier as large: ten ~120-token prompts go through both to disk.
    return Engine(path, device="cuda", dtype="float32", max_total_tokens=256, page_size=PAGE, hicache_ratio=1,
                  chunked_prefill_size=32, cuda_graph_max_bs=16, disable_overlap_schedule=not overlap,
                  storage_dir=str(directory), **READS_PAY)


@pytest.mark.parametrize("overlap", [True, False])
def test_fp32_greedy_equals_transformers_after_device_host_disk_and_back(oracle, tmp_path, overlap):
    path, batch, expected = oracle
    engine = storage_engine(path, tmp_path / "store", overlap)
    try:
        for n in range(2):
            results = engine.generate(input_ids=batch, sampling_params=PARAMS)
            wrong = [i for i, r in enumerate(results) if r["output_ids"] != expected[i]]
            assert not wrong, f"pass {n}: prompts {wrong} differ; {engine.cache_stats()}"
            engine.check_invariants()
        stats = engine.cache_stats()
        shown = {k: v for k, v in stats.items() if k.startswith(("storage", "host", "snapshot"))}
        assert stats["storage_pages_written"] > 0 and stats["storage_loads"] > 0, shown
        assert stats["storage_corrupt_pages"] == stats["storage_missing_pages"] == 0, shown
        if engine.core.cache.states is not None:
            assert stats["storage_snapshots_written"] > 0 and stats["storage_snapshots_loaded"] > 0, shown
    finally:
        engine.shutdown()
    restarted = storage_engine(path, tmp_path / "store", overlap)
    try:
        assert restarted.cache_stats()["storage_restored_pages"] > 0
        results = restarted.generate(input_ids=batch[:3], sampling_params=PARAMS)
        assert [r["output_ids"] for r in results] == expected[:3]
        cached = [r["meta_info"]["cached_tokens"] for r in results]
        assert all(cached), f"cached after the restart: {cached}; {restarted.cache_stats()}"
        restarted.check_invariants()
    finally:
        restarted.shutdown()
