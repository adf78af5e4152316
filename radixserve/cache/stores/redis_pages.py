"""A storage-tier backend several workers share: the page records of `page_files` in a Redis server.

Keys are `rxkv:<stamp digest>:<page hash>`, so workers of one model and settings share every page
(a worker behind the router finds the prefixes another computed) and a worker of another model
or page size never sees them. Each value is a whole record (header, token ids, KV bytes), checked
as a file's is. Redis evicts by its own `maxmemory-policy` (run it with `allkeys-lru`): a page it
dropped is a missing page to the reader, which computes it. The client library is imported only
when this backend is chosen (`pip install redis`).

Under tensor parallelism each rank keeps its shard of a page under its own prefix: the stamp names
the tp size and the rank, so rank r of every tp-N worker shares one namespace, and a tp-1 worker's
keys and a tp-2 worker's never mix. `namespace` is this rank's prefix; rank 0 lists the other
ranks' namespaces too (`list_keys(namespace)`) to learn which pages every shard of is there
(cache/storage_shards.py).
"""

from __future__ import annotations

import functools
import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from radixserve.cache.stores.page_files import (READ_THREADS, PageMissing, PageRecord, StoreStamp, check_page,
                                                encode_page)


def key_prefix(stamp: StoreStamp) -> str:
    """The prefix of the keys of the pages written under stamp (a digest of it)."""
    return "rxkv:" + hashlib.blake2b(stamp.to_json().encode(), digest_size=8).hexdigest() + ":"


class RedisBackend:
    shared = True

    def __init__(self, url: str, capacity_bytes: int, *, read_latency_s: float = 0.0):
        try:
            import redis
        except ImportError:
            raise ValueError("storage_backend redis needs the redis client: pip install redis") from None
        self._redis: Any = redis
        self.url = url
        self.capacity_bytes = capacity_bytes
        self.read_latency_s = read_latency_s
        self.used_bytes = 0  # what this worker wrote (Redis holds the rest)
        self.client = redis.Redis.from_url(url, socket_timeout=10)
        self.prefix = ""

    def __reduce__(self):
        # Built again (unopened) in the storage tier's I/O process: a client does not cross processes.
        return functools.partial(RedisBackend, read_latency_s=self.read_latency_s), (self.url, self.capacity_bytes)

    def open(self, stamp: StoreStamp) -> list[int]:
        self.prefix = key_prefix(stamp)
        try:
            self.client.ping()
        except self._redis.RedisError as e:
            raise ValueError(f"storage_url {self.url}: the Redis server does not answer ({e})") from None
        return self.list_keys()

    @property
    def namespace(self) -> str:
        """The prefix of this store's keys (set by open)."""
        return self.prefix

    def list_keys(self, namespace: Optional[str] = None) -> list[int]:
        """The keys under this store's prefix, or under another store's (`namespace`)."""
        prefix = self.prefix if namespace is None else namespace
        keys = []
        for name in self.client.scan_iter(match=prefix + "*", count=1000):
            try:
                keys.append(int(name[len(prefix):], 16))
            except ValueError:
                continue
        return keys

    def _name(self, key: int) -> str:
        return f"{self.prefix}{key:016x}"

    def put(self, record: PageRecord, payload: memoryview) -> None:
        header, tokens = encode_page(record, payload)
        try:
            self.client.set(self._name(record.key), header + tokens + payload.tobytes())
        except self._redis.RedisError as e:
            raise OSError(f"redis: {e}") from None
        self.used_bytes += len(header) + len(tokens) + payload.nbytes

    def get_into(self, record: PageRecord, out: memoryview) -> None:
        if self.read_latency_s:
            time.sleep(self.read_latency_s)
        try:
            data = self.client.get(self._name(record.key))
        except self._redis.RedisError as e:
            raise PageMissing("error", f"redis: {e}") from None
        if data is None:
            raise PageMissing("missing", "Redis no longer holds it")
        check_page(record, data, out)

    def remove(self, key: int) -> None:
        try:
            self.client.delete(self._name(key))
        except self._redis.RedisError:
            pass

    def make_room(self, nbytes: int) -> list[int]:
        return []  # Redis evicts by its own policy

    def probe_read_bandwidth(self, page_bytes: int) -> float:
        name = self.prefix + "bandwidth-probe"
        self.client.set(name, b"\0" * page_bytes)
        def read(_: int) -> None:
            if self.read_latency_s:
                time.sleep(self.read_latency_s)
            self.client.get(name)

        try:  # READ_THREADS at a time, as the store reads
            reads = 2 * READ_THREADS
            with ThreadPoolExecutor(READ_THREADS) as readers:
                start = time.perf_counter()
                list(readers.map(read, range(reads)))
                return reads * page_bytes / max(time.perf_counter() - start, 1e-9)
        finally:
            self.client.delete(name)

    def close(self) -> None:
        self.client.close()
