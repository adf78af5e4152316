"""The storage tier (--storage-dir) end to end on the CPU: greedy tokens against Hugging Face after
prefixes went device -> host -> disk -> back, a restart on the same directory serving the next turn
of a conversation from disk, a directory of another configuration refused, and the faults (a
corrupt page, a deleted page file, a full store, a slow disk) against a real server process, each
ending in the request computing what it could not read and the same tokens."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from pathlib import Path

import httpx
import pytest

from radixserve import Engine
from radixserve.cache.block_hash import page_hashes
from radixserve.testing.tiny_model import build_tiny_model
from test_engine import check_idle, hf_greedy
from test_server_api import metric_values

from conftest import ServerProcess

pytestmark = pytest.mark.timeout(600)

PAGE = 16
NEW = 6
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


def long_prompts(n: int, seed: int = 3, lengths: tuple[int, int] = (100, 200)) -> list[list[int]]:
    """n prompts of `lengths` tokens, half of them under one shared 48-token system prompt."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 500) for _ in range(48)]
    out = []
    for i in range(n):
        body = [rng.randrange(3, 500) for _ in range(rng.randrange(*lengths))]
        out.append(system + body[48:] if i % 2 else body)
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # Wider than the default tiny model: 4 MFLOP a token against 2 KiB of KV, so reading a page
    # beats computing it by a wide margin on any disk; the tests still pin both rates (READS_PAY).
    return build_tiny_model(tmp_path_factory.mktemp("tiny-storage"), hidden=256, intermediate=1024, num_heads=4,
                            num_kv_heads=2)


@pytest.fixture(scope="module")
def oracle(tiny_dir):
    prompts = long_prompts(12)
    return tiny_dir, prompts, hf_greedy(tiny_dir, prompts, max_new=NEW)


# The load decision's inputs pinned (a fast disk, a slow prefill), so whether a read pays does not
# depend on how busy the machine is; a slow disk's test pins the prefill rate only.
READS_PAY = {"storage_read_gbps": 10.0, "storage_prefill_tflops": 0.001}


def storage_engine(path, directory, **extra) -> Engine:
    # 256 device tokens and a host tier as large: a dozen 150-token prompts go through both to disk.
    return Engine(str(path), **{"max_total_tokens": 256, "page_size": PAGE, "hicache_ratio": 1,
                                "storage_dir": str(directory), **READS_PAY, **extra})


# ------------------------------------------------------------------------ the offline engine
def check_served_twice_through_the_tier(engine: Engine, prompts: list[list[int]], expected: list[list[int]]) -> dict:
    """Every prompt served twice (the second pass from what went to disk and came back), each
    time with the expected tokens and every slot back; pages were written and loaded, none lost.
    Returns the cache's stats."""
    for _ in range(2):
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [r["output_ids"] for r in results] == expected
        check_idle(engine)
    stats = engine.cache_stats()
    assert stats["storage_pages_written"] > 0 and stats["storage_pages"] > 0
    assert stats["storage_loads"] > 0 and stats["storage_loaded_tokens"] > 0
    assert stats["storage_corrupt_pages"] == stats["storage_missing_pages"] == 0
    return stats


def test_greedy_equals_hf_after_device_host_disk_and_back(oracle, tmp_path):
    path, prompts, expected = oracle
    engine = storage_engine(path, tmp_path / "store")
    try:
        assert check_served_twice_through_the_tier(engine, prompts, expected)["host_hit_rate"] > 0
    finally:
        engine.shutdown()


def check_restart_refinds_the_prefixes(make_engine, oracle, directory) -> None:
    """Three prompts served, the engine shut down (what is still on the device or the host is
    written now) and started again on the same directory: each prompt's whole pages are found."""
    path, prompts, expected = oracle
    engine = make_engine(path, directory)
    engine.generate(input_ids=prompts[:3], sampling_params=GREEDY)
    engine.shutdown()
    engine = make_engine(path, directory)
    try:
        assert engine.cache_stats()["storage_restored_pages"] > 0
        results = engine.generate(input_ids=prompts[:3], sampling_params=GREEDY)
        assert [r["output_ids"] for r in results] == expected[:3]
        assert [r["meta_info"]["cached_tokens"] for r in results] == [(len(p) - 1) // PAGE * PAGE for p in prompts[:3]]
        check_idle(engine)
    finally:
        engine.shutdown()


def test_a_loop_whose_requests_wait_for_a_read_waits_instead_of_spinning(oracle, tmp_path):
    """A request whose prefix is on disk waits for its read (50 ms a page, injected): meanwhile
    each step launches nothing, and the core asks its loop to wait COPY_WAIT_S (the GIL let go for
    the readers) instead of stepping again at once; once the pages are in, the step launches and
    it asks no wait. The tokens are transformers'."""
    from radixserve.engine.core import COPY_WAIT_S
    from radixserve.engine.messages import GenerateRequest
    from radixserve.sampling_params import sampling_params_from_dict

    path, prompts, expected = oracle
    engine = storage_engine(path, tmp_path / "store")
    engine.generate(input_ids=prompts[:1], sampling_params=GREEDY)
    engine.shutdown()  # its pages go to disk
    engine = storage_engine(path, tmp_path / "store", storage_read_latency_ms=50, storage_read_gbps=0)
    try:
        core = engine.core
        assert core.copy_wait_s == 0  # nothing to do: the loop's idle wait, not this one
        core.add_request(GenerateRequest(rid="r", input_ids=prompts[0],
                                         sampling_params=sampling_params_from_dict(GREEDY)))
        waits, tokens = [], []
        while core.has_work:
            for out in core.step():
                tokens += out.new_token_ids
            waits.append(core.copy_wait_s)
        assert tokens == expected[0] and engine.cache_stats()["storage_loads"] == 1
        assert waits[0] == COPY_WAIT_S and waits[-1] == 0 and 0 in waits
    finally:
        engine.shutdown()


def test_restart_on_the_same_directory_finds_the_prefixes(oracle, tmp_path):
    check_restart_refinds_the_prefixes(storage_engine, oracle, tmp_path / "store")


def test_a_directory_of_another_configuration_is_not_read(oracle, tmp_path, caplog):
    path, prompts, _ = oracle
    engine = storage_engine(path, tmp_path / "store")
    engine.generate(input_ids=prompts[:2], sampling_params=GREEDY)
    engine.shutdown()
    with caplog.at_level(logging.WARNING, logger="radixserve"):
        other = Engine(str(path), max_total_tokens=256, page_size=2 * PAGE, hicache_ratio=1,
                       storage_dir=str(tmp_path / "store"))
    try:
        refusals = [r for r in caplog.records if "another configuration" in r.getMessage()]
        assert len(refusals) == 1 and "page_size 16" in refusals[0].getMessage()
        assert other.cache_stats()["storage_restored_pages"] == 0
        results = other.generate(input_ids=prompts[:2], sampling_params=GREEDY)
        assert [r["meta_info"]["cached_tokens"] for r in results] == [0, 0]
        with pytest.raises(ValueError, match="in use by another server"):
            Engine(str(path), max_total_tokens=256, page_size=2 * PAGE, hicache_ratio=1,
                   storage_dir=str(tmp_path / "store"))
    finally:
        other.shutdown()


def test_storage_settings_are_checked(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="under the host tier"):
        Engine(str(tiny_dir), page_size=PAGE, storage_dir=str(tmp_path))
    with pytest.raises(ValueError, match="page_size must be >= 16"):
        Engine(str(tiny_dir), hicache_ratio=1, storage_dir=str(tmp_path))
    with pytest.raises(ValueError, match="storage_backend='lmcache' is not one of file, redis"):
        Engine(str(tiny_dir), hicache_ratio=1, page_size=PAGE, storage_dir=str(tmp_path), storage_backend="lmcache")
    with pytest.raises(ValueError, match="storage_backend redis needs storage_url"):
        Engine(str(tiny_dir), hicache_ratio=1, page_size=PAGE, storage_dir=str(tmp_path), storage_backend="redis")
    with pytest.raises(ValueError, match="storage_size must be > 0"):
        Engine(str(tiny_dir), hicache_ratio=1, page_size=PAGE, storage_dir=str(tmp_path), storage_size=0)
    with pytest.raises(ValueError, match="storage_read_gbps"):
        Engine(str(tiny_dir), hicache_ratio=1, page_size=PAGE, storage_dir=str(tmp_path), storage_read_gbps=-1)


def test_a_disk_too_slow_for_short_prompts_writes_only_the_pages_a_load_could_pay_for(oracle, tmp_path, caplog):
    """A load of the tokens [s, e) pays only when its middle lies past the break-even context, and e
    is at most the context length: pages starting before 2 x break-even - context length cost more
    to read than to compute whatever follows them. A disk read rate pinned so that this position is
    64: only pages from 64 on are written (the rest counted), and the tokens stay transformers'. A
    disk so slow that no load pays within the context length writes nothing, with one warning."""
    path, prompts, expected = oracle
    probe = storage_engine(path, tmp_path / "probe")
    cost, context = probe.core.cache.host.storage.cost, probe.core.context_len
    probe.shutdown()

    def read_gbps(first_position: float) -> float:  # the read rate putting the first paying page there
        break_even = (first_position + context) / 2
        per_token_s = (cost.flops_per_token + break_even * cost.attention_flops_per_pair) / cost.prefill_flops_per_s
        return cost.bytes_per_token / per_token_s / 1e9

    engine = storage_engine(path, tmp_path / "deep", storage_read_gbps=read_gbps(64))
    try:
        assert engine.core.cache.host.storage.first_saved_position == pytest.approx(64)
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [r["output_ids"] for r in results] == expected
        stats = engine.cache_stats()
        assert stats["storage_pages_written"] > 0 and stats["storage_unpaying_pages"] > 0
        store = engine.core.cache.host.storage.store
        on_disk = [i * PAGE for p in prompts for i, h in enumerate(page_hashes(p[:len(p) // PAGE * PAGE], PAGE, None))
                   if h in store]
        assert on_disk and min(on_disk) == 64  # no page of the first 64 positions reached the disk
        check_idle(engine)
    finally:
        engine.shutdown()
    with caplog.at_level(logging.WARNING, logger="radixserve"):
        slow = storage_engine(path, tmp_path / "slow", storage_read_gbps=read_gbps(2 * context))
    try:
        assert any("no load pays within the context length" in r.getMessage() for r in caplog.records)
        results = slow.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [r["output_ids"] for r in results] == expected
        stats = slow.cache_stats()
        assert stats["storage_pages_written"] == 0 and stats["storage_unpaying_pages"] > 0
        check_idle(slow)
    finally:
        slow.shutdown()


# ------------------------------------------------------------------------ the page files alone
def test_page_files_survive_a_torn_index_and_an_unfinished_write(tmp_path):
    from radixserve.cache.stores.page_files import LocalFileBackend, PageMissing, PageRecord, StoreStamp

    stamp = StoreStamp(model="m", page_size=2, kv_dtype="float32", bytes_per_token=8, num_layers=1)
    records = [PageRecord(key, key - 1 if key > 1 else None, [key, key + 1]) for key in range(1, 6)]
    backend = LocalFileBackend(str(tmp_path), 10_000)
    assert backend.open(stamp) == []
    for r in records:
        backend.put(r, memoryview(bytes([r.key]) * 16))
    out = bytearray(16)
    backend.get_into(records[0], memoryview(out))  # page 1 becomes the most recently used
    backend.close()
    reopened = LocalFileBackend(str(tmp_path), 10_000)
    assert reopened.open(stamp)[-1] == 1  # the LRU order survives
    reopened.close()
    (tmp_path / "index.bin").write_bytes(b"RXKVIDX1 torn")  # a crash mid-save
    (tmp_path / "pages" / "00000000000000ff.tmp").write_bytes(b"half a page")  # and mid-write
    again = LocalFileBackend(str(tmp_path), 10_000)
    assert sorted(again.open(stamp)) == [1, 2, 3, 4, 5]  # the directory is the truth
    assert not (tmp_path / "pages" / "00000000000000ff.tmp").exists()
    again.get_into(records[2], memoryview(out))
    assert out == bytes([3]) * 16
    with pytest.raises(PageMissing, match="other tokens"):  # the same hash, other tokens: never served
        again.get_into(PageRecord(3, 2, [9, 9]), memoryview(out))
    again.close()
    smaller = LocalFileBackend(str(tmp_path), 3 * (tmp_path / "pages" / f"{3:016x}.page").stat().st_size)
    kept = smaller.open(stamp)  # a smaller --storage-size than last time: the least recently used go
    assert len(kept) == 3 and smaller.used_bytes <= smaller.capacity_bytes
    smaller.close()


# ------------------------------------------------------------------------ a real server
def start(model_dir: Path, workdir: Path, store: Path, *extra: str) -> ServerProcess:
    return ServerProcess(["--model-path", str(model_dir), "--device", "cpu", "--max-total-tokens", "256",
                          "--page-size", str(PAGE), "--hicache-ratio", "1", "--storage-dir", str(store),
                          "--storage-read-gbps", "10", "--storage-prefill-tflops", "0.001", *extra],  # reads pay
                         workdir).wait_ready()


def reported(server: ServerProcess, name: str, timeout_s: float = 30.0) -> float:
    """A metric from the engine's periodic stats: the first may come after the server answers."""
    deadline = time.monotonic() + timeout_s
    while name not in (values := metric_values(server.base_url)):
        assert time.monotonic() < deadline, f"{name} never reported"
        time.sleep(0.1)
    return values[name]


def generate(server: ServerProcess, prompt: list[int]) -> dict:
    with server.client() as http:
        reply = http.post("/generate", json={"input_ids": prompt, "sampling_params": GREEDY})
    assert reply.status_code == 200, reply.text
    return reply.json()


def wait_written(server: ServerProcess) -> dict:
    """/metrics once the store's write queue is empty (the writes land off the step)."""
    deadline = time.monotonic() + 60
    while True:
        values = metric_values(server.base_url)
        if values["radixserve:storage_pending_write_bytes"] == 0 or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


def page_file(store: Path, prompt: list[int], page: int) -> Path:
    return store / "pages" / f"{page_hashes(prompt, PAGE, None)[page]:016x}.page"


def push_to_disk(server: ServerProcess, prompts: list[list[int]]) -> None:
    for prompt in prompts:  # 12 prompts of ~150 tokens through 256 device and 256 host tokens
        generate(server, prompt)
    wait_written(server)


def test_restarted_server_serves_the_next_turn_from_disk(oracle, tmp_path):
    path, prompts, _ = oracle
    store = tmp_path / "store"
    turn1 = prompts[0]
    server = start(path, tmp_path, store)
    try:
        reply = generate(server, turn1)
    finally:
        assert server.stop() == 0  # SIGTERM: the engine writes its tree before it exits
    turn2 = turn1 + reply["output_ids"] + [11, 12, 13, 14, 15]
    server = start(path, tmp_path, store)
    try:
        answer = generate(server, turn2)
        values = metric_values(server.base_url)
    finally:
        server.stop()
    # The KV of turn 1's prompt and reply (all but its last token, never fed back), whole pages.
    assert answer["meta_info"]["cached_tokens"] == (len(turn1) + NEW - 1) // PAGE * PAGE
    assert answer["output_ids"] == hf_greedy(path, [turn2], max_new=NEW)[0]
    assert values["radixserve:storage_restored_pages"] > 0
    assert values["radixserve:storage_loads_total"] == 1
    assert values["radixserve:storage_loaded_tokens_total"] > 0


def test_corrupt_and_deleted_pages_are_dropped_and_computed(oracle, tmp_path):
    path, prompts, expected = oracle
    store = tmp_path / "store"
    server = start(path, tmp_path, store)
    try:
        push_to_disk(server, prompts)
        # Prompt 0's third page: a flipped byte in its KV; prompt 2's second page: its file deleted.
        corrupt, gone = page_file(store, prompts[0], 2), page_file(store, prompts[2], 1)
        assert corrupt.exists() and gone.exists()
        data = bytearray(corrupt.read_bytes())
        data[-5] ^= 0xFF
        corrupt.write_bytes(bytes(data))
        gone.unlink()
        for _ in range(2):  # again: the dropped pages are not asked for twice
            for i in (0, 2):
                assert generate(server, prompts[i])["output_ids"] == expected[i]
        values = metric_values(server.base_url)
        assert values["radixserve:storage_corrupt_pages_total"] == 1
        assert values["radixserve:storage_missing_pages_total"] == 1
        assert values["radixserve:storage_loads_total"] > 0
        assert not corrupt.exists()
    finally:
        server.stop()
    assert "fail their checksum" in server.output_path.read_text()


def test_a_full_store_keeps_what_fits_and_drops_the_rest(oracle, tmp_path):
    path, prompts, expected = oracle
    store = tmp_path / "store"
    # 0.0004 GB: a dozen 32 KiB pages of the tiny model; the least recently used go first.
    server = start(path, tmp_path, store, "--storage-size", "0.0004")
    try:
        push_to_disk(server, prompts)
        for i in (0, 11):
            assert generate(server, prompts[i])["output_ids"] == expected[i]
        values = wait_written(server)
        assert values["radixserve:storage_evicted_pages_total"] > 0
        assert values["radixserve:storage_used_bytes"] <= 400_000
    finally:
        server.stop()
    on_disk = sum(p.stat().st_size for p in (store / "pages").iterdir())
    assert on_disk <= 400_000


def test_a_page_larger_than_the_store_is_not_kept(oracle, tmp_path):
    path, prompts, expected = oracle
    server = start(path, tmp_path, tmp_path / "store", "--storage-size", "0.000001")  # 1,000 bytes
    try:
        push_to_disk(server, prompts)
        assert generate(server, prompts[0])["output_ids"] == expected[0]
        values = metric_values(server.base_url)
        assert values["radixserve:storage_write_drops_total"] > 0
        assert values["radixserve:storage_pages_written_total"] == 0
        assert values["radixserve:storage_loads_total"] == 0
    finally:
        server.stop()


def test_a_slow_disk_is_neither_read_nor_written(oracle, tmp_path):
    """Pages written by a server on a fast disk; the same directory then served with 200 ms a page
    read (the start-up measurement sees it too), the prefill rate pinned at 50 GFLOP/s: computing a
    page is far faster than reading it at any position of the context, so the pages found are not
    read (each request's decision logged) and nothing new is written."""
    path, prompts, expected = oracle
    store = tmp_path / "store"
    fast = start(path, tmp_path, store)
    try:
        push_to_disk(fast, prompts)
    finally:
        assert fast.stop() == 0
    server = start(path, tmp_path, store, "--storage-read-latency-ms", "200",
                   "--storage-read-gbps", "0", "--storage-prefill-tflops", "0.05")
    try:
        assert reported(server, "radixserve:storage_pages") > 0
        push_to_disk(server, prompts)
        assert generate(server, prompts[0])["output_ids"] == expected[0]
        values = metric_values(server.base_url)
        assert values["radixserve:storage_pages_written_total"] == 0
        assert values["radixserve:storage_unpaying_pages_total"] > 0
        assert values["radixserve:storage_skipped_loads_total"] > 0
        assert values["radixserve:storage_loads_total"] == 0
    finally:
        server.stop()
    log = server.output_path.read_text()
    assert "computing" in log and "no load pays within the context length" in log


def test_simulated_agent_workload_with_a_small_host_tier_and_the_storage_tier():
    """The agent workload scaled down, through the engine's scheduler, cache and storage tier
    (real files; no model): with a host tier of 1x the device pool, the storage tier brings the hit
    rate within 0.02 of the unlimited cache's."""
    from radixserve.bench.scheduler_sim import SimConfig, agent_sessions, simulate, unlimited_oracle

    cfg = SimConfig(sessions=64, turns=5, systems=4, system_len=512, user_len=64, assistant_len=32,
                    output_len=32, pool=14000, think_s=0.1, prefix_hold_s=0.0, page_size=PAGE, host_ratio=1.0)
    sessions = agent_sessions(cfg)
    host_only = simulate(cfg, sessions)
    with_disk = simulate(dataclasses.replace(cfg, storage=True), sessions)
    assert with_disk["storage_loaded_tokens"] > 0
    assert with_disk["hit_rate"] > host_only["hit_rate"]
    assert with_disk["hit_rate"] >= unlimited_oracle(sessions) - 0.02, with_disk


# ------------------------------------------------------------------------ a store workers share
@pytest.fixture
def redis_url(tmp_path):
    """A real redis-server on a free loopback port (skipped where the server or the client is not
    installed: `apt-get install redis-server`, `pip install redis`)."""
    import shutil
    import subprocess

    from conftest import free_port

    pytest.importorskip("redis")
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def test_two_workers_share_prefixes_through_redis(oracle, tmp_path, redis_url):
    path, prompts, expected = oracle
    args = ["--model-path", str(path), "--device", "cpu", "--max-total-tokens", "256", "--page-size", str(PAGE),
            "--hicache-ratio", "1", "--storage-backend", "redis", "--storage-url", redis_url,
            "--storage-read-gbps", "10", "--storage-prefill-tflops", "0.001"]
    first = ServerProcess(args, tmp_path).wait_ready()
    second = ServerProcess(args, tmp_path).wait_ready()
    try:
        push_to_disk(first, prompts)  # the first worker's host tier drops them into Redis
        # The second worker lists the shared store's pages once a second: wait until it has seen them
        # (/server_info asks the engine for its stats now; /metrics' gauges move only with its steps).
        def listed(server: ServerProcess) -> float:
            return httpx.get(f"{server.base_url}/server_info", timeout=10).json()["stats"]["storage_pages"]

        held = listed(first)
        deadline = time.monotonic() + 60
        while listed(second) < held:
            assert time.monotonic() < deadline, "the second worker never listed the shared pages"
            time.sleep(0.2)
        answer = generate(second, prompts[0])  # the second worker never saw this prompt
        assert answer["output_ids"] == expected[0]
        assert answer["meta_info"]["cached_tokens"] > 0
        values = metric_values(second.base_url)
        assert values["radixserve:storage_loads_total"] == 1
        assert values["radixserve:storage_pages_written_total"] == 0
    finally:
        first.stop()
        second.stop()


def test_a_read_takes_its_pages_in_parallel_and_ends_at_the_first_gap(tmp_path):
    """A run of six pages read by the store's reader threads, page 2's file deleted and page 4's
    bytes flipped: the read gives the two leading pages, exact, and both bad pages are dropped and
    counted (a page after a gap is read too, but no prefix of anything)."""
    import torch

    from radixserve.cache.stores.disk import DiskStore, ReadJob
    from radixserve.cache.stores.page_files import LocalFileBackend, PageRecord, StoreStamp

    stamp = StoreStamp(model="m", page_size=2, kv_dtype="float32", bytes_per_token=4096, num_layers=1)
    store = DiskStore(LocalFileBackend(str(tmp_path), 1 << 30), stamp)
    records = [PageRecord(key, key - 1 if key > 1 else None, [key, key + 1]) for key in range(1, 7)]
    pages = [torch.full((stamp.page_bytes,), key, dtype=torch.uint8) for key in range(1, 7)]
    try:
        for record, page in zip(records, pages):
            store.write(record, page.clone(), wait=True)
        store.flush()
        deadline = time.monotonic() + 30
        while store.pending_bytes and time.monotonic() < deadline:
            time.sleep(0.01)
        (tmp_path / "pages" / f"{3:016x}.page").unlink()
        path = tmp_path / "pages" / f"{5:016x}.page"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        job = ReadJob(1, records, torch.zeros(6 * stamp.page_bytes, dtype=torch.uint8))
        store.read(job)
        while not store.finished() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert job.done and job.pages_read == 2
        assert torch.equal(job.out[:2 * stamp.page_bytes], torch.cat(pages[:2]))
        assert store.stats.missing_pages == 1 and store.stats.corrupt_pages == 1
        assert 3 not in store and 5 not in store and 6 in store
    finally:
        store.close()
