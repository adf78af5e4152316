"""The storage tier's I/O: pages written to and read from a backend, and what became of each.

`PageIO` does the work the engine must never wait for: it writes pages (a page still queued for
writing is read from the queue, so a prefix evicted a moment ago is found at once), reads runs of
pages READ_THREADS at a time (an NVMe drive reaches its bandwidth only with many requests in
flight, and the checksum of one page runs beside the read of the next), makes room, removes pages
and lists a shared backend's keys again from time to time. Reads go first: a read is what a
waiting request waits for, a write only keeps a page for later.

It runs in the storage tier's I/O process (io_process.py), away from the engine's interpreter lock:
each page read or written takes that lock several times between its system calls, and an engine
thread running Python holds it for up to the interpreter's switch interval each time, which cut
eight reader threads from 2.0 GB/s to 0.5 GB/s on tmpfs beside one busy thread. The engine hears
what happened through events, sent in batches:

    ("written", key, kept, why)       a write was tried (why, when not kept: "full" or the error)
    ("lost", key, why, message)       a page was dropped: "evicted" for room, or a read found it
                                      "missing", "corrupt" or failed ("error")
    ("read", job_id, pages, snapshot) a read finished: its leading pages read and checked, and
                                      whether its snapshot was
    ("listed", keys, every)           a shared backend's keys (every: those every watched
                                      namespace holds too; None when none is watched)
    ("usage", bytes)                  what the backend holds now
    ("log", level, message)           a line the backend logged (io_process.py sends it)

Buffers are named by handles the owner resolves (`buffer(handle, nbytes)`): offsets into the
shared buffers in the I/O process, the memory itself when `threaded=False` (the scheduler
simulator's store, whose steps take no real time: each command is done at the call).
This module imports no torch, so the I/O process starts in a moment.
"""

from __future__ import annotations

import errno
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from radixserve.cache.stores.page_files import READ_THREADS, PageBackend, PageMissing, PageRecord, StoreStamp

# Pages written between two saves of the backend's LRU index.
INDEX_SAVE_EVERY = 1024
# How often the keys of a backend other servers write to too are listed again (their new pages).
SHARED_REFRESH_S = 1.0
# Events held back before they are sent (sent at once whenever the queues run dry).
EVENT_BATCH = 64

Event = tuple
Buffer = Callable[[Any, int], memoryview]


class PageIO:
    def __init__(self, backend: PageBackend, send: Callable[[list[Event]], None], buffer: Buffer, *,
                 threaded: bool):
        self.backend = backend
        self.send = send
        self.buffer = buffer
        self.threaded = threaded
        self._lock = threading.Condition()
        self._writes: OrderedDict[int, tuple[PageRecord, Any, int]] = OrderedDict()  # key -> (record, handle, size)
        self._reads: deque[tuple] = deque()
        self._removals: list[int] = []
        self._watched: list[str] = []  # other namespaces of a shared backend (tensor parallelism's ranks)
        self._closed = False
        self._outbox: list[Event] = []
        self._since_index = 0
        self.page_bytes = 0  # the stamp's (set by open)
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="storage-read") if threaded else None

    def open(self, stamp: StoreStamp) -> tuple[list[int], str, int]:
        """(the keys the backend holds, least recently used first; its namespace; its bytes used)."""
        keys = self.backend.open(stamp)
        self.page_bytes = stamp.page_bytes
        namespace = getattr(self.backend, "namespace", "") if self.backend.shared else ""
        return keys, namespace, getattr(self.backend, "used_bytes", 0)

    # ------------------------------------------------------------------ commands
    def command(self, cmd: tuple) -> None:
        """One command from the store: ("put", record, handle, size), ("put_many", [(record, handle,
        size), ...]), ("read", job_id, records,
        page handles (one a record), snapshot, snapshot_handle, snapshot_size), ("remove", keys),
        ("watch", namespaces), ("close",)."""
        what = cmd[0]
        if what == "put_many":  # one put each
            for put in cmd[1]:
                self.command(("put", *put))
            return
        if not self.threaded:
            if what == "put":
                self._write(*cmd[1:])
            elif what == "read":
                self._do_read(cmd[1:])
            elif what == "remove":
                for key in cmd[1]:
                    self.backend.remove(key)
            elif what == "close":
                self.backend.close()
            self._flush()
            return
        with self._lock:
            if what == "put":
                self._writes[cmd[1].key] = cmd[1:]
            elif what == "read":
                self._reads.append(cmd[1:])
            elif what == "remove":
                self._removals.extend(cmd[1])
            elif what == "watch":
                self._watched = list(cmd[1])
            elif what == "close":
                self._closed = True
            self._lock.notify()

    # ------------------------------------------------------------------ the I/O loop (threaded)
    def run(self) -> None:
        """Until closed: removals, then reads, then writes; finishes the queued writes before it returns."""
        refreshed = time.monotonic()
        while True:
            if self.backend.shared and time.monotonic() - refreshed >= SHARED_REFRESH_S:
                refreshed = time.monotonic()
                self._refresh_keys()
            with self._lock:
                if not (self._reads or self._writes or self._removals or self._closed):
                    self._flush()
                while not (self._reads or self._writes or self._removals or self._closed):
                    if not self._lock.wait(SHARED_REFRESH_S if self.backend.shared else None):
                        break  # time to list the shared backend's keys again
                removals, self._removals = self._removals, []
                job = self._reads.popleft() if self._reads else None
                write = None if job is not None or not self._writes else next(iter(self._writes.values()))
                if job is None and write is None and not removals and self._closed:
                    break
            for key in removals:
                self.backend.remove(key)
            if job is not None:
                self._do_read(job)
            elif write is not None:
                self._write(*write)
        self._readers.shutdown()
        self._save_index()
        self.backend.close()
        self._flush()

    def _emit(self, event: Event) -> None:
        self._outbox.append(event)
        if len(self._outbox) >= EVENT_BATCH:
            self._flush()

    def _flush(self) -> None:
        if self._outbox:
            self._outbox.append(("usage", getattr(self.backend, "used_bytes", 0)))
            events, self._outbox = self._outbox, []
            self.send(events)

    def _refresh_keys(self) -> None:
        try:
            keys = self.backend.list_keys()
            every = None
            if self._watched:
                every = set(keys)
                for namespace in self._watched:
                    every.intersection_update(self.backend.list_keys(namespace))
        except Exception as e:  # noqa: BLE001: the pages already known stay usable
            self._emit(("listed", None, f"could not list the shared store's pages ({e})"))
            return
        self._emit(("listed", keys, None if every is None else sorted(every)))

    # ------------------------------------------------------------------ writes
    def _write(self, record: PageRecord, handle: Any, size: int) -> None:
        kept, why = False, ""
        try:
            for key in self.backend.make_room(size):
                self._emit(("lost", key, "evicted", "for room"))
            self.backend.put(record, self.buffer(handle, size))
            kept = True
        except OSError as e:
            why = "full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else str(e)
        with self._lock:
            self._writes.pop(record.key, None)
        self._emit(("written", record.key, kept, why))
        self._since_index += 1
        if self._since_index >= INDEX_SAVE_EVERY:
            self._save_index()

    def _save_index(self) -> None:
        self._since_index = 0
        if hasattr(self.backend, "save_index"):
            try:
                self.backend.save_index()
            except OSError:
                pass  # the next start scans the directory instead

    # ------------------------------------------------------------------ reads
    def _do_read(self, job: tuple) -> None:
        job_id, records, pages, snapshot, snapshot_handle, snapshot_size = job
        snapshot_read = False
        if snapshot is not None:
            snapshot_read = self._read_one(snapshot, self.buffer(snapshot_handle, snapshot_size))
            if not snapshot_read:
                records = []  # without it the pages resume nobody
        views = [self.buffer(handle, self.page_bytes) for handle in pages[:len(records)]]
        if self._readers is not None and len(records) > 1:
            failures = list(self._readers.map(self._fetch_one, records, views))
        else:  # one page, or no reader threads: pages after a gap need not be read
            failures = []
            for record, view in zip(records, views):
                failures.append(self._fetch_one(record, view))
                if failures[-1] is not None:
                    break
        for record, failure in zip(records, failures):
            if failure is not None:
                self._lose(record, failure)
        pages = next((i for i, failure in enumerate(failures) if failure is not None), len(failures))
        self._emit(("read", job_id, pages, snapshot_read))
        self._flush()  # a request waits for it

    def _read_one(self, record: PageRecord, view: memoryview) -> bool:
        failure = self._fetch_one(record, view)
        if failure is not None:
            self._lose(record, failure)
        return failure is None

    def _fetch_one(self, record: PageRecord, view: memoryview) -> Optional[PageMissing]:
        """Read one record into view (from the write queue when it is still there); what went wrong
        (None: read and checked)."""
        with self._lock:
            queued = self._writes.get(record.key)
        if queued is not None and queued[2] == view.nbytes and list(queued[0].tokens) == list(record.tokens) \
                and queued[0].parent == record.parent and queued[0].kind == record.kind:
            view[:] = self.buffer(queued[1], queued[2])
            return None
        try:
            self.backend.get_into(record, view)
        except PageMissing as e:
            return e
        return None

    def _lose(self, record: PageRecord, e: PageMissing) -> None:
        self.backend.remove(record.key)
        self._emit(("lost", record.key, e.reason, f"{record.kind} {record.key:016x}: {e}"))
