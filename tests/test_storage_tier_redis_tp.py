"""The storage tier's Redis backend under tensor parallelism on the CPU: 2 rank processes over gloo
and a real redis-server on a loopback port, each rank keeping its shard of every page under a key
prefix of its own.

Greedy tokens at tp 2 after prefixes went device -> host -> Redis -> back equal Hugging Face's (and
so tp 1's: the file backend's tests check the two agree), each rank's shards under its own prefix,
neither a tp-1 worker's; a restart finds every rank's pages; a second tp-2 worker running beside
the first counts the pages the first wrote once its periodic listing finds every rank's shard; a
shard deleted on rank 1 alone, after rank 0 counted the page, ends that read there: the request
computes the rest with the same tokens and the page is dropped and counted missing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from radixserve import Engine
from radixserve.cache.block_hash import page_hashes
from radixserve.cache.stores.redis_pages import key_prefix
from test_engine import check_idle
from test_storage_tier import (GREEDY, PAGE, READS_PAY, check_restart_refinds_the_prefixes,
                               check_served_twice_through_the_tier)
from test_storage_tier import redis_url  # noqa: F401  (the fixture)
from test_storage_tier_tensor_parallel import aligned, serve_one
from test_storage_tier_tensor_parallel import oracle  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(600)


def redis_tp_engine(path, url, **extra) -> Engine:
    # 256 device tokens and a host tier as large on each rank: a dozen 150-token prompts go to Redis.
    return Engine(str(path), **{"tp_size": 2, "max_total_tokens": 256, "page_size": PAGE, "hicache_ratio": 1,
                                "storage_backend": "redis", "storage_url": url, **READS_PAY, **extra})


def store_of(engine: Engine):
    """Rank 0's store (storage_shards.ShardedStore)."""
    return engine.core.cache.host.storage.store


def keys_under(url: str, prefix: str) -> set[int]:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return {int(name[len(prefix):], 16) for name in client.scan_iter(match=prefix + "*")}
    finally:
        client.close()


def rank_prefixes(engine: Engine) -> list[str]:
    """Rank 0's key prefix and rank 1's (which rank 1 told rank 0, checked against its stamp)."""
    store = store_of(engine)
    rank1 = key_prefix(dataclasses.replace(store.stamp, tp_rank=1))
    assert store._namespaces == {1: rank1}
    return [store.namespace, rank1]


def test_tp2_on_redis_greedy_equals_hf_after_device_host_redis_and_back(oracle, redis_url):
    path, prompts, expected = oracle
    engine = redis_tp_engine(path, redis_url)
    try:
        prefixes = rank_prefixes(engine)
        check_served_twice_through_the_tier(engine, prompts, expected)
    finally:
        engine.shutdown()
    shards = [keys_under(redis_url, p) for p in prefixes]
    assert prefixes[0] != prefixes[1] and shards[0] == shards[1] != set()  # every page's two shards
    # A tp-1 worker of the same model and page size: keys of its own, and none of tp 2's.
    single = Engine(str(path), max_total_tokens=256, page_size=PAGE, hicache_ratio=1, storage_backend="redis",
                    storage_url=redis_url, **READS_PAY)
    try:
        assert store_of(single).namespace not in prefixes
        assert single.cache_stats()["storage_restored_pages"] == 0
        assert serve_one(single, prompts[0])["meta_info"]["cached_tokens"] == 0
    finally:
        single.shutdown()


def test_tp2_on_redis_restart_refinds_the_pages_of_every_rank(oracle, redis_url):
    check_restart_refinds_the_prefixes(redis_tp_engine, oracle, redis_url)


def test_a_second_tp2_worker_counts_the_pages_the_first_wrote_once_every_shard_is_listed(oracle, redis_url):
    path, prompts, expected = oracle
    second = redis_tp_engine(path, redis_url)
    try:
        assert second.cache_stats()["storage_restored_pages"] == 0
        # The first worker: another process (a process belongs to one tensor-parallel group). At its
        # shutdown what is still on the device or the host is written, on both ranks.
        script = ("import json, sys; from test_storage_tier_redis_tp import GREEDY, redis_tp_engine; "
                  "e = redis_tp_engine(sys.argv[1], sys.argv[2]); "
                  "e.generate(input_ids=json.loads(sys.argv[3]), sampling_params=GREEDY); e.shutdown()")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
        subprocess.run([sys.executable, "-c", script, str(path), redis_url, json.dumps(prompts[:3])], env=env,
                       check=True, timeout=120)
        written = keys_under(redis_url, rank_prefixes(second)[0])
        assert written
        deadline = time.monotonic() + 30
        while second.cache_stats()["storage_pages"] < len(written):  # listed once a second
            assert time.monotonic() < deadline, "the second worker never counted the first one's pages"
            time.sleep(0.2)
        results = second.generate(input_ids=prompts[:3], sampling_params=GREEDY)
        assert [r["output_ids"] for r in results] == expected[:3]
        assert [r["meta_info"]["cached_tokens"] for r in results] == [aligned(p) for p in prompts[:3]]
        assert second.cache_stats()["storage_pages_written"] == 0
        check_idle(second)
    finally:
        second.shutdown()


def test_a_shard_lost_on_rank_1_alone_is_computed_and_dropped(oracle, redis_url):
    import redis

    path, prompts, expected = oracle
    engine = redis_tp_engine(path, redis_url)
    engine.generate(input_ids=prompts[:2], sampling_params=GREEDY)
    engine.shutdown()
    engine = redis_tp_engine(path, redis_url)
    client = redis.Redis.from_url(redis_url)
    try:
        before = engine.cache_stats()
        third = page_hashes(prompts[0], PAGE, None)[2]
        assert store_of(engine).has(third)  # counted: both shards were there at start-up
        # Now rank 1's shard of prompt 0's third page goes (Redis evicted it there alone).
        shard = f"{rank_prefixes(engine)[1]}{third:016x}"
        assert client.delete(shard) == 1
        results = engine.generate(input_ids=prompts[:2], sampling_params=GREEDY)
        assert [r["output_ids"] for r in results] == expected[:2]
        # Prompt 0 is read up to the page rank 1 lost; prompt 1 whole.
        assert [r["meta_info"]["cached_tokens"] for r in results] == [2 * PAGE, aligned(prompts[1])]
        after = engine.cache_stats()
        assert after["storage_missing_pages"] == before["storage_missing_pages"] + 1
        if store_of(engine).has(third):  # dropped, then saved again: rank 1 wrote its shard anew
            assert client.exists(shard)
        check_idle(engine)
    finally:
        engine.shutdown()
        client.close()
