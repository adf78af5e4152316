"""The storage tier for a hybrid model (Gated DeltaNet + attention) on the CPU: its recurrent-state
snapshots go to disk beside their pages and come back with them, so greedy tokens equal
transformers' after prefixes went device -> host -> disk -> back, a restart on the same directory
resumes the next turn of a conversation from disk, and a directory an attention model wrote is
refused by the hybrid's stamp."""

from __future__ import annotations

import logging

import pytest
import torch

from radixserve import Engine
from radixserve.testing.tiny_model import build_tiny_model
from test_engine import check_idle, hf_greedy
from test_storage_tier import GREEDY, NEW, PAGE, READS_PAY, long_prompts

pytestmark = pytest.mark.timeout(600)


def build_hybrid(tmp_path_factory, family: str):
    # Wide enough that reading a page (and a snapshot) beats computing it on any disk; the tests pin
    # the two rates all the same (READS_PAY), so the decision does not depend on the machine's load.
    return build_tiny_model(tmp_path_factory.mktemp(f"tiny-storage-{family}"), family=family, layers=4, head_dim=32,
                            hidden=256, intermediate=1024, num_heads=4, num_kv_heads=2, seed=4)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def oracle(request, tmp_path_factory):
    path = build_hybrid(tmp_path_factory, request.param)
    prompts = long_prompts(10, seed=5, lengths=(80, 150))
    return path, prompts, hf_greedy(path, prompts, max_new=NEW)


def storage_engine(path, directory, **extra) -> Engine:
    # 256 device tokens and a host tier as large (its snapshot slots few): ten ~120-token prompts
    # go through both to disk, their snapshots with them.
    return Engine(str(path), **{"max_total_tokens": 256, "page_size": PAGE, "hicache_ratio": 1,
                                "chunked_prefill_size": 32, "storage_dir": str(directory), **READS_PAY, **extra})


def test_greedy_equals_transformers_after_device_host_disk_and_back(oracle, tmp_path):
    path, prompts, expected = oracle
    engine = storage_engine(path, tmp_path / "store")
    try:
        assert engine.core.cache.states is not None
        for _ in range(2):
            results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            assert [r["output_ids"] for r in results] == expected
            check_idle(engine)
        stats = engine.cache_stats()
        shown = {k: v for k, v in stats.items() if k.startswith(("storage", "host", "snapshot"))}
        assert stats["storage_pages_written"] > 0 and stats["storage_snapshots_written"] > 0, shown
        assert stats["storage_loads"] > 0 and stats["storage_snapshots_loaded"] > 0, shown
        assert stats["storage_loaded_tokens"] > 0 and stats["host_snapshot_hits"] > 0, shown
        assert stats["host_hit_rate"] > 0, shown
        assert stats["storage_corrupt_pages"] == stats["storage_missing_pages"] == 0, shown
    finally:
        engine.shutdown()


def test_a_restart_resumes_the_next_turn_from_disk(oracle, tmp_path):
    path, prompts, _ = oracle
    turn1 = prompts[1]
    engine = storage_engine(path, tmp_path / "store")
    first = engine.generate(input_ids=[turn1], sampling_params=GREEDY)[0]
    turn2 = turn1 + first["output_ids"] + [11, 12, 13, 14, 15, 16, 17]
    resumable = engine.core.cache.peek(turn2[:-1])[0]  # the deepest snapshot on its path
    assert resumable > 0 and resumable % PAGE == 0
    engine.shutdown()  # what is on the device or the host is written now, snapshots too
    engine = storage_engine(path, tmp_path / "store")
    try:
        stats = engine.cache_stats()
        assert stats["storage_restored_pages"] > 0
        second = engine.generate(input_ids=[turn2], sampling_params=GREEDY)[0]
        stats = engine.cache_stats()
        assert second["meta_info"]["cached_tokens"] == resumable
        assert stats["storage_snapshots_loaded"] == 1 and stats["host_snapshot_hits"] == 1
        check_idle(engine)
    finally:
        engine.shutdown()
    assert second["output_ids"] == hf_greedy(path, [turn2], max_new=NEW)[0]


def test_a_directory_an_attention_model_wrote_is_refused_by_a_hybrids_stamp(oracle, tmp_path_factory, tmp_path,
                                                                            caplog):
    path, prompts, _ = oracle
    attention = build_tiny_model(tmp_path_factory.mktemp("tiny-storage-attention"), hidden=256, intermediate=1024,
                                 num_heads=4, num_kv_heads=2)
    engine = Engine(str(attention), max_total_tokens=256, page_size=PAGE, hicache_ratio=1,
                    storage_dir=str(tmp_path / "store"))
    engine.generate(input_ids=prompts[:2], sampling_params=GREEDY)
    engine.shutdown()
    assert any((tmp_path / "store" / "pages").iterdir())
    with caplog.at_level(logging.WARNING, logger="radixserve"):
        hybrid = storage_engine(path, tmp_path / "store")
    try:
        refusals = [r.getMessage() for r in caplog.records if "another configuration" in r.getMessage()]
        assert len(refusals) == 1 and "states ''" in refusals[0]
        assert hybrid.cache_stats()["storage_restored_pages"] == 0
        results = hybrid.generate(input_ids=prompts[:2], sampling_params=GREEDY)
        assert [r["meta_info"]["cached_tokens"] for r in results] == [0, 0]
    finally:
        hybrid.shutdown()


def test_snapshot_records_are_their_own_kind(tmp_path):
    from radixserve.cache.stores.page_files import (LocalFileBackend, PageMissing, PageRecord, StoreStamp,
                                                    snapshot_key, snapshot_record)

    stamp = StoreStamp(model="m", page_size=2, kv_dtype="float32", bytes_per_token=8, num_layers=1, states="s")
    backend = LocalFileBackend(str(tmp_path), 10_000)
    assert backend.open(stamp) == []
    page, snap = PageRecord(7, None, [1, 2]), snapshot_record(7)
    assert snap.key == snapshot_key(7) != 7 and snap.parent == 7
    backend.put(page, memoryview(bytes(16)))
    backend.put(snap, memoryview(bytes(range(40))))
    out = bytearray(40)
    backend.get_into(snap, memoryview(out))
    assert out == bytes(range(40))
    with pytest.raises(PageMissing, match="header"):  # a page under a snapshot's name is never a snapshot
        backend.get_into(PageRecord(snap.key, 7, ()), memoryview(out))
    with pytest.raises(PageMissing):  # nor a snapshot of another page
        backend.get_into(PageRecord(snap.key, 8, (), "snapshot"), memoryview(out))
    backend.close()


def test_state_bytes_round_trip():
    from radixserve.cache.disk_snapshots import fill_state, state_bytes

    conv = [torch.randn(3, 3, 8).to(torch.bfloat16) for _ in range(2)]
    ssm = [torch.randn(3, 2, 4, 4) for _ in range(2)]
    data = state_bytes(conv, ssm, 1)
    assert data.dtype == torch.uint8 and data.numel() == 2 * (3 * 8 * 2 + 2 * 4 * 4 * 4)
    fill_state(conv, ssm, 2, data)
    assert all(torch.equal(c[1], c[2]) for c in conv) and all(torch.equal(s[1], s[2]) for s in ssm)


def test_a_hybrid_without_host_snapshot_slots_is_refused(oracle, tmp_path):
    path = oracle[0]
    with pytest.raises(ValueError, match="mamba_host_cache_size > 0"):
        storage_engine(path, tmp_path / "store", mamba_host_cache_size=0)
