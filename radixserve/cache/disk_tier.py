"""The storage tier's policy: what goes to disk, what comes back, and only when it pays.

The tier is content-addressed, beside the tree rather than in it: a page on disk is named by its
chained page hash (the KV events' hash, `page_events.path_page_hash`; a salted request's pages
chain from its namespace, so they never answer another namespace's lookup), and no tree node
records what is on disk. So the tier survives restarts as it is, and needs three things of the
tree's host store (`stores/host_kv.HostKV`): a host copy it is about to drop (`save`), a lookup of
what it could add beyond a request's cached prefix (`fetch`), and host slots to read it into that
then become a host-only leaf (`HostPlace`), from where the host store's own load copies them to
the device.

- **Save**: when the host tier drops a host copy for room, its pages not on disk yet are copied out
  of the host pool (its slots are reused at once) and queued for the I/O process; only the pages a
  load could ever pay for (`LoadCost.first_paying_position`): on a disk slow for the model, the
  shallow pages of a prompt cost more to read than to compute, whatever comes after them.
- **Fetch** (a waiting request, on arrival and at each admission attempt, until it is decided):
  hash the request's pages, count the consecutive ones past its cached prefix that the store holds,
  and read them only when that pays: expected read time (bytes / the read bandwidth measured at
  start-up) below the time computing them takes (their FLOPs / the prefill rate measured at
  start-up). The decision is logged per request and counted. A read takes its host slots at once
  (making room as a host copy would) and the I/O process reads the pages straight into them: no
  copy on the engine's side. While the read runs, the request waits (admission passes over it, as
  for a host-tier load); every waiting request's read starts on arrival, so the LPM queue's next
  requests find theirs done.
- **Poll** (each step's start): finished reads become host-only leaves over the slots they were
  read into; the waiting queue sees the longer match and the host tier copies them back as any
  host hit.

A hybrid model's tree resumes a request only where a recurrent-state snapshot lies, so its pages
on disk need their snapshot beside them: a second record kind keyed by the hash of the page it
ends, saved when the host tier drops a node's host snapshot, fetched with the pages before it
(only as far as the deepest one on disk) and attached as a host snapshot (`disk_snapshots.py`).

Under tensor parallelism this policy runs on rank 0 alone, over a store that counts a page as on
disk only once every rank wrote its shard (storage_shards.ShardedStore); every save and read (with
the host slots it goes to) is told to the other ranks through the copy log, which they replay on
their own shards.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import torch

from radixserve.cache.block_hash import page_hashes
from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.namespace import namespace_page_parent
from radixserve.cache.page_events import path_page_hash
from radixserve.cache.prefix_cache import TreeNode
from radixserve.cache.stores.disk import DiskStore, ReadJob
from radixserve.cache.stores.page_files import PageRecord, snapshot_record

logger = logging.getLogger("radixserve")

# Requests whose storage decision is remembered (a request is decided once, until its prompt grows).
REMEMBERED_REQUESTS = 4096
# Requests waiting undecided whose page hashes are kept.
HASHED_REQUESTS = 1024

STORAGE_STAT_KEYS = ("storage_pages", "storage_used_bytes", "storage_capacity_bytes", "storage_restored_pages",
                     "storage_pending_write_bytes", "storage_pages_written", "storage_bytes_written",
                     "storage_pages_read", "storage_bytes_read", "storage_loads", "storage_skipped_loads",
                     "storage_loaded_tokens", "storage_attach_failures", "storage_write_drops",
                     "storage_unpaying_pages",
                     "storage_evicted_pages", "storage_missing_pages", "storage_corrupt_pages",
                     "storage_read_errors", "storage_read_bandwidth_gbps", "storage_prefill_tflops",
                     "storage_snapshots_written", "storage_snapshots_loaded")


def no_storage_stats() -> dict[str, float]:
    return {k: 0 for k in STORAGE_STAT_KEYS}


@dataclass(frozen=True)
class LoadCost:
    """What a read and a recompute of n tokens after `start` cached ones cost, in seconds."""
    read_bytes_per_s: float  # measured at start-up (page-sized reads, latency included)
    bytes_per_token: int  # KV bytes one token's page share takes on disk
    flops_per_token: float  # the model's matmuls: 2 x its parameters
    attention_flops_per_pair: float  # per (token, earlier token) pair: 4 x layers x query heads x head dim
    prefill_flops_per_s: float  # measured at start-up

    def read_seconds(self, tokens: int) -> float:
        return tokens * self.bytes_per_token / self.read_bytes_per_s

    def recompute_seconds(self, start: int, tokens: int) -> float:
        pairs = tokens * start + tokens * (tokens + 1) / 2  # each token attends to everything before it
        return (tokens * self.flops_per_token + pairs * self.attention_flops_per_pair) / self.prefill_flops_per_s

    def break_even(self) -> float:
        """The cached context after which reading a token beats computing it (0: always; inf: never)."""
        per_token_read = self.read_seconds(1)
        base = self.flops_per_token / self.prefill_flops_per_s
        if base >= per_token_read:
            return 0.0
        if self.attention_flops_per_pair <= 0:
            return float("inf")
        return (per_token_read - base) * self.prefill_flops_per_s / self.attention_flops_per_pair

    def first_paying_position(self, context_len: Optional[int]) -> float:
        """The first position a page on disk may start at and still be read by a load that pays.
        A load of the tokens [s, e) pays when its middle lies past the break-even context
        ((s + e) / 2 > break_even: a token's recompute grows with the context before it, its read
        does not); e is at most context_len and s at most the page's start p, so no load holding
        the page pays unless p > 2 x break_even - context_len (None: no bound on e, every page)."""
        if context_len is None:
            return 0.0
        return max(0.0, 2 * self.break_even() - context_len)


def measure_prefill_flops(device: torch.device, dtype: torch.dtype, hidden: int, *, rows: int = 1024,
                          seconds: float = 0.2) -> float:
    """FLOP/s of the prefill's dominant work (a [rows, hidden] x [hidden, 4 hidden] matmul) on the
    device: an upper bound of the real prefill rate, so recompute is never estimated too slow and
    a load is never taken that computing would have beaten."""
    a = torch.randn(rows, hidden, device=device).to(dtype)
    b = torch.randn(hidden, 4 * hidden, device=device).to(dtype)
    flops = 2.0 * rows * hidden * 4 * hidden
    torch.matmul(a, b)  # the first call pays for the kernel choice
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    reps, start = 0, time.perf_counter()
    while True:
        torch.matmul(a, b)
        reps += 1
        if device.type == "cuda" and reps % 8:
            continue
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds or reps >= 4096:
            return reps * flops / max(elapsed, 1e-9)


# Reads for one request: a prefix read back and pushed out of the host tier again before its
# request got in is read again, this many times at most.
MAX_READS_PER_REQUEST = 3


@dataclass
class _Decision:
    tokens: int  # the request's token count when decided (a longer prompt is decided again)
    matched: int  # its cached prefix then (one that shrank since, evicted while it waited, is decided again)
    job: Optional[ReadJob] = None  # the read in flight (None: decided, nothing in flight)
    reads: int = 0
    # Its read's pages could not be put into the tree (the path they hang from was evicted while
    # they were read): decided again at its next admission attempt.
    unplaced: bool = False


class HostPlace(Protocol):
    """Where the tier's reads land: the tree's host store (stores/host_kv.HostKV)."""

    def reserve_slots(self, tokens: int) -> Optional[torch.Tensor]:
        """Host slots for tokens (whole pages, each page's consecutive), making room as for a host
        copy; None: no room."""

    def free_reserved(self, slots: torch.Tensor) -> None: ...

    def copying(self) -> bool:
        """Copies in flight hold host copies that may go once they are done."""

    def attach(self, tokens: Sequence[int], start: int, slots: torch.Tensor, namespace: Optional[str]) -> int:
        """Hang reserved slots holding tokens[start:] into the tree (taking them: what it does not
        use it frees); the tokens added."""


class TierSnapshots(Protocol):
    """A hybrid model's snapshots in the tier (disk_snapshots.DiskSnapshots), as the tier uses them."""
    state_bytes: int  # one snapshot's bytes on disk
    written: int
    loaded: int

    def save(self, node: TreeNode, page_hash: Optional[int], *, wait: bool = False) -> None: ...

    def usable_pages(self, hashes: Sequence[int], first: int, n: int) -> int: ...

    def attach(self, host: HostPlace, tokens: Sequence[int], start: int, slots: torch.Tensor,
               namespace: Optional[str], data: torch.Tensor) -> int: ...


class StorageTier:
    def __init__(self, store: DiskStore, host_pool: HostKVPool, cost: LoadCost,
                 states: Optional[TierSnapshots] = None, *, context_len: Optional[int] = None):
        self.store = store
        self.states = states  # a hybrid model's snapshots (None: an attention model)
        self.host_pool = host_pool
        self.page_size = host_pool.page_size
        self.page_bytes = store.page_bytes
        assert self.page_bytes == self.page_size * host_pool.bytes_per_token
        self.cost = cost
        # Pages starting before this position are never written: no load reading them pays.
        self.first_saved_position = cost.first_paying_position(context_len)
        self.unpaying_pages = 0  # pages not written for that
        self._decided: OrderedDict[str, _Decision] = OrderedDict()
        self._hashes: OrderedDict[str, tuple[Optional[str], list[int]]] = OrderedDict()  # waiting undecided
        self._jobs = 0
        self.loads = 0
        self.skipped_loads = 0
        self.loaded_tokens = 0
        self.attach_failures = 0
        self._in_flight: dict[int, ReadJob] = {}  # job id -> a read not taken in yet
        self.read_cap = max(self.page_size, host_pool.total_tokens // 2 // self.page_size * self.page_size)

    # ------------------------------------------------------------------ save (host eviction)
    def save(self, node: TreeNode, host_slots: torch.Tensor) -> None:
        """The host tier is about to drop node's host copy (host_slots): queue its pages not on disk
        yet that a load could pay for."""
        parent = path_page_hash(node.parent, self.page_size)
        hashes = page_hashes(node.key, self.page_size, parent)
        node.block_hash = hashes[-1]
        first, todo = self._pages_to_write(node, hashes)
        if todo:  # a copy of those pages: the slots go now
            self._write(node, parent, hashes, todo, ("host", host_slots))
        if self.states is not None and first < len(hashes):
            self.states.save(node, hashes[-1])
        self.store.flush()  # the slots are reused once this returns

    def _pages_to_write(self, node: TreeNode, hashes: list[int]) -> tuple[int, list[int]]:
        """(the first of node's pages that starts where a load may pay (`first_saved_position`),
        those from it on not on disk yet); the pages before it are counted as not written."""
        behind = self.first_saved_position - node_start(node)
        pages = len(hashes)
        first = pages if behind == float("inf") else min(pages, max(0, math.ceil(behind / self.page_size)))
        self.unpaying_pages += first
        return first, [i for i in range(first, pages) if hashes[i] not in self.store]

    def _write(self, node: TreeNode, parent: Optional[int], hashes: list[int], todo: list[int],
               source: tuple[str, torch.Tensor], *, kv_pool=None, wait: bool = False) -> None:
        """Queue pages `todo` of node from `source`'s slots: a host page's bytes where they lie (the
        store's copy into its write buffer is the one copy made), a device page's gathered to the
        CPU from kv_pool (at shutdown)."""
        ps = self.page_size
        where, slots = source
        pages = slots.view(len(hashes), ps)[todo].reshape(-1)
        if where == "host":
            rows = [self.host_pool.buffer[first:first + ps].view(-1) for first in self.host_pool.page_starts(pages)]
        else:
            rows = list(device_rows(kv_pool, pages).reshape(len(todo), self.page_bytes))
        for n, i in enumerate(todo):
            prev = parent if i == 0 else hashes[i - 1]
            self.store.write(PageRecord(hashes[i], prev, node.key[i * ps:(i + 1) * ps]), rows[n], wait=wait,
                             source=(where, slots[i * ps:(i + 1) * ps]))

    # ------------------------------------------------------------------ fetch (a waiting request)
    def fetch(self, key: str, tokens: Callable[[], Sequence[int]], matched: int, namespace: Optional[str],
              host: HostPlace) -> bool:
        """Whether the request `key` waits for a read of the pages after its `matched` cached
        tokens (started here when they are on disk and reading them pays)."""
        decided = self._decided.get(key)
        if decided is not None and decided.job is not None:
            return True
        ids = tokens()
        reads = 0
        if decided is not None:
            if decided.tokens >= len(ids) and (decided.matched <= matched and not decided.unplaced
                                               or decided.reads >= MAX_READS_PER_REQUEST):
                return False
            reads = decided.reads
        ps = self.page_size
        first = matched // ps
        if (len(ids) // ps) <= first or not self.store.num_pages:
            self._remember(key, _Decision(len(ids), matched, reads=reads))
            return False
        hashes = self._hashes_of(key, ids, namespace)
        n = 0
        # Reads land in the host tier: one at most all of it; more than one in flight at most half
        # of it, so one read's pages are not pushed out by the next before their request copies
        # them to the device.
        limit = self.host_pool.total_tokens // ps
        while first + n < len(hashes) and n < limit and self.store.has(hashes[first + n]):
            n += 1
        if self.states is not None:  # a hybrid resumes only where a snapshot lies: pages past the last are no use
            n = self.states.usable_pages(hashes, first, n)
        if n == 0:
            self._remember(key, _Decision(len(ids), matched, reads=reads))
            return False
        start, count = first * ps, n * ps
        if self.reading_tokens and self.reading_tokens + count > self.read_cap:
            return True  # waits, undecided, for the reads in flight to be taken in
        read_s, compute_s = self.cost.read_seconds(count), self.cost.recompute_seconds(start, count)
        if self.states is not None:
            read_s += self.states.state_bytes / self.cost.read_bytes_per_s
        if read_s >= compute_s:
            self._remember(key, _Decision(len(ids), matched, reads=reads))
            self.skipped_loads += 1
            logger.info("storage tier: request %s computes %d tokens after %d cached: reading them would take "
                        "%.2f ms, computing %.2f ms", key, count, start, read_s * 1e3, compute_s * 1e3)
            return False
        records = [PageRecord(hashes[i], hashes[i - 1] if i else namespace_page_parent(namespace),
                              ids[i * ps:(i + 1) * ps]) for i in range(first, first + n)]
        slots = host.reserve_slots(count)  # the I/O process reads the pages straight into them
        job = None if slots is None else self.store.new_read(
            self._jobs + 1, records, slots,
            snapshot=snapshot_record(hashes[first + n - 1]) if self.states is not None else None,
            snapshot_bytes=self.states.state_bytes if self.states is not None else 0,
            payload=dict(key=key, tokens=list(ids[:start + count]), start=start, namespace=namespace, host=host))
        if job is None and slots is not None:
            host.free_reserved(slots)
        if job is None and (self.reading_tokens or host.copying()):
            return True  # the reads or copies in flight hold the room: waits, undecided, for them to end
        self._remember(key, _Decision(len(ids), matched, reads=reads))
        if job is None:
            return False
        self._jobs += 1
        self._in_flight[job.job_id] = job
        self._decided[key].job = job
        self._decided[key].reads += 1
        self.loads += 1
        logger.info("storage tier: request %s reads %d tokens after %d cached: %.2f ms expected, computing them "
                    "%.2f ms", key, count, start, read_s * 1e3, compute_s * 1e3)
        self.store.read(job)
        return True

    def _hashes_of(self, key: str, ids: Sequence[int], namespace: Optional[str]) -> list[int]:
        """The page hashes of request key's prompt ids, kept while it waits undecided (it asks at
        each admission attempt, and hashing a 12k-token prompt takes a millisecond); a prompt that
        grew (a retracted request's) is hashed on from where it was."""
        ps = self.page_size
        known = self._hashes.pop(key, None)
        if known is None or known[0] != namespace or len(known[1]) > len(ids) // ps:
            hashes = page_hashes(ids, ps, namespace_page_parent(namespace))
        else:
            done = known[1]
            hashes = done + page_hashes(ids[len(done) * ps:], ps, done[-1] if done else namespace_page_parent(namespace))
        self._hashes[key] = (namespace, hashes)
        while len(self._hashes) > HASHED_REQUESTS:
            self._hashes.popitem(last=False)
        return hashes

    def _remember(self, key: str, decision: _Decision) -> None:
        self._hashes.pop(key, None)  # decided: asked again only when its prompt changes
        self._decided[key] = decision
        self._decided.move_to_end(key)
        while len(self._decided) > REMEMBERED_REQUESTS:
            old_key, old = next(iter(self._decided.items()))
            if old.job is not None:
                break  # still reading: forgotten after it is taken in
            del self._decided[old_key]

    # ------------------------------------------------------------------ poll (each step's start)
    def poll(self) -> bool:
        """Put the finished reads into the host tier; whether any added tokens."""
        added = False
        for job in self.store.finished():
            p = job.payload
            decided = self._decided.get(p["key"])
            if decided is not None and decided.job is job:
                decided.job = None
            else:
                decided = None  # the request was decided again since: this read is not its decision
            del self._in_flight[job.job_id]
            self.store.attaching = job.job_id
            try:
                got = self._attach(job)
            finally:
                self.store.attaching = None
                self.store.release(job)
            if got:
                self.loaded_tokens += got
                added = True
            elif got is not None:
                self.attach_failures += 1
                if decided is not None:
                    decided.unplaced = True
        return added

    def _attach(self, job: ReadJob) -> Optional[int]:
        """Hang a finished read's pages (and snapshot) into the host tier, where the I/O process put
        them; the tokens added, None when there was nothing to put. Its slots are given back or taken."""
        p = job.payload
        host: HostPlace = p["host"]
        read = job.pages_read * self.page_size
        slots, unread = job.host_slots[:read], job.host_slots[read:]
        if len(unread):
            host.free_reserved(unread)
        end = p["start"] + read
        if not read:
            return None
        if self.states is None:
            return host.attach(p["tokens"][:end], p["start"], slots, p["namespace"])
        if job.snapshot_read and job.pages_read == len(job.records):
            return self.states.attach(host, p["tokens"][:end], p["start"], slots, p["namespace"], job.snapshot_out)
        host.free_reserved(slots)
        return None  # a page gone: the snapshot after it resumes nobody (the store counted the page)

    @property
    def reading_tokens(self) -> int:
        """The tokens the reads in flight (not taken in yet) hold host slots for."""
        return sum(len(job.host_slots) for job in self._in_flight.values())

    def reserved_slots(self) -> list[torch.Tensor]:
        """The host slots the reads in flight hold (the host store's checks count them)."""
        return [job.host_slots for job in self._in_flight.values()]

    def stats(self) -> dict[str, float]:
        s = self.store.stats
        return {"storage_pages": self.store.num_pages, "storage_used_bytes": self.store.used_bytes,
                "storage_capacity_bytes": self.store.backend.capacity_bytes,
                "storage_restored_pages": self.store.restored_pages,
                "storage_pending_write_bytes": self.store.pending_bytes,
                "storage_pages_written": s.pages_written, "storage_bytes_written": s.bytes_written,
                "storage_pages_read": s.pages_read, "storage_bytes_read": s.bytes_read,
                "storage_loads": self.loads, "storage_skipped_loads": self.skipped_loads,
                "storage_loaded_tokens": self.loaded_tokens, "storage_attach_failures": self.attach_failures,
                "storage_write_drops": s.write_drops_queue + s.write_drops_full + s.write_errors,
                "storage_unpaying_pages": self.unpaying_pages,
                "storage_evicted_pages": s.evicted_pages, "storage_missing_pages": s.missing_pages,
                "storage_corrupt_pages": s.corrupt_pages, "storage_read_errors": s.read_errors,
                "storage_read_bandwidth_gbps": self.cost.read_bytes_per_s / 1e9,
                "storage_prefill_tflops": self.cost.prefill_flops_per_s / 1e12,
                "storage_snapshots_written": self.states.written if self.states is not None else 0,
                "storage_snapshots_loaded": self.states.loaded if self.states is not None else 0}

    def save_tree(self, cache, kv_pool) -> int:
        """Queue every page of cache's tree not on disk yet (at shutdown: what a restart should
        find), from its host copy or else from the device pool; the pages queued."""
        cache.host.copier.wait_all()  # host copies being written are complete
        queued = 0
        stack = list(cache.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.key:  # a namespace root
                continue
            parent = path_page_hash(node.parent, self.page_size)
            hashes = page_hashes(node.key, self.page_size, parent)
            node.block_hash = hashes[-1]
            if node.host is None and node.value is None:
                continue  # no copy of its KV left to write
            first, todo = self._pages_to_write(node, hashes)
            if self.states is not None and first < len(hashes):
                self.states.save(node, hashes[-1], wait=True)
            if not todo:
                continue
            source = ("host", node.host.slots) if node.host is not None else ("device", node.value)
            self._write(node, parent, hashes, todo, source, kv_pool=kv_pool, wait=True)
            queued += len(todo)
        self.store.flush()
        return queued

    def close(self, cache=None, kv_pool=None) -> None:
        """Keep the tree's pages (when given it), finish the writes and let go of the directory."""
        if cache is not None and not self.store._closed:
            try:
                queued = self.save_tree(cache, kv_pool)
                logger.info("storage tier: %d pages of the cache written at shutdown", queued)
            except Exception as e:  # noqa: BLE001: what is already on disk stays usable
                logger.warning("storage tier: the cache's pages were not all written at shutdown (%s)", e)
        self.store.close()


def node_start(node: TreeNode) -> int:
    """The position of node's first token: the tokens on the path above it."""
    start, up = 0, node.parent
    while up is not None:
        start += len(up.key)
        up = up.parent
    return start


def device_rows(kv_pool, slots: torch.Tensor) -> torch.Tensor:
    """The KV of device slots as host-pool rows ([slot, layer, k|v, bytes], on the CPU)."""
    idx = slots.to(kv_pool.k_buffers[0].device)
    layers = [torch.stack([k[idx].view(len(slots), -1).view(torch.uint8), v[idx].view(len(slots), -1).view(torch.uint8)],
                          dim=1) for k, v in zip(kv_pool.k_buffers, kv_pool.v_buffers)]
    return torch.stack(layers, dim=1).cpu()
