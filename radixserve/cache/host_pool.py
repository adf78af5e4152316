"""The host tier's KV memory and the copies between it and the device pool.

Layout: one byte buffer `[host slot, layer, k|v, bytes of one token's heads]`, token-major, so a
run of consecutive host slots holds every layer of those tokens in one contiguous block and a load
of a run is a single host-to-device copy (page-batched, all layers at once). Bytes, not the device
pool's dtype: any KV dtype (fp8 included) moves unchanged, and the host tier holds exactly the
device pool's bytes (moved as 8-byte words where a row allows it).

Copies complete in the order they are issued (one copy stream on CUDA), so a copy is named by its
sequence number and "done" is one counter (`CopyEngine.done_seq`). A load: the copy stream waits
for the work already launched on the compute stream (the destination slots may have been freed by
it just now), copies runs of host slots into a device staging buffer and scatters it into each
layer. A write-back: the compute stream gathers the evicted slots into a staging buffer (so the
slots can be reused by the very next step), and the copy stream moves it to the host. On the CPU
(the test suite's "device") the copies run synchronously, but their completion is still observed
only by `poll`, so the scheduler's issued -> done path is the same.

A hybrid model's recurrent-state snapshots between the tiers (state_snapshots.HostStateSnapshots)
go on the same stream, numbered in the same sequence (`issue`): the copy stream first waits for
the work queued on the compute stream so far (a save or a forward pass wrote the device slot or
the staging buffer a write-back reads; a restore may still read the slot a load overwrites), then
copies between device and pinned host memory. So one "done" counter covers a request's KV load
and the snapshot load beside it, and a snapshot slot's copy is done when `done_seq` passes its
number.

Under tensor parallelism each rank holds a host pool for its own KV shard, with the same slot
numbering. Rank 0's engine records every copy it issues (into `log`, cache/copy_log.py, when it has
one); the other ranks replay them in the same order on their own shard (`replay`) and make their compute
stream wait for them (the loads, and the snapshot copies, which read or write device slots on the
copy stream) when rank 0 has seen its own copies done (`compute_waits_for`); see
docs/tensor_parallel.md for why that ordering is enough.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from radixserve.cache.copy_log import CopyKind, CopyLog, CopyOrder
from radixserve.cache.host_memory import check_host_memory, pin_in_place
from radixserve.cache.kv_pool import KVPool, PageAllocator
from radixserve.cache.stores.shared_buffer import SharedBuffer

_NO_SLOTS = torch.empty(0, dtype=torch.int64)

# Device staging of a load, in tokens (7B: 224 MiB): longer loads go through it in chunks.
LOAD_CHUNK_TOKENS = 4096


class HostKVPool:
    """Host slots in pages of the device pool's page size; page 0 is never handed out."""

    def __init__(self, num_tokens: int, device_pool: KVPool, *, pin: bool, shared: bool = False):
        self.page_size = device_pool.page_size
        num_pages = num_tokens // self.page_size
        self.num_layers = len(device_pool.k_buffers)
        self.row_bytes = self.token_bytes(device_pool) // (2 * self.num_layers)  # one layer's k (or v)
        self.bytes_per_token = self.token_bytes(device_pool)
        num_slots = (num_pages + 1) * self.page_size
        # The buffer and the free list's 8 bytes a page, checked before either is built.
        check_host_memory(num_slots * self.bytes_per_token + 8 * num_pages,
                          f"the host tier ({num_tokens} tokens of {self.bytes_per_token} bytes)")
        self.allocator = PageAllocator(num_pages, self.page_size)
        shape = (num_slots, self.num_layers, 2, self.row_bytes)
        # shared: in memory the storage tier's I/O process maps too, which reads pages straight into it.
        self.shared_buffer = SharedBuffer(num_slots * self.bytes_per_token, "radixserve-host-tier") if shared else None
        if self.shared_buffer is not None:
            self.buffer = torch.frombuffer(self.shared_buffer.map, dtype=torch.uint8,
                                           count=num_slots * self.bytes_per_token).view(shape)
        else:
            self.buffer = torch.empty(shape, dtype=torch.uint8)
        self.pinned = pin and pin_in_place(self, self.buffer, "the host tier")

    @staticmethod
    def token_bytes(device_pool: KVPool) -> int:
        """KV bytes of one token, every layer, k and v, in the device pool's own dtype."""
        k0 = device_pool.k_buffers[0]
        return 2 * len(device_pool.k_buffers) * k0[0].numel() * k0.element_size()

    @property
    def total_tokens(self) -> int:
        return self.allocator.total_tokens

    def page_starts(self, slots: torch.Tensor) -> list[int]:
        """The first slot of each page of slots (whole pages from `alloc`, each page's slots
        consecutive: its bytes are one run of the buffer)."""
        pages = slots.view(-1, self.page_size)
        firsts = pages[:, 0]
        assert torch.equal(pages - firsts[:, None], torch.arange(self.page_size).expand_as(pages)), \
            "a page's host slots are not consecutive"
        return firsts.tolist()

    def alloc(self, num_tokens: int) -> Optional[torch.Tensor]:
        """Slots for num_tokens (whole pages), ascending so neighbours form long copy runs; None when short."""
        pages = self.allocator.alloc_pages(num_tokens // self.page_size)
        if pages is None:
            return None
        pages.sort()
        return self.allocator.pages_to_slots(pages)


def copy_runs(host_slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first host slot, first staging row, length) of each run of consecutive host slots."""
    n = host_slots.numel()
    if n == 0:
        return []
    cut = ((host_slots[1:] - host_slots[:-1]) != 1).nonzero().flatten().add_(1).tolist()
    starts = [0] + cut
    ends = cut + [n]
    first = host_slots[torch.tensor(starts, dtype=torch.int64)].tolist()
    return [(h, s, e - s) for h, s, e in zip(first, starts, ends)]


def _slot_array(slots: torch.Tensor) -> array:
    out = array("q")
    out.frombytes(slots.to(torch.int64).numpy().tobytes())
    return out


@dataclass
class CopyStats:
    loaded_tokens: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0  # time the loads' copies took (device-timed on CUDA)
    written_back_tokens: int = 0
    written_back_bytes: int = 0

    @property
    def load_bandwidth(self) -> float:
        """Bytes per second of the loads measured so far (0 before the first)."""
        return self.loaded_bytes / self.load_seconds if self.load_seconds > 0 else 0.0


class CopyEngine:
    """Issues copies between the device pool and the host pool; completion in issue order."""

    def __init__(self, device_pool: KVPool, host_pool: HostKVPool):
        self.host = host_pool
        # Both pools seen as rows of machine words ([slot, words of one token's heads]): index copies
        # move 8 bytes per element where the row allows it, not 1.
        self.word = next(d for d in (torch.int64, torch.int32, torch.int16, torch.uint8)
                         if host_pool.row_bytes % torch.tensor([], dtype=d).element_size() == 0)
        rows = host_pool.row_bytes // torch.tensor([], dtype=self.word).element_size()
        self.row_words = rows
        self.dev_k = [b.view(torch.uint8).view(b.shape[0], -1).view(self.word) for b in device_pool.k_buffers]
        self.dev_v = [b.view(torch.uint8).view(b.shape[0], -1).view(self.word) for b in device_pool.v_buffers]
        self.host_buf = host_pool.buffer.view(self.word)  # [slot, layer, k|v, words]
        self.device = device_pool.k_buffers[0].device
        self.issued_seq = 0
        self.done_seq = 0
        self.stats = CopyStats()
        # (seq, tokens loaded or 0, end event, start event, whether the other ranks' compute stream
        # waits for it) of copies not yet seen done.
        self._pending: deque[tuple[int, int, object, object, bool]] = deque()
        # Every copy issued, kept for the other tensor-parallel ranks (None: not kept).
        self.log: Optional[CopyLog] = None

    def _next(self, load: bool, dev_slots: torch.Tensor, host_slots: torch.Tensor) -> int:
        self.issued_seq += 1
        if self.log is not None:
            dev, host = _slot_array(dev_slots), _slot_array(host_slots)
            if load:
                self.log.record(CopyKind.KV_LOAD, host, dev, self.issued_seq)
            else:
                self.log.record(CopyKind.KV_WRITE_BACK, dev, host, self.issued_seq)
        return self.issued_seq

    def write_back(self, dev_slots: torch.Tensor, host_slots: torch.Tensor) -> int:
        seq = self._next(False, dev_slots, host_slots)
        self.stats.written_back_tokens += dev_slots.numel()
        self.stats.written_back_bytes += dev_slots.numel() * self.host.bytes_per_token
        self._pending.append((seq, 0, *self._write_back(dev_slots, host_slots), False))
        return seq

    def load(self, host_slots: torch.Tensor, dev_slots: torch.Tensor) -> int:
        seq = self._next(True, dev_slots, host_slots)
        self._pending.append((seq, dev_slots.numel(), *self._load(host_slots, dev_slots), True))
        return seq

    def issue(self, copy: Callable[[], None], *, waits: bool = True, uses: Sequence[torch.Tensor] = ()) -> int:
        """Another store's copy between device and pinned host memory (a hybrid's snapshots between
        the tiers), numbered and completed in order with the KV copies: on the copy stream, after
        the work queued on the compute stream so far; copy() queues it on the current stream (the
        copy stream on CUDA). The caller logs it for the other ranks with the number returned.
        waits: it reads or writes device memory the compute stream may use once the copy is seen
        done, so the other ranks' compute stream waits for it as for a load (False: a write-back
        from a staging buffer). uses: device tensors the copy reads that the caller drops at once
        (a staging buffer), kept from reuse until the copy stream is through with them."""
        self.issued_seq += 1
        self._pending.append((self.issued_seq, 0, *self._issue(copy, uses), waits))
        return self.issued_seq

    def replay(self, order: CopyOrder) -> None:
        """Issue rank 0's copy on this rank's shard; it gets the same sequence number."""
        src = torch.frombuffer(order.src, dtype=torch.int64) if order.src else _NO_SLOTS
        dst = torch.frombuffer(order.dst, dtype=torch.int64) if order.dst else _NO_SLOTS
        seq = self.load(src, dst) if order.kind is CopyKind.KV_LOAD else self.write_back(src, dst)
        if seq != order.seq:
            raise RuntimeError(f"copy {order.seq} of rank 0 was issued here as copy {seq}: the ranks' host tiers "
                               "have diverged")

    def compute_waits_for(self, seq: int) -> None:
        """Make the work queued from now on the compute stream wait for the loads and snapshot
        copies up to copy seq (the host does not block), and forget the copies up to it (their
        completion is rank 0's to observe). KV write-backs need no wait: their device reads are
        queued on the compute stream."""
        last_load = None
        while self._pending and self._pending[0][0] <= seq:
            entry = self._pending.popleft()
            if entry[4]:
                last_load = entry[2]
        if last_load is not None:
            self._stream_waits(last_load)  # copies complete in issue order: the last covers the rest

    def poll(self) -> int:
        """Advance done_seq past every copy that has completed; returns it."""
        while self._pending and self._is_done(self._pending[0][2]):
            self._retire(self._pending.popleft())
        return self.done_seq

    def wait(self, seq: int) -> None:
        """Block until copy seq (and so every copy before it) has completed, then poll."""
        while self._pending and self._pending[0][0] <= seq:
            entry = self._pending.popleft()
            self._synchronize(entry[2])
            self._retire(entry)
        self.poll()

    def wait_all(self) -> None:
        self.wait(self.issued_seq)

    def drain(self) -> None:
        """Block until every copy issued here has completed, seen or not (a tensor-parallel rank
        other than 0 reads or writes its host pool itself at rank 0's storage orders)."""
        self._drain()

    def _retire(self, entry: tuple[int, int, object, object, bool]) -> None:
        seq, tokens, end, start, _ = entry
        if tokens:
            self.stats.loaded_tokens += tokens
            self.stats.loaded_bytes += tokens * self.host.bytes_per_token
            self.stats.load_seconds += self._elapsed(start, end)
        self.done_seq = seq

    # The device-specific parts.
    def _write_back(self, dev_slots: torch.Tensor, host_slots: torch.Tensor) -> tuple[object, object]:
        raise NotImplementedError

    def _load(self, host_slots: torch.Tensor, dev_slots: torch.Tensor) -> tuple[object, object]:
        raise NotImplementedError

    def _issue(self, copy: Callable[[], None], uses: Sequence[torch.Tensor]) -> tuple[object, object]:
        start = time.perf_counter()
        copy()  # synchronous: complete at issue
        return time.perf_counter(), start

    def _is_done(self, event: object) -> bool:
        return True

    def _synchronize(self, event: object) -> None:
        pass

    def _stream_waits(self, event: object) -> None:
        pass  # a synchronous copy is complete at issue

    def _drain(self) -> None:
        pass

    def _elapsed(self, start: object, end: object) -> float:
        return float(end) - float(start)  # type: ignore[arg-type]


class SyncCopyEngine(CopyEngine):
    """The copies run at issue (a CPU "device"); completion is still reported by poll()."""

    def _write_back(self, dev_slots: torch.Tensor, host_slots: torch.Tensor) -> tuple[object, object]:
        start = time.perf_counter()
        buf = self.host_buf
        for layer, (k, v) in enumerate(zip(self.dev_k, self.dev_v)):
            buf[host_slots, layer, 0] = k[dev_slots]
            buf[host_slots, layer, 1] = v[dev_slots]
        return time.perf_counter(), start

    def _load(self, host_slots: torch.Tensor, dev_slots: torch.Tensor) -> tuple[object, object]:
        start = time.perf_counter()
        staging = self.host_buf[host_slots]
        for layer, (k, v) in enumerate(zip(self.dev_k, self.dev_v)):
            k[dev_slots] = staging[:, layer, 0]
            v[dev_slots] = staging[:, layer, 1]
        return time.perf_counter(), start


class CudaCopyEngine(CopyEngine):
    """Copies on a dedicated stream; a load never waits in the compute stream."""

    def __init__(self, device_pool: KVPool, host_pool: HostKVPool):
        super().__init__(device_pool, host_pool)
        self.stream = torch.cuda.Stream(self.device)

    def _write_back(self, dev_slots: torch.Tensor, host_slots: torch.Tensor) -> tuple[object, object]:
        n, layers, rows = dev_slots.numel(), self.host.num_layers, self.row_words
        # The gather runs on the compute stream: after every step that wrote these slots, before
        # any step that reuses them.
        idx = dev_slots.to(self.device, non_blocking=True)
        staging = torch.empty((n, layers, 2, rows), dtype=self.word, device=self.device)
        for layer, (k, v) in enumerate(zip(self.dev_k, self.dev_v)):
            staging[:, layer, 0] = k[idx]
            staging[:, layer, 1] = v[idx]
        gathered = torch.cuda.Event()
        gathered.record()
        start, end = torch.cuda.Event(), torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(gathered)
            start.record(self.stream)
            for h, s, length in copy_runs(host_slots):
                self.host_buf[h:h + length].copy_(staging[s:s + length], non_blocking=True)
            end.record(self.stream)
        staging.record_stream(self.stream)  # not reused before the copy stream is done with it
        return end, start

    def _load(self, host_slots: torch.Tensor, dev_slots: torch.Tensor) -> tuple[object, object]:
        n, layers, rows = dev_slots.numel(), self.host.num_layers, self.row_words
        launched = torch.cuda.Event()
        launched.record()  # the destination slots are free once the compute stream passes this
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(launched)
            start.record(self.stream)
            idx = dev_slots.to(self.device, non_blocking=True)
            # One staging buffer of at most LOAD_CHUNK_TOKENS, reused chunk after chunk in stream order.
            staging = torch.empty((min(n, LOAD_CHUNK_TOKENS), layers, 2, rows), dtype=self.word,
                                  device=self.device)
            for first in range(0, n, LOAD_CHUNK_TOKENS):
                count = min(LOAD_CHUNK_TOKENS, n - first)
                for h, s, length in copy_runs(host_slots[first:first + count]):
                    staging[s:s + length].copy_(self.host_buf[h:h + length], non_blocking=True)
                chunk = idx[first:first + count]
                for layer, (k, v) in enumerate(zip(self.dev_k, self.dev_v)):
                    k[chunk] = staging[:count, layer, 0]
                    v[chunk] = staging[:count, layer, 1]
            end.record(self.stream)
        return end, start

    def _issue(self, copy: Callable[[], None], uses: Sequence[torch.Tensor]) -> tuple[object, object]:
        queued = torch.cuda.Event()
        queued.record()  # what the compute stream wrote (or still reads) is done once it passes this
        end = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(queued)
            copy()
            end.record(self.stream)
        for tensor in uses:
            tensor.record_stream(self.stream)
        return end, end  # not timed: only the KV loads' bandwidth is measured

    def _is_done(self, event: object) -> bool:
        return event.query()  # type: ignore[attr-defined]

    def _synchronize(self, event: object) -> None:
        event.synchronize()  # type: ignore[attr-defined]

    def _stream_waits(self, event: object) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)  # type: ignore[arg-type]

    def _drain(self) -> None:
        self.stream.synchronize()

    def _elapsed(self, start: object, end: object) -> float:
        return start.elapsed_time(end) / 1000.0  # type: ignore[attr-defined]  (loads' events are timed)


def make_copy_engine(device_pool: KVPool, host_pool: HostKVPool) -> CopyEngine:
    if device_pool.k_buffers[0].device.type == "cuda":
        return CudaCopyEngine(device_pool, host_pool)
    return SyncCopyEngine(device_pool, host_pool)
