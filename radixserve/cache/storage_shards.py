"""The storage tier under tensor parallelism: every rank stores and reads its own shard of each page.

A page's KV under tp N is N shards, one per rank (its KV heads; a hybrid's snapshot likewise its
share of the recurrent states), each in that rank's store: a directory of its own,
`<storage_dir>/tp<N>-rank<r>`, whose stamp names the tp size and the rank (stores/page_files.py).
Rank 0 alone decides, as for the host tier: its tier (disk_tier.py) picks what to save, what to
read and where the pages go in the host tier, and its store (`ShardedStore`) records each decision
into the copy log (cache/copy_log.py), which the other ranks replay in rank 0's order
(`StorageReplica`): a rank writes its shard of a page from the same host (or, at shutdown, device)
slots, reads its shard of the same pages, and puts them into the same host slots.

Each rank's store does its own I/O off the step, and may fail on its own (a full disk, a page
evicted for room, a corrupt file). So a page counts as stored only when every rank said so: the
other ranks report what became of each write and read (`Report`, over a channel rank 0 polls), and
rank 0 counts a page as on disk (`has`, what its lookups ask) once every rank reported it written
in the same round; a failed write or a lost page on any rank drops it (a later save writes it
again). A read is done when every rank's read is; it counts the pages every rank read (the fewest),
so rank 0 never attaches a page another rank lacks. At start-up the ranks tell rank 0 the pages
they found: a page counts only when every shard is there. The shards of the others (a crash
mid-write, a full disk on one rank) would stay on disk outside the accounting for good, so each
rank deletes them: rank 0 its own at once, the others when rank 0's list of them reaches them in
the copy log (with the first step), the log being the one channel from rank 0 to the ranks' stores.
Not on a shared backend: there another worker may be writing the missing shard right now.

Rounds: each save of a page is numbered (`wseq`), and each report carries the round it answers,
so a late report of an earlier round (a page lost, then saved again) never counts for the next. A
read that found a shard gone is the exception: the shard is not there now, whatever round wrote it,
so the page is dropped (and counted once, in rank 0's counters, whichever rank found it first).

A shared backend (Redis, stores/redis_pages.py) holds each rank's shards under that rank's own
namespace (its stamp names the tp size and the rank), and other workers of the same settings write
into the same namespaces: their pages appear over time. Rank 0 learns them by listing, on each of
its periodic refreshes, its own namespace and every other rank's (the ranks tell rank 0 their
namespace with their start-up key list), and counts a page that every namespace holds. Rank 0
reads the other namespaces itself rather than hearing each rank's refreshed list: the server every
rank reaches is already the one truth about which shards exist, so this needs no new report, no
per-rank lists kept on rank 0 and no agreement on when each rank listed; a full list a second
from every rank would also cost the report channel as much as the store holds keys. A shard Redis
evicted on one rank after rank 0 counted the page shows up when that rank's read of it fails: the
read counts the pages every rank read, and the rank's "lost" report drops the page.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional, Protocol

import torch

from radixserve.cache.copy_log import CopyKind, CopyLog, CopyOrder, slot_array
from radixserve.cache.disk_snapshots import fill_state, state_bytes
from radixserve.cache.disk_tier import device_rows
from radixserve.cache.host_pool import CopyEngine, HostKVPool
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.state_snapshots import StateSnapshots
from radixserve.cache.stores.disk import READ_BUFFER_BYTES, DiskStore, ReadJob
from radixserve.cache.stores.page_files import PageBackend, PageRecord, StoreStamp

logger = logging.getLogger("radixserve")

# How long rank 0 waits at start-up for every rank's list of the pages it found.
KEYS_WAIT_S = 300.0

# A report from a rank other than 0: ("keys", rank, [key, ...], namespace) at start-up (namespace: a
# shared backend's, else ""); ("written", rank, key, wseq, kept); ("lost", rank, key, wseq, why)
# (why: "evicted", or what a read found: "missing", "corrupt", "error"); ("read", rank, job id,
# pages read, snapshot read).
Report = tuple

_STORE_KINDS = {"host": CopyKind.STORE_HOST_PAGE, "device": CopyKind.STORE_DEVICE_PAGE,
                "host_state": CopyKind.STORE_HOST_STATE, "device_state": CopyKind.STORE_DEVICE_STATE}


class ReportInbox(Protocol):
    """Rank 0's end of the reports channel (engine/storage_reports.py)."""

    def poll(self) -> list[Report]:
        """The reports that arrived, without waiting."""

    def wait(self, timeout_s: float) -> Optional[Report]:
        """The next report, waiting up to timeout_s (None: none came)."""


def _slots(slots: Any) -> Any:
    return slot_array(slots.tolist() if isinstance(slots, torch.Tensor) else [slots])


class ShardedStore(DiskStore):
    """Rank 0's store under tp N: its own shard of every page, and which pages every rank holds."""

    def __init__(self, backend: PageBackend, stamp: StoreStamp, *, tp_size: int, inbox: ReportInbox,
                 log: Optional[CopyLog], max_pending_bytes: int = 1 << 30, keys_wait_s: float = KEYS_WAIT_S,
                 read_buffer_bytes: int = READ_BUFFER_BYTES, host_pool: Optional[HostKVPool] = None):
        self.tp_size = tp_size
        self.inbox = inbox
        self._log: Optional[CopyLog] = None
        self._orphans: list[int] = []  # pages found on some ranks only, for the others to discard
        self.log = log  # rank 0's copy log (set by its runner once built)
        self._agg = threading.Lock()  # the rounds below: the engine thread's and the store's events thread's
        self._wseq = 0
        self._round: dict[int, int] = {}  # key -> the round of its last save (0: found at start-up)
        self._waiting: dict[int, set[int]] = {}  # key -> the ranks yet to report it written in that round
        self._confirmed: set[int] = set()  # every rank holds it
        self._read_reports: dict[int, dict[int, tuple[int, bool]]] = {}  # job id -> rank -> (pages, snapshot)
        self._own_reads: dict[int, ReadJob] = {}
        self._early: list[Report] = []
        # A shared backend's namespace of each other rank (None until the ranks said theirs).
        self._namespaces: Optional[dict[int, str]] = None
        super().__init__(backend, stamp, max_pending_bytes=max_pending_bytes, read_buffer_bytes=read_buffer_bytes,
                         host_pool=host_pool, on_event=self._own_event)
        self._agree_on_found(keys_wait_s)

    # ------------------------------------------------------------------ start-up
    def _agree_on_found(self, wait_s: float) -> None:
        """A page found at start-up counts only when every rank found its shard."""
        with self._lock:
            found = set(self._keys)
        lists: dict[int, list[int]] = {}
        namespaces: dict[int, str] = {}
        deadline = time.monotonic() + wait_s
        while len(lists) < self.tp_size - 1:
            report = self.inbox.wait(max(0.0, deadline - time.monotonic()))
            if report is None:
                raise RuntimeError(f"storage tier: {self.tp_size - 1 - len(lists)} tensor-parallel rank(s) did not "
                                   f"say which pages they found within {wait_s:.0f} s")
            if report[0] == "keys":
                lists[report[1]] = report[2]
                namespaces[report[1]] = report[3] if len(report) > 3 else ""
            else:
                self._early.append(report)
        every = set(found)
        for keys in lists.values():
            every &= set(keys)
        partial = len(found | set().union(*lists.values())) - len(every) if lists else 0
        with self._agg:
            self._confirmed = every
            self._round = dict.fromkeys(every, 0)
        self.restored_pages = len(every)
        if self.backend.shared:
            self._namespaces = namespaces
            self.watch_namespaces(list(namespaces.values()))  # its refreshes list every rank's namespace
        if partial:
            logger.warning("storage tier: %d pages found on some tensor-parallel ranks but not on all %d are not "
                           "read (a rank's shard is missing: a crash or an eviction on that rank); they are "
                           "written again when saved%s", partial, self.tp_size,
                           "" if self.backend.shared else "; the shards there are removed")
        if partial and not self.backend.shared:
            removed = self.discard(sorted(found - every))
            self._orphans = sorted(set().union(*lists.values()) - every)
            logger.info("storage tier: removed %d shards of pages not every rank holds (rank 0's)", removed)
            self._send_orphans()

    @property
    def log(self) -> Optional[CopyLog]:
        return self._log

    @log.setter
    def log(self, log: Optional[CopyLog]) -> None:
        self._log = log  # rank 0's runner sets it once built
        self._send_orphans()

    def _send_orphans(self) -> None:
        if self._orphans and self._log is not None:
            self._log.record(CopyKind.STORAGE_DISCARD, slot_array(()), slot_array(()), 0, self._orphans)
            self._orphans = []

    def _listed(self, every: Optional[list[int]]) -> None:
        """A shared backend's pages other workers wrote: counted once every rank's namespace holds them."""
        if every is None:
            return
        with self._agg:
            for key in set(every).difference(self._round):
                self._round[key] = 0
                self._confirmed.add(key)

    # ------------------------------------------------------------------ lookups
    def __contains__(self, key: int) -> bool:
        with self._agg:
            return key in self._round

    def has(self, key: int) -> bool:
        return key in self._confirmed

    @property
    def num_pages(self) -> int:
        return len(self._confirmed)

    # ------------------------------------------------------------------ saves
    def write(self, record: PageRecord, payload: torch.Tensor, *, wait: bool = False,
              source: Optional[tuple[str, Any]] = None) -> bool:
        """Start a round for the page: every rank writes its shard (this one now, the others from
        the copy log); it counts once all reported it written."""
        assert source is not None, "a page saved under tensor parallelism needs the slots it came from"
        key = record.key
        with self._agg:
            if key in self._round:
                return True
            self._wseq += 1
            wseq = self._wseq
            self._round[key] = wseq
            self._waiting[key] = set(range(self.tp_size))
        # This rank's shard: already here from an earlier round that another rank failed (its event
        # then counts for this round when it is still queued), else queued now.
        status = self.status(key)
        if status == "stored":
            self._written(0, key, wseq, True)
        elif status == "absent" and not super().write(record, payload, wait=wait):
            self._drop(key, wseq)
            return False
        kind, slots = source
        self.log.record(_STORE_KINDS[kind], _slots(slots), slot_array(()), wseq, (record, wait))
        return True

    def _written(self, rank: int, key: int, wseq: int, kept: bool) -> None:
        with self._agg:
            if self._round.get(key) != wseq:
                return  # a report of an earlier round
            if not kept:
                self._drop_locked(key)
                return
            waiting = self._waiting.get(key)
            if waiting is None:
                return
            waiting.discard(rank)
            if not waiting:
                del self._waiting[key]
                self._confirmed.add(key)

    def _drop(self, key: int, wseq: Optional[int] = None) -> bool:
        """Stop counting the page (only its round wseq's, when given); whether it was counted."""
        with self._agg:
            if wseq is None or self._round.get(key) == wseq:
                return self._drop_locked(key)
        return False

    def _drop_locked(self, key: int) -> bool:
        self._waiting.pop(key, None)
        self._confirmed.discard(key)
        return self._round.pop(key, None) is not None

    def _loss_counts(self, key: int) -> bool:
        return self._drop(key)  # a page another rank's report dropped is counted already

    def _own_event(self, what: str, subject: Any, kept: bool) -> None:
        """This rank's store's events (from its events thread)."""
        if what == "written":
            with self._agg:
                wseq = self._round.get(subject)
            if wseq is not None:
                self._written(0, subject, wseq, kept)
        elif what == "lost":
            self._drop(subject)

    # ------------------------------------------------------------------ reads
    def read(self, job: ReadJob) -> None:
        self.log.record(CopyKind.STORAGE_READ, slot_array(()), _slots(job.host_slots), job.job_id,
                        (job.records, job.snapshot))
        self._read_reports[job.job_id] = {}
        super().read(job)

    def finished(self) -> list[ReadJob]:
        """The reads every rank finished, each counting the pages every rank read."""
        self._take_reports()
        for job in super().finished():
            self._own_reads[job.job_id] = job
        done = []
        for job_id, job in list(self._own_reads.items()):
            others = self._read_reports.get(job_id, {})
            if len(others) < self.tp_size - 1:
                continue
            for pages, snapshot in others.values():
                job.pages_read = min(job.pages_read, pages)
                job.snapshot_read = job.snapshot_read and snapshot
            del self._own_reads[job_id], self._read_reports[job_id]
            done.append(job)
        return done

    def placed_state(self, host_slot: int) -> None:
        assert self.attaching is not None
        self.log.record(CopyKind.STORAGE_ATTACH_STATE, slot_array(()), slot_array([host_slot]), self.attaching)

    def release(self, job: ReadJob) -> None:
        self.log.record(CopyKind.STORAGE_RELEASE, slot_array(()), slot_array(()), job.job_id)
        super().release(job)

    # ------------------------------------------------------------------ the other ranks' reports
    def _take_reports(self) -> None:
        reports, self._early = self._early + self.inbox.poll(), []
        for report in reports:
            what = report[0]
            if what == "written":
                _, rank, key, wseq, kept = report
                self._written(rank, key, wseq, kept)
            elif what == "lost":
                _, rank, key, wseq, why = report
                if why == "evicted":  # for room, in that round: a later round wrote it again
                    self._drop(key, wseq)
                elif self._drop(key):  # a read found it gone: whatever round wrote it
                    self.count_loss(why)
            elif what == "read":
                _, rank, job_id, pages, snapshot = report
                if job_id in self._read_reports:
                    self._read_reports[job_id][rank] = (pages, snapshot)
            else:
                logger.warning("storage tier: an unexpected report from a tensor-parallel rank: %r", report[:2])


class StorageReplica:
    """A rank other than 0: its shard of the store, and rank 0's storage orders replayed on it."""

    def __init__(self, store: DiskStore, rank: int, report: Callable[[Report], None], kv_pool: KVPool,
                 host_pool: HostKVPool, copier: CopyEngine, snapshots: Optional[StateSnapshots] = None):
        self.store = store
        self.rank = rank
        self.report = report
        self.kv_pool = kv_pool
        self.host_pool = host_pool
        self.copier = copier
        self.snapshots = snapshots  # a hybrid's device snapshot pool (its .host: the host tier's)
        self.page_bytes = store.page_bytes
        self._latest: dict[int, int] = {}  # key -> the round rank 0 last asked it for (0: found at start-up)
        self._jobs: dict[int, ReadJob] = {}
        store.on_event = self._event
        with store._lock:
            found = list(store._keys)
        self._latest.update(dict.fromkeys(found, 0))
        report(("keys", rank, found, store.namespace))

    def _event(self, what: str, subject: Any, kept: bool) -> None:
        if what == "written":
            wseq = self._latest.get(subject) if kept else self._latest.pop(subject, None)
            if wseq is not None:
                self.report(("written", self.rank, subject, wseq, kept))
        elif what == "lost":
            # 0: a page rank 0 may count without having asked this rank for it (found at start-up, or
            # another worker's on a shared backend).
            self.report(("lost", self.rank, subject, self._latest.pop(subject, 0), kept))
        elif what == "read":
            self.report(("read", self.rank, subject.job_id, subject.pages_read, subject.snapshot_read))

    # ------------------------------------------------------------------ rank 0's orders
    def replay(self, order: CopyOrder) -> None:
        kind = order.kind
        if kind in (CopyKind.STORE_HOST_PAGE, CopyKind.STORE_DEVICE_PAGE, CopyKind.STORE_HOST_STATE,
                    CopyKind.STORE_DEVICE_STATE):
            self._store(order)
        elif kind is CopyKind.STORAGE_READ:
            records, snapshot = order.payload
            assert snapshot is None or self.snapshots is not None, "rank 0 sent a snapshot read to a rank without snapshots"
            self.copier.drain()  # a load of this rank's may still read the slots' old bytes
            job = self.store.new_read(order.seq, records, torch.frombuffer(order.dst, dtype=torch.int64),
                                      snapshot=snapshot,
                                      snapshot_bytes=self.snapshots.bytes_per_slot if snapshot is not None else 0)
            if job is None:  # rank 0's read buffer had room, this rank's not: this rank reads nothing
                self.report(("read", self.rank, order.seq, 0, False))
                return
            self._jobs[order.seq] = job
            self.store.read(job)
        elif kind is CopyKind.STORAGE_ATTACH_STATE:
            job = self._done_job(order.seq)
            host = self._host_states()
            _sync(self.snapshots)
            fill_state(host.conv, host.ssm, order.dst[0], job.snapshot_out)
        elif kind is CopyKind.STORAGE_RELEASE:
            job = self._jobs.pop(order.seq, None)
            if job is not None:
                self.store.release(job)
            self.store.finished()  # nobody waits on this rank's list of finished reads
        elif kind is CopyKind.STORAGE_DISCARD:
            for key in order.payload:
                self._latest.pop(key, None)
            removed = self.store.discard(order.payload)
            logger.info("storage tier: removed %d shards of pages not every rank holds (rank %d's)", removed,
                        self.rank)
        else:
            raise RuntimeError(f"rank 0 sent a {kind.value} order to the storage tier")

    def _done_job(self, job_id: int) -> ReadJob:
        job = self._jobs[job_id]
        if not job.done:  # rank 0 heard this rank's read done before it attached: it is
            raise RuntimeError(f"rank 0 attached storage read {job_id} before this rank's read finished")
        return job

    def _host_states(self):
        host = self.snapshots.host if self.snapshots is not None else None
        if host is None:
            raise RuntimeError("rank 0 sent a snapshot order to a rank without host snapshots")
        return host

    def _store(self, order: CopyOrder) -> None:
        record, wait = order.payload
        wseq = order.seq
        kind = order.kind
        if kind is CopyKind.STORE_HOST_PAGE:
            self.copier.drain()  # its write-back (rank 0 saw its own done) may still be on the way here
            data = self.host_pool.buffer[torch.frombuffer(order.src, dtype=torch.int64)].reshape(-1).clone()
        elif kind is CopyKind.STORE_DEVICE_PAGE:
            data = device_rows(self.kv_pool, torch.frombuffer(order.src, dtype=torch.int64)).reshape(-1)
        elif kind is CopyKind.STORE_HOST_STATE:
            host = self._host_states()
            _sync(self.snapshots)
            data = state_bytes(host.conv, host.ssm, order.src[0])
        else:
            assert self.snapshots is not None
            _sync(self.snapshots)  # a load into the slot may still be on the copy stream
            data = state_bytes(self.snapshots.conv, self.snapshots.ssm, order.src[0])
        key = record.key
        self._latest[key] = wseq
        status = self.store.status(key)
        if status == "stored":
            self.report(("written", self.rank, key, wseq, True))
        elif status == "absent" and not self.store.write(record, data, wait=wait):
            self._latest.pop(key, None)
            self.report(("written", self.rank, key, wseq, False))  # the write queue was full
        self.store.flush()

    def close(self) -> None:
        self.store.close()


def _sync(snapshots: Optional[StateSnapshots]) -> None:
    """Wait for the snapshot copies queued so far, on the compute and the copy stream (CUDA)."""
    if snapshots is not None:
        snapshots.sync()
