"""The storage tier's store: a set of pages on a backend, written and read off the step.

The engine thread only queues: `write` hands a page (its bytes already copied out of the host
tier, whose slots are reused at once) to the I/O thread, `read` asks for a run of pages into a
buffer, `finished` takes the reads that are done. One I/O thread does both, reads first: a read
is what a waiting request waits for, a write only keeps a page for later. A read's pages are read
READ_THREADS at a time (one page read at a time leaves an NVMe drive at a fraction of its
bandwidth: a drive serves many requests in flight; and the checksum of one page runs beside the
read of the next); the start-up measurement of the read bandwidth reads the same way. A page still queued for
writing is read from the queue, so a prefix evicted a moment ago is found at once.

Nothing here blocks the step on the disk: a write queue holding more than `max_pending_bytes` drops
the new page (counted), a full disk drops the page that did not fit (counted), a read that fails
ends its run there (the pages after a gap are no prefix of anything: the request computes them).

A hybrid model's state snapshots are records of a second kind (page_files.py) and of another size:
a read of pages may carry the snapshot at their end (`ReadJob.snapshot`), read first (without it
the pages resume nobody, and are not read).

Under tensor parallelism each rank has a store of its own shard of every page, and rank 0's store
(storage_shards.ShardedStore) counts a page as stored only once every rank reported it written:
the stores tell what became of each page and read through `on_event`, from the I/O thread.

`synchronous=True` does the I/O at the call instead (the scheduler simulator, whose steps take no
real time); completion is still observed through `finished`, so the caller's path is the same.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from radixserve.cache.stores.page_files import READ_THREADS, PageBackend, PageMissing, PageRecord, StoreStamp

logger = logging.getLogger("radixserve")

# Pages written between two saves of the backend's LRU index.
INDEX_SAVE_EVERY = 1024
# How often the keys of a backend other servers write to too are listed again (their new pages).
SHARED_REFRESH_S = 1.0


@dataclass
class StoreStats:
    pages_written: int = 0
    bytes_written: int = 0
    pages_read: int = 0
    bytes_read: int = 0
    write_drops_queue: int = 0  # the write queue was full: the page was not kept
    write_drops_full: int = 0  # the disk had no room (ENOSPC), or one page is larger than storage_size
    write_errors: int = 0  # any other OSError on write
    evicted_pages: int = 0  # dropped for room (storage_size reached)
    missing_pages: int = 0  # a read found its file gone
    corrupt_pages: int = 0  # a read found another page, other tokens or a bad checksum (the file is removed)
    read_errors: int = 0


@dataclass
class ReadJob:
    """A run of consecutive pages to read into `out` (page i at i * page_bytes)."""
    job_id: int
    records: list[PageRecord]
    out: torch.Tensor  # uint8, len(records) * page_bytes
    pages_read: int = 0  # set when done: the leading pages that were read and checked
    done: bool = False
    payload: dict = field(default_factory=dict)  # the caller's (what to do with the pages)
    # A hybrid's: the state snapshot at the last page's end, read into snapshot_out before the pages.
    snapshot: Optional[PageRecord] = None
    snapshot_out: Optional[torch.Tensor] = None
    snapshot_read: bool = False  # set when done: it was read and checked


# What a store tells its owner, from the I/O thread (never while it holds its lock): ("written",
# key, kept) after a write was tried, ("lost", key, why) once a key is dropped (why: "evicted" for
# room, or a read's "missing", "corrupt" or "error"), ("read", job, True) once a read is done.
StoreEvent = Callable[[str, Any, Any], None]


class DiskStore:
    def __init__(self, backend: PageBackend, stamp: StoreStamp, *, synchronous: bool = False,
                 max_pending_bytes: int = 1 << 30, on_event: Optional[StoreEvent] = None):
        self.backend = backend
        self.on_event = on_event
        # The read job whose pages the tier is putting into the host tier (tensor parallelism: the
        # other ranks put theirs into the same slots).
        self.attaching: Optional[int] = None
        self.stamp = stamp
        self.page_bytes = stamp.page_bytes
        self.synchronous = synchronous
        self.max_pending_bytes = max(max_pending_bytes, self.page_bytes)
        self.stats = StoreStats()
        # Every key on the backend or queued for it; the I/O thread removes what it drops.
        self._keys: set[int] = set(backend.open(stamp))
        self.restored_pages = len(self._keys)
        self._lock = threading.Condition()
        self._writes: OrderedDict[int, tuple[PageRecord, torch.Tensor]] = OrderedDict()
        self.pending_bytes = 0
        self._reads: deque[ReadJob] = deque()
        self._removals: list[int] = []  # keys discarded, for the I/O thread to delete
        self._done: deque[ReadJob] = deque()
        self._since_index = 0
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._readers: Optional[ThreadPoolExecutor] = None
        if not synchronous:
            self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="storage-read")
            self._thread = threading.Thread(target=self._run, name="storage-io", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ the engine thread's side
    def __contains__(self, key: int) -> bool:
        """Whether the key is stored or queued here (a save need not queue it again)."""
        return key in self._keys

    def has(self, key: int) -> bool:
        """Whether a read of the key may be asked for (under tensor parallelism: every rank holds it)."""
        return key in self._keys

    def status(self, key: int) -> str:
        """"queued" (for writing), "stored" or "absent"."""
        with self._lock:
            if key in self._writes:
                return "queued"
            return "stored" if key in self._keys else "absent"

    # Tensor parallelism's hooks (storage_shards.ShardedStore records them for the other ranks).
    def placed_pages(self, host_slots: torch.Tensor, row_offset: int) -> None:
        """The tier put the pages of read job `attaching` from row row_offset on into host_slots."""

    def placed_state(self, host_slot: int) -> None:
        """The tier put read job `attaching`'s snapshot into host snapshot slot host_slot."""

    def release(self, job: ReadJob) -> None:
        """The tier is done with a finished read."""

    @property
    def num_pages(self) -> int:
        return len(self._keys)

    @property
    def used_bytes(self) -> int:
        return getattr(self.backend, "used_bytes", 0)

    def write(self, record: PageRecord, payload: torch.Tensor, *, wait: bool = False,
              source: Optional[tuple[str, Any]] = None) -> bool:
        """Queue a page (uint8, page_bytes; a snapshot record: its state's bytes; owned by the store
        from now); False: not kept. wait: for room in a full queue (at shutdown) instead of
        dropping the page. source: where the bytes came from ("host" or "device" KV slots, "host_state"
        or "device_state" a snapshot slot), for the other tensor-parallel ranks to copy theirs."""
        size = payload.numel()
        with self._lock:
            if record.key in self._keys:
                return True
            while wait and self._thread is not None and self.pending_bytes + size > self.max_pending_bytes \
                    and self.pending_bytes:
                self._lock.wait(0.1)
            if self.pending_bytes + size > self.max_pending_bytes and self.pending_bytes:
                self.stats.write_drops_queue += 1
                return False
            self._keys.add(record.key)
            self._writes[record.key] = (record, payload)
            self.pending_bytes += size
            self._lock.notify()
        if self.synchronous:
            self._drain_writes()
        return True

    def read(self, job: ReadJob) -> None:
        with self._lock:
            self._reads.append(job)
            self._lock.notify()
        if self.synchronous:
            self._do_read(job)

    def discard(self, keys: list[int]) -> int:
        """Delete these pages from the backend (not counted as lost: nobody counted them); how many
        of them this store held. A page queued for writing is kept."""
        with self._lock:
            held = [key for key in keys if key in self._keys and key not in self._writes]
            self._keys.difference_update(held)
            self._removals.extend(held)
            self._lock.notify()
        if self.synchronous:
            with self._lock:
                removals, self._removals = self._removals, []
            for key in removals:
                self.backend.remove(key)
        return len(held)

    def finished(self) -> list[ReadJob]:
        with self._lock:
            done, self._done = list(self._done), deque()
        return done

    def close(self) -> None:
        """Finish the queued writes, save the index and let go of the directory (once)."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
        else:
            self._drain_writes()
        if self._readers is not None:
            self._readers.shutdown()
        self.backend.close()

    # ------------------------------------------------------------------ the I/O thread
    def _run(self) -> None:
        refreshed = time.monotonic()
        while True:
            if self.backend.shared and time.monotonic() - refreshed >= SHARED_REFRESH_S:
                refreshed = time.monotonic()
                self._refresh_keys()
            with self._lock:
                while not (self._reads or self._writes or self._removals or self._closed):
                    if not self._lock.wait(SHARED_REFRESH_S if self.backend.shared else None):
                        break  # time to list the shared backend's keys again
                # Removals before writes: a page discarded and then saved again is written anew.
                removals, self._removals = self._removals, []
                job = self._reads[0] if self._reads else None
                writing = job is None and bool(self._writes)
                if job is None and not writing and not removals and self._closed:
                    return  # closed, nothing left
            for key in removals:
                self.backend.remove(key)
            if job is not None:
                self._do_read(job)
            elif writing:
                self._write_one()

    def _refresh_keys(self) -> Optional[list[int]]:
        """List the shared backend's keys again (others' new pages); the keys listed (None: it failed)."""
        try:
            keys = self.backend.list_keys()
        except Exception as e:  # noqa: BLE001: the pages already known stay usable
            logger.warning("storage tier: could not list the shared store's pages (%s)", e)
            return None
        with self._lock:
            self._keys.update(keys)
        return keys

    def _drain_writes(self) -> None:
        while self._writes:
            self._write_one()

    def _write_one(self) -> None:
        with self._lock:
            key, (record, payload) = next(iter(self._writes.items()))
        kept = False
        size = payload.numel()
        try:
            self._forget(self.backend.make_room(size), "evicted")
            self.backend.put(record, memoryview(payload.numpy()))
            kept = True
            self.stats.pages_written += 1
            self.stats.bytes_written += size
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self.stats.write_drops_full += 1
            else:
                self.stats.write_errors += 1
                logger.warning("storage tier: a page write failed (%s); the page is not kept", e)
        with self._lock:
            self._writes.pop(key, None)
            self.pending_bytes -= size
            if not kept:
                self._keys.discard(key)
            self._lock.notify_all()  # a writer waiting for room
        if self.on_event is not None:
            self.on_event("written", key, kept)
        self._since_index += 1
        if self._since_index >= INDEX_SAVE_EVERY and hasattr(self.backend, "save_index"):
            self._since_index = 0
            try:
                self.backend.save_index()
            except OSError:
                pass  # the next start scans the directory instead

    def _forget(self, keys: list[int], why: str) -> None:
        """Drop keys from the store (why: "evicted" for room, else what a read found)."""
        if not keys:
            return
        with self._lock:
            for key in keys:
                self._keys.discard(key)
        if self.on_event is not None:
            for key in keys:
                self.on_event("lost", key, why)
        if why == "evicted":
            self.stats.evicted_pages += len(keys)

    def _do_read(self, job: ReadJob) -> None:
        out = job.out.numpy()
        n = 0
        if job.snapshot is not None:
            job.snapshot_read = self._read_one(job.snapshot, memoryview(job.snapshot_out.numpy()))
            if job.snapshot_read:
                self.stats.bytes_read += job.snapshot_out.numel()
        records = job.records if job.snapshot is None or job.snapshot_read else []
        views = [memoryview(out[i * self.page_bytes:(i + 1) * self.page_bytes]) for i in range(len(records))]
        if self._readers is not None and len(records) > 1:
            failures = list(self._readers.map(self._fetch_one, records, views))
        else:  # one page, or no reader threads (synchronous): pages after a gap need not be read
            failures = []
            for record, view in zip(records, views):
                failures.append(self._fetch_one(record, view))
                if failures[-1] is not None:
                    break
        for record, failure in zip(records, failures):
            if failure is not None:
                self._count_missing(record, failure)
        n = next((i for i, failure in enumerate(failures) if failure is not None), len(failures))
        self.stats.pages_read += n
        self.stats.bytes_read += n * self.page_bytes
        job.pages_read = n
        with self._lock:
            if self._reads and self._reads[0] is job:
                self._reads.popleft()
            else:
                self._reads.remove(job)
            job.done = True
            self._done.append(job)
        if self.on_event is not None:
            self.on_event("read", job, True)

    def _read_one(self, record: PageRecord, view: memoryview) -> bool:
        """Read one record into view; False: it could not be had (dropped and counted)."""
        failure = self._fetch_one(record, view)
        if failure is not None:
            self._count_missing(record, failure)
        return failure is None

    def _fetch_one(self, record: PageRecord, view: memoryview) -> Optional[PageMissing]:
        """Read one record into view (from the write queue when it is still there); what went wrong
        (None: read and checked). Runs on a reader thread: counts nothing."""
        with self._lock:
            queued = self._writes.get(record.key)
        if queued is not None and list(queued[0].tokens) == list(record.tokens) and queued[0].parent == record.parent \
                and queued[0].kind == record.kind and queued[1].numel() == view.nbytes:
            view[:] = memoryview(queued[1].numpy())
            return None
        try:
            self.backend.get_into(record, view)
        except PageMissing as e:
            return e
        return None

    def _count_missing(self, record: PageRecord, e: PageMissing) -> None:
        if self._loss_counts(record.key):
            self.count_loss(e.reason)
        logger.warning("storage tier: %s %016x dropped: %s; its tokens are computed", record.kind, record.key, e)
        self.backend.remove(record.key)
        self._forget([record.key], e.reason)

    def _loss_counts(self, key: int) -> bool:
        """Whether a page this store failed to read counts in its stats (under tensor parallelism:
        once per page, whichever rank found it gone first)."""
        return True

    def count_loss(self, reason: str) -> None:
        """Count a page dropped because a read found it "missing", "corrupt", or failed ("error")."""
        if reason == "missing":
            self.stats.missing_pages += 1
        elif reason == "corrupt":
            self.stats.corrupt_pages += 1
        else:
            self.stats.read_errors += 1
