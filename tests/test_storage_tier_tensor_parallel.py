"""The storage tier under tensor parallelism on the CPU: 2 rank processes over gloo, each storing
and reading its own shard (one of the model's two KV heads; a hybrid's share of the recurrent
states) in its own directory, rank 0 deciding and the copy log carrying its orders.

Greedy tokens at tp 2 after prefixes went device -> host -> disk -> back equal tp 1's without a
cache and Hugging Face's; a prefix that left the device and the host tier is served from disk
(the storage counters); a restart re-finds the pages of both ranks; a page whose shard one rank
lacks is not read, and the shards of such pages are removed from every rank at start-up; a
directory tp 1 wrote is not read at tp 2 (one warning line); a hybrid's snapshots go to disk per
rank and come back. Without processes: rank 0's store counts a page only once every rank reported
it written in the same round, a read counts the pages every rank read, and a read that found a
shard gone drops the page whatever round wrote it, counted once. The Redis backend under tensor
parallelism: test_storage_tier_redis_tp.py.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from radixserve import Engine
from radixserve.cache.copy_log import CopyKind, CopyLog
from radixserve.cache.storage_shards import ShardedStore
from radixserve.cache.stores.page_files import LocalFileBackend, PageRecord, StoreStamp
from test_engine import check_idle, hf_greedy
from test_storage_tier import (GREEDY, NEW, PAGE, READS_PAY, check_restart_refinds_the_prefixes,
                               check_served_twice_through_the_tier, long_prompts)
from test_storage_tier_hybrid import build_hybrid

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    from radixserve.testing.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny-storage-tp"), hidden=256, intermediate=1024, num_heads=4,
                            num_kv_heads=2)
    prompts = long_prompts(12)
    return path, prompts, hf_greedy(path, prompts, max_new=NEW)


def tp_engine(path, directory, **extra) -> Engine:
    # 256 device tokens and a host tier as large on each rank: a dozen 150-token prompts go to disk.
    return Engine(str(path), **{"tp_size": 2, "max_total_tokens": 256, "page_size": PAGE, "hicache_ratio": 1,
                                "storage_dir": str(directory), **READS_PAY, **extra})


def page_names(directory) -> set[str]:
    return {p.name for p in (directory / "pages").iterdir() if p.suffix == ".page"}


def aligned(prompt: list[int]) -> int:
    return (len(prompt) - 1) // PAGE * PAGE


def test_tp2_greedy_equals_tp1_and_hf_after_device_host_disk_and_back(oracle, tmp_path):
    path, prompts, expected = oracle
    with Engine(str(path), max_total_tokens=4096, page_size=PAGE, disable_radix_cache=True) as single:
        assert [r["output_ids"] for r in single.generate(input_ids=prompts, sampling_params=GREEDY)] == expected
    engine = tp_engine(path, tmp_path / "store")
    try:
        assert engine.core.kv_pool.k_buffers[0].shape[1] == 1  # this rank's KV head
        check_served_twice_through_the_tier(engine, prompts, expected)
    finally:
        engine.shutdown()
    ranks = [tmp_path / "store" / f"tp2-rank{r}" for r in range(2)]
    assert page_names(ranks[0]) == page_names(ranks[1]) != set()  # every page's two shards
    assert not (tmp_path / "store" / "pages").exists()


def serve_one(engine: Engine, prompt: list[int]) -> dict:
    return engine.generate(input_ids=[prompt], sampling_params=GREEDY)[0]


def test_tp2_serves_a_prefix_from_disk_after_it_left_the_device_and_the_host(oracle, tmp_path):
    path, prompts, expected = oracle
    engine = tp_engine(path, tmp_path / "store")
    try:
        first = serve_one(engine, prompts[0])
        assert first["output_ids"] == expected[0]
        for prompt in prompts[2:]:  # ten other prompts through 256 device and 256 host tokens
            serve_one(engine, prompt)
        before = engine.cache_stats()
        assert engine.core.cache.peek(prompts[0])[0] == 0  # on neither the device nor the host now
        again = serve_one(engine, prompts[0])
        after = engine.cache_stats()
        assert again["output_ids"] == expected[0]
        assert again["meta_info"]["cached_tokens"] == aligned(prompts[0])
        assert after["storage_loads"] == before["storage_loads"] + 1
        assert after["storage_loaded_tokens"] - before["storage_loaded_tokens"] == aligned(prompts[0])
        check_idle(engine)
    finally:
        engine.shutdown()


def test_tp2_restart_refinds_the_pages_of_every_rank(oracle, tmp_path):
    check_restart_refinds_the_prefixes(tp_engine, oracle, tmp_path / "store")


def test_a_page_one_rank_lacks_is_not_read(oracle, tmp_path, caplog):
    from radixserve.cache.block_hash import page_hashes

    path, prompts, expected = oracle
    engine = tp_engine(path, tmp_path / "store")
    engine.generate(input_ids=prompts[:2], sampling_params=GREEDY)
    engine.shutdown()
    # Prompt 0's third page: rank 1's shard gone (a crash before it landed, an eviction there).
    gone = tmp_path / "store" / "tp2-rank1" / "pages" / f"{page_hashes(prompts[0], PAGE, None)[2]:016x}.page"
    gone.unlink()
    with caplog.at_level(logging.WARNING, logger="radixserve"):
        engine = tp_engine(path, tmp_path / "store")
    try:
        assert any("on some tensor-parallel ranks but not on all 2" in r.getMessage() for r in caplog.records)
        results = engine.generate(input_ids=prompts[:2], sampling_params=GREEDY)
        assert [r["output_ids"] for r in results] == expected[:2]
        # Prompt 0 is read up to the page rank 1 lacks; prompt 1 whole.
        assert [r["meta_info"]["cached_tokens"] for r in results] == [2 * PAGE, aligned(prompts[1])]
        assert engine.cache_stats()["storage_missing_pages"] == 0  # never asked for
    finally:
        engine.shutdown()


def test_shards_of_pages_not_every_rank_holds_are_removed_at_start_up(oracle, tmp_path, caplog):
    from radixserve.cache.block_hash import page_hashes

    path, prompts, _ = oracle
    store = tmp_path / "store"
    engine = tp_engine(path, store)
    engine.generate(input_ids=prompts[:2], sampling_params=GREEDY)
    engine.shutdown()
    hashes = page_hashes(prompts[0], PAGE, None)
    ranks = [store / f"tp2-rank{r}" / "pages" for r in range(2)]
    (ranks[1] / f"{hashes[2]:016x}.page").unlink()  # rank 0's shard of page 2 is left alone
    (ranks[0] / f"{hashes[3]:016x}.page").unlink()  # rank 1's shard of page 3 likewise
    with caplog.at_level(logging.INFO, logger="radixserve"):
        engine = tp_engine(path, store)
    try:
        wait_until(lambda: not (ranks[0] / f"{hashes[2]:016x}.page").exists())  # rank 0 removes its own at once
        assert any("removed 1 shards of pages not every rank holds (rank 0's)" in r.getMessage()
                   for r in caplog.records)
        serve_one(engine, prompts[4])  # another prompt's step carries rank 0's list to rank 1
        wait_until(lambda: not (ranks[1] / f"{hashes[3]:016x}.page").exists())
        assert page_names(ranks[0].parent) == page_names(ranks[1].parent)
        assert f"{hashes[1]:016x}.page" in page_names(ranks[0].parent)  # the pages that count stay
    finally:
        engine.shutdown()


def test_a_directory_tp1_wrote_is_not_read_at_tp2(oracle, tmp_path, caplog):
    path, prompts, _ = oracle
    store = tmp_path / "store"
    single = Engine(str(path), max_total_tokens=256, page_size=PAGE, hicache_ratio=1, storage_dir=str(store))
    single.generate(input_ids=prompts[:2], sampling_params=GREEDY)
    single.shutdown()
    tp1_pages = page_names(store)
    assert tp1_pages
    with caplog.at_level(logging.WARNING, logger="radixserve"):
        engine = tp_engine(path, store)
    try:
        lines = [r.getMessage() for r in caplog.records if "written with tp_size 1" in r.getMessage()]
        assert len(lines) == 1 and "does not read them" in lines[0], lines
        assert engine.cache_stats()["storage_restored_pages"] == 0
        results = engine.generate(input_ids=prompts[:2], sampling_params=GREEDY)
        assert [r["meta_info"]["cached_tokens"] for r in results] == [0, 0]
    finally:
        engine.shutdown()
    assert page_names(store) == tp1_pages  # left alone
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="radixserve"):  # and the other way round
        single = Engine(str(path), max_total_tokens=256, page_size=PAGE, hicache_ratio=1, storage_dir=str(store))
    single.shutdown()
    assert any("written with tp_size 2 (2 rank directories" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------------ a hybrid model
@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = build_hybrid(tmp_path_factory, "qwen3_5")
    prompts = long_prompts(10, seed=5, lengths=(80, 150))
    return path, prompts, hf_greedy(path, prompts, max_new=NEW)


def test_tp2_hybrid_snapshots_go_to_disk_per_rank_and_come_back(hybrid, tmp_path):
    path, prompts, expected = hybrid
    engine = tp_engine(path, tmp_path / "store", chunked_prefill_size=32)
    try:
        for _ in range(2):
            results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            assert [r["output_ids"] for r in results] == expected
            check_idle(engine)
        stats = engine.cache_stats()
        shown = {k: v for k, v in stats.items() if k.startswith(("storage", "host", "snapshot"))}
        assert stats["storage_snapshots_written"] > 0 and stats["storage_snapshots_loaded"] > 0, shown
        assert stats["storage_loaded_tokens"] > 0 and stats["host_snapshot_hits"] > 0, shown
    finally:
        engine.shutdown()
    ranks = [tmp_path / "store" / f"tp2-rank{r}" for r in range(2)]
    assert page_names(ranks[0]) == page_names(ranks[1])


# ------------------------------------------------------------------------ rank 0's store alone
class FakeInbox:
    def __init__(self, found: list[int]):
        self.queue = [("keys", 1, found)]

    def poll(self):
        taken, self.queue = self.queue, []
        return taken

    def wait(self, timeout_s):
        return self.queue.pop(0) if self.queue else None


def test_rank_0_counts_a_page_once_every_rank_wrote_it_in_the_same_round(tmp_path):
    stamp = StoreStamp(model="m", page_size=2, kv_dtype="float32", bytes_per_token=8, num_layers=1, tp_size=2)
    backend = LocalFileBackend(str(tmp_path / "r0"), 10_000)
    backend.open(stamp)
    backend.put(PageRecord(5, None, [1, 2]), memoryview(bytes(16)))  # found at start-up: rank 1 has it too
    backend.put(PageRecord(6, 5, [3, 4]), memoryview(bytes(16)))  # rank 1 lacks it
    backend.close()
    inbox = FakeInbox([5, 9])
    from radixserve.cache.host_pool import HostKVPool
    from radixserve.cache.kv_pool import KVPool

    host = HostKVPool(16, KVPool(64, 2, 1, 1, 1, torch.float32, "cpu"), pin=False, shared=True)
    assert host.bytes_per_token == stamp.bytes_per_token
    store = ShardedStore(LocalFileBackend(str(tmp_path / "r0"), 10_000), stamp, tp_size=2, inbox=inbox,
                         log=CopyLog(), host_pool=host)
    try:
        assert store.has(5) and not store.has(6) and not store.has(9) and store.restored_pages == 1
        # Rank 0 removed its shard of 6; rank 1 is told to remove its shard of 9.
        wait_until(lambda: not (tmp_path / "r0" / "pages" / f"{6:016x}.page").exists())
        discard = store.log.take()
        assert [(o.kind, o.payload) for o in discard] == [(CopyKind.STORAGE_DISCARD, [9])]
        records = [PageRecord(k, None, [k, k]) for k in (1, 2, 6)]
        for r in records:
            assert store.write(r, torch.full((16,), r.key, dtype=torch.uint8), source=("host", torch.arange(2)))
        store.flush()
        orders = store.log.take()
        assert [(o.kind, o.payload[0].key) for o in orders] == [(CopyKind.STORE_HOST_PAGE, k) for k in (1, 2, 6)]
        rounds = {o.payload[0].key: o.seq for o in orders}
        wait_until(lambda: not store.pending_bytes)  # rank 0's own writes land
        assert not any(store.has(k) for k in (1, 2, 6))  # rank 1 has said nothing yet
        inbox.queue += [("written", 1, 1, rounds[1], True), ("written", 1, 2, rounds[2], False),
                        ("written", 1, 6, rounds[6] - 1, True)]  # 6: a report of an earlier round
        assert store.finished() == []
        assert store.has(1) and not store.has(2) and not store.has(6)
        assert 2 not in store  # dropped: a later save writes it again
        assert store.write(records[1], torch.zeros(16, dtype=torch.uint8), source=("host", torch.arange(2)))
        store.flush()
        again = store.log.take()[0]
        assert again.seq > rounds[2]
        inbox.queue += [("written", 1, 2, again.seq, True), ("lost", 1, 1, rounds[1], "evicted")]
        store.finished()
        assert store.has(2) and not store.has(1)  # rank 1 lost page 1 (evicted there)
        # A read into host slots 4-7: done when both ranks are, counting the pages both read.
        job = store.new_read(7, [records[1], PageRecord(1, 2, [1, 1])], torch.arange(4, 8))
        store.read(job)
        read = store.log.take()[0]
        assert read.kind is CopyKind.STORAGE_READ and list(read.dst) == [4, 5, 6, 7]  # rank 1 reads into the same
        wait_until(lambda: job.done)
        assert torch.equal(host.buffer[4:6].reshape(-1), torch.full((16,), 2, dtype=torch.uint8))  # page 2, in place
        assert store.finished() == []  # rank 1's read not reported yet
        inbox.queue.append(("read", 1, 7, 1, False))
        assert store.finished() == [job] and job.pages_read == 1
        store.release(job)
        assert [o.kind for o in store.log.take()] == [CopyKind.STORAGE_RELEASE]
    finally:
        store.close()


def wait_until(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_rank_replays_rank_0s_storage_orders_on_its_own_shard_and_reports_them(tmp_path):
    from radixserve.cache.copy_log import CopyOrder, replay, slot_array
    from radixserve.cache.host_pool import HostKVPool, make_copy_engine
    from radixserve.cache.kv_pool import KVPool
    from radixserve.cache.storage_shards import StorageReplica
    from radixserve.cache.stores.disk import DiskStore

    pool = KVPool(64, 2, 1, 1, 4, torch.float32, "cpu")
    host = HostKVPool(32, pool, pin=False, shared=True)
    copier = make_copy_engine(pool, host)
    stamp = StoreStamp(model="m", page_size=2, kv_dtype="float32", bytes_per_token=host.bytes_per_token,
                       num_layers=1, tp_size=2, tp_rank=1)
    reports = []
    replica = StorageReplica(DiskStore(LocalFileBackend(str(tmp_path), 10_000), stamp, host_pool=host), 1,
                             reports.append, pool, host, copier)
    try:
        assert reports == [("keys", 1, [], "")]
        host.buffer[4:6] = torch.arange(2 * host.bytes_per_token, dtype=torch.uint8).view(2, 1, 2, -1)
        record = PageRecord(11, None, [5, 6])
        store = CopyOrder(CopyKind.STORE_HOST_PAGE, slot_array([4, 5]), slot_array(()), 3, (record, False))
        replay([store], copier, None, replica)
        wait_until(lambda: len(reports) == 2)
        assert reports[1] == ("written", 1, 11, 3, True)
        replay([CopyOrder(CopyKind.STORE_HOST_PAGE, slot_array([4, 5]), slot_array(()), 8, (record, False))],
               copier, None, replica)
        assert reports[2] == ("written", 1, 11, 8, True)  # already here: said at once, for the new round
        # Rank 0 reads the page into host slots 8, 9: so does this rank.
        replay([CopyOrder(CopyKind.STORAGE_READ, slot_array(()), slot_array([8, 9]), 4, ([record], None))],
               copier, None, replica)
        wait_until(lambda: len(reports) == 4)
        assert reports[3] == ("read", 1, 4, 1, False)
        assert torch.equal(host.buffer[8:10], host.buffer[4:6])
        replay([CopyOrder(CopyKind.STORAGE_RELEASE, slot_array(()), slot_array(()), 4)], copier, None, replica)
        replica.store._on_events([("lost", 11, "evicted", "for room")])  # the I/O process evicted it for room
        assert reports[4] == ("lost", 1, 11, 8, "evicted")
    finally:
        replica.close()


def test_a_read_that_found_a_shard_gone_drops_the_page_whatever_its_round_and_counts_it_once(tmp_path):
    stamp = StoreStamp(model="m", page_size=2, kv_dtype="float32", bytes_per_token=8, num_layers=1, tp_size=2)
    backend = LocalFileBackend(str(tmp_path / "r0"), 10_000)
    backend.open(stamp)
    for key in (5, 6):
        backend.put(PageRecord(key, None, [1, 2]), memoryview(bytes(16)))
    backend.close()
    inbox = FakeInbox([5, 6])
    store = ShardedStore(LocalFileBackend(str(tmp_path / "r0"), 10_000), stamp, tp_size=2, inbox=inbox,
                         log=CopyLog())
    try:
        assert store.has(5) and store.has(6)
        # Rank 1 evicted 5 in a round rank 0 no longer counts: a late report, ignored. Its read of 6
        # found the shard gone (rank 1 thought it had it from an earlier round): dropped, counted.
        inbox.queue += [("lost", 1, 5, 3, "evicted"), ("lost", 1, 6, 3, "missing"), ("lost", 1, 6, 0, "missing")]
        store.finished()
        assert store.has(5) and not store.has(6)
        assert store.stats.missing_pages == 1 and store.stats.evicted_pages == 0
    finally:
        store.close()
