"""The storage tier's store: the engine's side of a set of pages on a backend.

The engine thread only queues, and never waits for the disk: `write` copies a page (its bytes
already out of the host tier, whose slots are reused at once) into the write buffer shared with
the tier's I/O process (io_process.py, which does the I/O: page_io.py), `new_read` and `read` ask
for a run of pages into the read buffer, `finished` takes the reads that are done, `release` gives
a read's buffer back once its pages are in the host tier. What the I/O process did comes back as
events, handled here on a thread of their own.

Nothing blocks the step: a write buffer holding `max_pending_bytes` of queued pages drops the new
page (counted), a full disk drops the page that did not fit (counted), a read that fails ends its
run there (the pages after a gap are no prefix of anything: the request computes them), a read
buffer with no room for a read leaves the request waiting for the reads before it.

A hybrid model's state snapshots are records of a second kind (page_files.py) and of another size:
a read of pages may carry the snapshot at their end (`ReadJob.snapshot`), read first (without it
the pages resume nobody, and are not read).

Under tensor parallelism each rank has a store of its own shard of every page, and rank 0's store
(storage_shards.ShardedStore) counts a page as stored only once every rank reported it written:
the stores tell what became of each page and read through `on_event`, from the events' thread.

`synchronous=True` does the I/O at the call instead, in this process (the scheduler simulator,
whose steps take no real time); completion is still observed through `finished`, so the caller's
path is the same.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.stores.io_process import IOProcess
from radixserve.cache.stores.page_files import PageBackend, PageRecord, StoreStamp
from radixserve.cache.stores.page_io import Event, PageIO
from radixserve.cache.stores.shared_buffer import ALIGN, Regions

logger = logging.getLogger("radixserve")

# The read buffer's size unless the owner gives one: what the reads in flight hold beside the pages
# they read into the host tier (a hybrid's snapshots; a caller's own buffers, through it). Its
# memory is taken at start-up.
READ_BUFFER_BYTES = 64 << 20
# Pages copied into the write buffer at once (torch's copies let go of the interpreter lock).
COPY_THREADS = 4


@dataclass
class StoreStats:
    pages_written: int = 0
    bytes_written: int = 0
    pages_read: int = 0
    bytes_read: int = 0
    write_drops_queue: int = 0  # the write buffer was full: the page was not kept
    write_drops_full: int = 0  # the disk had no room (ENOSPC), or one page is larger than storage_size
    write_errors: int = 0  # any other OSError on write
    evicted_pages: int = 0  # dropped for room (storage_size reached)
    missing_pages: int = 0  # a read found its file gone
    corrupt_pages: int = 0  # a read found another page, other tokens or a bad checksum (the file is removed)
    read_errors: int = 0


@dataclass
class ReadJob:
    """A run of consecutive pages to read: into host tier slots (`host_slots`: page_size of them a
    page, each page's consecutive), where the I/O process puts them directly, or into a buffer of
    the caller's own (`out`, page i at i * page_bytes)."""
    job_id: int
    records: list[PageRecord]
    out: Optional[torch.Tensor] = None
    host_slots: Optional[torch.Tensor] = None
    pages_read: int = 0  # set when done: the leading pages that were read and checked
    done: bool = False
    payload: dict = field(default_factory=dict)  # the caller's (what to do with the pages)
    # A hybrid's: the state snapshot at the last page's end, read into snapshot_out before the pages.
    snapshot: Optional[PageRecord] = None
    snapshot_out: Optional[torch.Tensor] = None
    snapshot_read: bool = False  # set when done: it was read and checked


# What a store tells its owner, from the events' thread (never while it holds its lock): ("written",
# key, kept) after a write was tried, ("lost", key, why) once a key is dropped (why: "evicted" for
# room, or a read's "missing", "corrupt" or "error"), ("read", job, True) once a read is done.
StoreEvent = Callable[[str, Any, Any], None]


@dataclass
class _Reading:
    job: ReadJob
    lent: list[int] = field(default_factory=list)  # read-buffer offsets lent to the job (back at release)
    # (offset, the caller's tensor, bytes per page or 0 for a snapshot): filled from there when done
    copies: list[tuple[int, torch.Tensor, int]] = field(default_factory=list)


class DiskStore:
    def __init__(self, backend: PageBackend, stamp: StoreStamp, *, synchronous: bool = False,
                 max_pending_bytes: int = 1 << 30, read_buffer_bytes: int = READ_BUFFER_BYTES,
                 host_pool: Optional[HostKVPool] = None, on_event: Optional[StoreEvent] = None):
        self.backend = backend
        # The host tier's pool, whose slots reads go straight into (shared with the I/O process).
        self.host_pool = host_pool
        self.on_event = on_event
        # The read job whose pages the tier is putting into the host tier (tensor parallelism: the
        # other ranks put theirs into the same slots).
        self.attaching: Optional[int] = None
        self.stamp = stamp
        self.page_bytes = stamp.page_bytes
        self.synchronous = synchronous
        self.max_pending_bytes = max(max_pending_bytes, self.page_bytes)
        self.stats = StoreStats()
        self._lock = threading.Condition()
        self._writes: dict[int, tuple[Optional[int], int]] = {}  # key -> (write-buffer offset, bytes)
        self.pending_bytes = 0
        self._reads: dict[int, _Reading] = {}
        self._done: deque[ReadJob] = deque()
        self._closed = False
        self._failed = False  # the I/O process ended by itself: nothing is read or written any more
        self._process: Optional[IOProcess] = None
        self._inline: Optional[PageIO] = None
        self._unsent: list[tuple[PageRecord, torch.Tensor, int, int]] = []  # written, not yet copied and sent
        self._copiers: Optional[ThreadPoolExecutor] = None
        self._write_regions = self._read_regions = None
        if synchronous:
            self._inline = PageIO(backend, self._on_events, lambda handle, nbytes: handle, threaded=False)
            keys, self.namespace, self.used_bytes = self._inline.open(stamp)
            self.read_buffer_bytes = 1 << 62
        else:
            host_buffer = host_pool.shared_buffer if host_pool is not None else None
            assert host_pool is None or host_buffer is not None, "the host pool is not shared with the I/O process"
            self._process = IOProcess(backend, stamp, write_bytes=self.max_pending_bytes,
                                      read_bytes=max(read_buffer_bytes, self.page_bytes) + ALIGN,
                                      host_buffer=host_buffer, on_events=self._on_events, on_exit=self._io_ended)
            keys, self.namespace, self.used_bytes = self._process.keys, self._process.namespace, self._process.used_bytes
            self._write_view = torch.frombuffer(self._process.write_buffer.map, dtype=torch.uint8)
            self._read_view = torch.frombuffer(self._process.read_buffer.map, dtype=torch.uint8)
            self._write_regions = Regions(self._process.write_buffer.nbytes)
            self._copiers = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="storage-copy")
            self._read_regions = Regions(self._process.read_buffer.nbytes)
            self.read_buffer_bytes = self._read_regions.capacity - ALIGN  # what one buffer may take
        # Every key on the backend or queued for it; the events remove what the I/O process drops.
        self._keys: set[int] = set(keys)
        self.restored_pages = len(self._keys)

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
    def placed_state(self, host_slot: int) -> None:
        """The tier put read job `attaching`'s snapshot into host snapshot slot host_slot."""

    def _listed(self, every: Optional[list[int]]) -> None:
        """A shared backend was listed again: `every`, the keys every watched namespace holds too."""

    @property
    def num_pages(self) -> int:
        return len(self._keys)

    def write(self, record: PageRecord, payload: torch.Tensor, *, wait: bool = False,
              source: Optional[tuple[str, Any]] = None) -> bool:
        """Queue a page (uint8, page_bytes; a snapshot record: its state's bytes); False: not kept.
        Its bytes are copied at the next `flush`, which the caller makes before payload's memory
        is reused. wait: for room in a full write buffer (at shutdown) instead of dropping the
        page. source: where the bytes came from ("host" or "device" KV slots, "host_state" or
        "device_state" a snapshot slot), for the other tensor-parallel ranks to copy theirs."""
        size = payload.numel()
        with self._lock:
            if record.key in self._keys:
                return True
            if self._failed:
                return False
            offset = self._write_regions.alloc(size) if self._write_regions is not None else None
        if offset is None and self._write_regions is not None:
            if wait:
                self.flush()  # what is queued must be sent to make room
                with self._lock:
                    offset = self._write_regions.alloc(size)
                    while offset is None and self._writes and not self._failed:
                        self._lock.wait(0.1)
                        offset = self._write_regions.alloc(size)
            if offset is None:
                self.stats.write_drops_queue += 1
                return False
        with self._lock:
            self._keys.add(record.key)
            self._writes[record.key] = (offset, size)
            self.pending_bytes += size
        if offset is None:  # in this process: written at once
            self._submit(("put", record, memoryview(payload.contiguous().numpy()).cast("B"), size))
        else:
            self._unsent.append((record, payload, offset, size))
        return True

    def flush(self) -> None:
        """Copy the pages queued since the last flush into the write buffer, COPY_THREADS at once
        (the engine waits for these copies: its torch runs one thread), and hand them to the I/O
        process."""
        unsent, self._unsent = self._unsent, []
        if not unsent:
            return

        def copy(item: tuple) -> None:
            _, payload, offset, size = item
            self._write_view[offset:offset + size].copy_(payload.reshape(-1))

        if len(unsent) > 1:
            list(self._copiers.map(copy, unsent))
        else:
            copy(unsent[0])
        self._submit(("put_many", [(record, ("w", offset), size) for record, _, offset, size in unsent]))

    def new_read(self, job_id: int, records: list[PageRecord], host_slots: torch.Tensor, *,
                 snapshot: Optional[PageRecord] = None, snapshot_bytes: int = 0,
                 payload: Optional[dict] = None) -> Optional[ReadJob]:
        """A read of records into host_slots (and of snapshot into a buffer of the read buffer,
        given back by `release`; None: no room for it now, the reads in flight hold it)."""
        state = None
        if snapshot is not None:
            if self._read_regions is None:
                state = torch.empty(snapshot_bytes, dtype=torch.uint8)
            else:
                with self._lock:
                    at = self._read_regions.alloc(snapshot_bytes)
                if at is None:
                    return None
                state = self._read_view[at:at + snapshot_bytes]
        return ReadJob(job_id, records, host_slots=host_slots, payload=payload or {}, snapshot=snapshot,
                       snapshot_out=state)

    def read(self, job: ReadJob) -> None:
        """Read job's pages (into its host slots, or its `out`: through the read buffer) and snapshot."""
        self.flush()  # a page read may still be queued for writing: it is read from the queue
        reading = _Reading(job)
        with self._lock:
            pages = self._page_handles(job, reading)
            state = None
            if job.snapshot is not None:
                state = self._handle(job.snapshot_out, reading, 0)
            self._reads[job.job_id] = reading
        sent = pages is not None and (job.snapshot is None or state is not None) and not self._failed \
            and self._submit(("read", job.job_id, job.records, pages, job.snapshot, state,
                              job.snapshot_out.numel() if job.snapshot is not None else 0))
        if not sent:  # no room in the read buffer for a buffer of the caller's, or no I/O process
            self._on_events([("read", job.job_id, 0, False)])

    def _page_handles(self, job: ReadJob, reading: _Reading) -> Optional[list]:
        """Where each page of job goes, as the I/O side names it (None: no room)."""
        n, pb = len(job.records), self.page_bytes
        if job.host_slots is None:
            whole = self._handle(job.out[:n * pb], reading, pb)
            if whole is None:
                return None
            if self._process is None:
                return [whole[i * pb:(i + 1) * pb] for i in range(n)]
            return [("r", whole[1] + i * pb) for i in range(n)]
        at = [first * self.host_pool.bytes_per_token for first in self.host_pool.page_starts(job.host_slots)]
        if self._process is None:
            host = memoryview(self.host_pool.buffer.view(-1).numpy()).cast("B")
            return [host[a:a + pb] for a in at]
        return [("h", a) for a in at]

    def _handle(self, tensor: torch.Tensor, reading: _Reading, page_bytes: int) -> Any:
        """A buffer's name for the I/O side: the memory itself in this process; else its place in
        the read buffer (lent by new_read, or taken now and copied into tensor when done; None: no room)."""
        if self._process is None:
            return memoryview(tensor.numpy()).cast("B")
        at = tensor.data_ptr() - self._read_view.data_ptr()
        if 0 <= at < self._read_view.numel() and at in self._read_regions:
            reading.lent.append(at)
            return ("r", at)
        at = self._read_regions.alloc(tensor.numel())
        if at is None:
            return None
        reading.copies.append((at, tensor, page_bytes))
        return ("r", at)

    def release(self, job: ReadJob) -> None:
        """The tier is done with a finished read: its buffers go back to the read buffer."""
        with self._lock:
            reading = self._reads.pop(job.job_id, None)
            if reading is not None:
                for at in reading.lent:
                    self._read_regions.free(at)

    def discard(self, keys: list[int]) -> int:
        """Delete these pages from the backend (not counted as lost: nobody counted them); how many
        of them this store held. A page queued for writing is kept."""
        self.flush()
        with self._lock:
            held = [key for key in keys if key in self._keys and key not in self._writes]
            self._keys.difference_update(held)
        if held:
            self._submit(("remove", held))
        return len(held)

    def watch_namespaces(self, namespaces: list[str]) -> None:
        """A shared backend: list these namespaces too at each refresh (`_listed` gets the keys all hold)."""
        self._submit(("watch", namespaces))

    def finished(self) -> list[ReadJob]:
        with self._lock:
            done, self._done = list(self._done), deque()
        return done

    def close(self) -> None:
        """Finish the queued writes, save the index and let go of the directory (once)."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        if self._process is not None:
            self._process.close()
            self._copiers.shutdown()
        else:
            self._inline.command(("close",))

    def _submit(self, command: tuple) -> bool:
        if self._process is not None:
            return self._process.submit(command)
        self._inline.command(command)
        return True

    # ------------------------------------------------------------------ what the I/O process did
    def _on_events(self, events: list[Event]) -> None:
        for event in events:
            what = event[0]
            if what == "written":
                self._on_written(*event[1:])
            elif what == "lost":
                self._on_lost(*event[1:])
            elif what == "read":
                self._on_read_done(*event[1:])
            elif what == "listed":
                if event[1] is None:
                    logger.warning("storage tier: %s", event[2])
                    continue
                with self._lock:
                    self._keys.update(event[1])
                self._listed(event[2])
            elif what == "usage":
                self.used_bytes = event[1]
            elif what == "log":
                logger.log(event[1], "%s", event[2])

    def _on_written(self, key: int, kept: bool, why: str) -> None:
        with self._lock:
            offset, size = self._writes.pop(key, (None, 0))
            if offset is not None:
                self._write_regions.free(offset)
            self.pending_bytes -= size
            if kept:
                self.stats.pages_written += 1
                self.stats.bytes_written += size
            else:
                self._keys.discard(key)
                if why == "full":
                    self.stats.write_drops_full += 1
                else:
                    self.stats.write_errors += 1
            self._lock.notify_all()  # a writer waiting for room
        if not kept and why != "full":
            logger.warning("storage tier: a page write failed (%s); the page is not kept", why)
        if self.on_event is not None:
            self.on_event("written", key, kept)

    def _on_lost(self, key: int, why: str, message: str) -> None:
        if why == "evicted":
            self.stats.evicted_pages += 1
        else:
            if self._loss_counts(key):
                self.count_loss(why)
            logger.warning("storage tier: %s dropped; its tokens are computed", message)
        with self._lock:
            self._keys.discard(key)
        if self.on_event is not None:
            self.on_event("lost", key, why)

    def _on_read_done(self, job_id: int, pages: int, snapshot_read: bool) -> None:
        with self._lock:
            reading = self._reads.get(job_id)
            if reading is None:
                return
            job = reading.job
            for at, tensor, page_bytes in reading.copies:
                n = pages * page_bytes if page_bytes else tensor.numel()
                tensor[:n] = self._read_view[at:at + n]
                self._read_regions.free(at)
            reading.copies = []
            job.pages_read, job.snapshot_read = pages, snapshot_read
            self.stats.pages_read += pages
            self.stats.bytes_read += pages * self.page_bytes
            if snapshot_read:
                self.stats.bytes_read += job.snapshot_out.numel()
            job.done = True
            self._done.append(job)
        if self.on_event is not None:
            self.on_event("read", job, True)

    def _io_ended(self, why: str) -> None:
        """The I/O process ended by itself: the tier keeps serving without it (every request computes)."""
        logger.error("storage tier: its I/O process ended (%s): the tier reads and writes nothing more", why)
        with self._lock:
            self._failed = True
            lost, self._keys = list(self._keys), set()
            for offset, _ in self._writes.values():
                self._write_regions.free(offset)
            self._writes.clear()
            self._unsent = []
            self.pending_bytes = 0
            waiting = [job_id for job_id, reading in self._reads.items() if not reading.job.done]
            self._lock.notify_all()
        for job_id in waiting:
            self._on_read_done(job_id, 0, False)
        if self.on_event is not None:
            for key in lost:
                self.on_event("lost", key, "evicted")

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
