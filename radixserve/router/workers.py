"""Workers the router knows: address, health, load, and the prefix trees it routes on."""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import urlsplit

from radixserve.router.prefix_tree import BlockHashMirror, Key, PrefixTree

# A finished request's prompt still counts as "about to be cached" this long, to cover the time
# between its response and the worker's insert event reaching the router.
RECENT_KEEP_S = 2.0
MAX_RECENT = 256
# The tree of prompts in flight only grows between rebuilds (from what is in flight or recent):
# matching a prompt against each of 200 in-flight prompts of 3k tokens took ~19 ms per request,
# in the router's one event loop; a tree match takes microseconds.
PENDING_REBUILD_S = 1.0


def normalize_url(url: object) -> str:
    """`http(s)://host:port[/prefix]` without a trailing slash; ValueError says what is wrong."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("url must be a non-empty string like http://10.0.0.5:30000")
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"url {url!r} must start with http:// or https://")
    if not parts.hostname:
        raise ValueError(f"url {url!r} has no host")
    if parts.username is not None or parts.password is not None:
        # A password in a URL would show in GET /workers, the metrics' labels and the logs.
        raise ValueError("a worker url must not carry a user name or password (user:password@)")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"url {url!r} has an invalid port") from None
    if parts.query or parts.fragment:
        raise ValueError(f"url {url!r} must not have a query or fragment")
    return url


@dataclass
class Worker:
    id: str
    url: str
    max_tree_size: Optional[int] = None
    # The router sends it the workers' admin key (router/trust.py): the operator named its URL.
    trusted: bool = False
    healthy: bool = False
    ever_checked: bool = False
    ever_healthy: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    load: int = 0  # requests the router has in flight on this worker
    requests: int = 0
    last_error: Optional[str] = None
    # cache_aware: what was routed here (approximate, LRU-trimmed)
    tree: PrefixTree = field(init=False)
    # kv_aware: what the worker's radix cache holds, from its /kv_events stream
    mirror: BlockHashMirror = field(init=False)
    kv_synced: bool = False
    kv_seq: int = 0
    kv_events: int = 0
    kv_resyncs: int = 0
    inflight: dict[int, Key] = field(default_factory=dict)
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=MAX_RECENT))
    pending: PrefixTree = field(init=False)  # inflight + recent prompts, and some just expired
    pending_built: float = field(init=False)
    pending_stale: bool = False  # a request ended since the last rebuild
    kv_task: Optional[asyncio.Task] = None
    # balanced: uncached prompt symbols of the requests in flight here (their prefill work)
    outstanding_work: int = 0
    work_by_token: dict[int, int] = field(default_factory=dict)
    next_work: int = 0

    def __post_init__(self) -> None:
        self.tree = PrefixTree(self.max_tree_size)
        self.mirror = BlockHashMirror()
        self.pending = PrefixTree()
        self.pending_built = time.monotonic()

    # ------------------------------------------------------------------ kv_aware helpers
    def pending_match(self, key: Key) -> int:
        """Longest prefix shared with prompts in flight here (or just finished): soon cached."""
        now = time.monotonic()
        if self.pending_stale and now - self.pending_built >= PENDING_REBUILD_S:
            while self.recent and self.recent[0][0] < now:
                self.recent.popleft()
            self.pending = PrefixTree()
            for other in itertools.chain(self.inflight.values(), (k for _, k in self.recent)):
                self.pending.insert(other)
            self.pending_built = now
            self.pending_stale = bool(self.recent)
        return self.pending.match_len(key)

    def assign_work(self, work: int) -> None:
        """The work of the request the policy just chose this worker for; start_request books it."""
        self.next_work = work

    def start_request(self, token: int, key: Optional[Key]) -> None:
        self.load += 1
        self.requests += 1
        if self.next_work:
            self.work_by_token[token] = self.next_work
            self.outstanding_work += self.next_work
            self.next_work = 0
        if key is not None:
            self.inflight[token] = key
            self.pending.insert(key)

    def end_request(self, token: int) -> None:
        self.load = max(0, self.load - 1)
        self.outstanding_work -= self.work_by_token.pop(token, 0)
        key = self.inflight.pop(token, None)
        if key is not None:
            self.recent.append((time.monotonic() + RECENT_KEEP_S, key))
            self.pending_stale = True

    def describe(self) -> dict:
        return {"id": self.id, "url": self.url, "trusted": self.trusted, "healthy": self.healthy,
                "load": self.load, "requests": self.requests, "consecutive_failures": self.consecutive_failures,
                "last_error": self.last_error, "approx_tree_size": len(self.tree),
                "kv_synced": self.kv_synced, "kv_tree_size": len(self.mirror), "kv_events": self.kv_events}


class WorkerRegistry:
    def __init__(self, max_tree_size: Optional[int] = None):
        self.max_tree_size = max_tree_size
        self.workers: dict[str, Worker] = {}
        self._ids = itertools.count()

    def add(self, url: object, trusted: bool = False) -> Worker:
        """`url` is normalised first (ValueError); KeyError when a worker there is registered."""
        url = normalize_url(url)
        if any(w.url == url for w in self.workers.values()):
            raise KeyError(url)
        worker = Worker(id=f"worker-{next(self._ids)}", url=url, max_tree_size=self.max_tree_size, trusted=trusted)
        self.workers[worker.id] = worker
        return worker

    def remove(self, worker_id: str) -> Worker:
        return self.workers.pop(worker_id)

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.healthy]

    def __iter__(self):
        return iter(list(self.workers.values()))

    def __len__(self) -> int:
        return len(self.workers)
