"""Snapshots of a hybrid model's recurrent states: the third kind of state the prefix cache keeps.

A Gated DeltaNet layer's state after position p (its conv window and its recurrent state) is one
fixed-size tensor that no KV can rebuild and that can only be resumed exactly at p. A request
resumed from a cached prefix of p tokens therefore needs the state at p. The prefix cache keeps
such states in this pool: its own slots, separate from the running requests' rows
(`RecurrentStatePool`), with its own byte budget in the memory plan (`--mamba-cache-size`).

`StateSnapshots` copies between the two: `save` a request row's state into a snapshot slot (where
a request's chunk ended at a branch point, or where its sequence ended), `restore` a snapshot into
the row of a request admitted on it. Both are queued on the device's compute stream, so they take
their place between the forward passes that read and write the rows (the cache issues them at the
right moments: `radixserve.cache.stores.snapshots`). The slots' bookkeeping (who owns each) is the
cache's; this module only hands out free slots and copies.

With a host tier, `HostStateSnapshots` holds more snapshots in host memory (pinned on CUDA, its
own budget, `--mamba-host-cache-size`): a snapshot goes there with its node's KV when the device
evicts the node and comes back with it when the KV is loaded back (the bookkeeping is
`radixserve.cache.stores.host_snapshots`). Its copies go on the host tier's copy stream
(host_pool.CopyEngine.issue), numbered in the KV copies' sequence, so they overlap the forward
passes instead of stalling them (151 MiB each for Qwen3.5-27B). Each first waits for the work
queued on the compute stream so far (the save or forward pass that wrote the slot a write-back
reads, a restore still reading the slot a load overwrites). After that, stream order and the
copy's number cover every hazard:

- A write-back is staged, as the host KV's are: the compute stream gathers the slot into a
  staging buffer (a device-to-device copy: ~0.1 ms of the device's time for 151 MiB) and the copy stream moves that to
  the host, so the slot is reusable at once. A full pool evicts a snapshot to take one, and a slot
  out of use for the copy's time would cost that new snapshot. Staging costs a snapshot's worth of
  device memory per write-back in flight, so at most STAGED_WRITE_BACKS are (a burst: the device
  evicting many leaves at once); beyond them a write-back reads its slot on the copy stream, and
  `free` holds the slot back until the copy engine's `done_seq` (advanced only by `poll`) passes
  that copy's number. So does a slot a load still fills. Only a load, queued after that copy on
  the same stream, may take such a slot at once (`alloc(behind_copies=True)`).
- A snapshot loaded into a device slot is read (restored into a request's row) only once `poll`
  saw its load done: the request waits in admission until then (host_snapshots.HostSnapshots.fetch).
- A host slot is written by write-backs and read by loads, all on the one copy stream in issue
  order, so a load reads a write-back's bytes only after they landed and a write-back into a
  freed host slot lands after the load that read it. The host side reads or fills a host slot
  itself only in the storage tier, after `sync`.

On the CPU (the test suite's device) the copies run at issue, but their completion is still seen
only by `poll`, so the waits above are the same.

Under tensor parallelism each rank holds its heads' share of every state and of every snapshot,
on both tiers, with the same slot numbering. Rank 0's copies (host ones included, with their
numbers) are recorded (into `log`, cache/copy_log.py, when it has one) and sent with the next step,
and every other rank replays them in order before that step's forward (`replay`): rank 0 issued
them between the same two forward passes, under rank 0's numbers, a write-back staged where rank
0's was (the order says so: its gather then sits on the rank's compute stream before any reuse of
the slot, as on rank 0). A rank's compute stream waits for its own snapshot loads and unstaged
write-backs up to the last copy rank 0 saw done, as for its KV loads
(host_pool.CopyEngine.compute_waits_for): rank 0 restores a loaded snapshot, or reuses a slot an
unstaged write-back read, only after seeing that copy done.
"""

from __future__ import annotations

from collections import deque
from math import prod
from typing import Optional

import torch

from radixserve.cache.copy_log import CopyIssuer, CopyKind, CopyLog, CopyOrder, slot_array
from radixserve.cache.host_memory import check_host_memory, pin_in_place
from radixserve.cache.state_pool import RecurrentStatePool, RecurrentStateSpec

# Each layer's conv and ssm block of the host buffer starts at a multiple of this many bytes, so
# its view in the state's dtype is aligned.
_HOST_ALIGN = 64
# Write-backs gathered into a staging buffer (device memory, a snapshot's worth each: 151 MiB for
# the 27B, 1.2 GiB for 8) at most in flight at once; beyond them a write-back reads its slot on the
# copy stream and the slot waits for the copy before it is reused (StateSnapshots.free). The
# scheduler simulator's 27B agent runs with a host tier (seed 1): hit rate 0.872 with 2, 0.875
# with 4, 0.877 with 8 or unbounded (the turns that lost their previous prompt: 40, 21, 3, 0):
# the device evicts in bursts, and a snapshot whose slot waits for a copy is one not taken.
STAGED_WRITE_BACKS = 8


class _SlotFreeList:
    """The free list both snapshot pools number their slots with (the lowest slot handed out first)."""

    _free: list[int]

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def free_slot_list(self) -> list[int]:
        return list(self._free)

    def alloc(self) -> Optional[int]:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)


class StateSnapshots(_SlotFreeList):
    """Snapshot slots conv[layer] [slots, kernel - 1, channels] and ssm[layer] [slots, v_heads,
    k_head_dim, v_head_dim] (the spec of the request rows' pool) and the copies to and from the
    rows of `rows`. A slot freed while a host-tier copy reads or writes it on the copy stream goes
    back to the free list once that copy is done (module docstring)."""

    def __init__(self, num_slots: int, rows: RecurrentStatePool):
        if num_slots < 1:
            raise ValueError("a snapshot pool holds at least one slot")
        spec: RecurrentStateSpec = rows.spec
        device = rows.conv[0].device
        self.spec = spec
        self.rows = rows
        self.num_slots = num_slots
        self.conv = [torch.zeros((num_slots, *spec.conv_shape), dtype=spec.conv_dtype, device=device)
                     for _ in range(spec.num_layers)]
        self.ssm = [torch.zeros((num_slots, *spec.ssm_shape), dtype=spec.ssm_dtype, device=device)
                    for _ in range(spec.num_layers)]
        # Slots 0..num_slots-1; popping from the end hands out low slots first.
        self._free = list(range(num_slots - 1, -1, -1))
        self.log: Optional[CopyLog] = None  # rank 0 of a tensor-parallel engine records its copies (its host tier's too)
        self.host: Optional[HostStateSnapshots] = None  # the host tier's snapshots, when there is one
        # Slot -> the number of the last host-tier copy that reads or writes it, and the slots freed
        # while that copy was in flight: (copy number, slot), free once it is done.
        self._copying: dict[int, int] = {}
        self._freed: deque[tuple[int, int]] = deque()

    @property
    def bytes_per_slot(self) -> int:
        return self.spec.bytes_per_row

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.spec.bytes_per_row

    # ------------------------------------------------------------------ slots and their host copies
    @property
    def free_slots(self) -> int:
        """Free slots, those waiting for their host-tier copy included."""
        return len(self._free) + len(self._freed)

    def free_slot_list(self) -> list[int]:
        return list(self._free) + [slot for _, slot in self._freed]

    def alloc(self, *, behind_copies: bool = False) -> Optional[int]:
        """A free slot (None: none). behind_copies: for a copy on the host tier's copy stream (a
        load), which may take a slot whose copy is still in flight: it is queued after it."""
        self._reclaim()
        if self._free:
            return self._free.pop()
        if behind_copies and self._freed:
            return self._freed.popleft()[1]
        return None

    def free(self, slot: int) -> None:
        seq = self._copying.pop(slot, 0)
        if seq > self._done_seq():
            self._freed.append((seq, slot))  # its host-tier copy may still read or write it
        else:
            self._free.append(slot)

    def copying(self, slots: list[int], seq: int) -> None:
        """Host-tier copy seq reads or writes these slots: none is reused before it is done."""
        for slot in slots:
            self._copying[slot] = seq

    def _done_seq(self) -> int:
        return self.host.copier.done_seq if self.host is not None else 0

    def _reclaim(self) -> None:
        if self._freed:
            done = self._done_seq()
            still = [(seq, slot) for seq, slot in self._freed if seq > done]
            if len(still) < len(self._freed):
                self._free.extend(slot for seq, slot in self._freed if seq <= done)
                self._freed = deque(still)

    def sync(self) -> None:
        """Block until every snapshot copy queued so far is done, on both streams (CUDA): before
        the host reads or fills a host snapshot slot itself (the storage tier)."""
        if self.conv[0].is_cuda:
            torch.cuda.current_stream(self.conv[0].device).synchronize()
        if self.host is not None:
            self.host.copier.drain()

    # ------------------------------------------------------------------ copies
    def save(self, rows: list[int], slots: list[int]) -> None:
        """snapshot[slots[i]] = the state of request row rows[i], every linear layer."""
        self.record(CopyKind.STATE_SAVE, rows, slots)
        self._copy(rows, slots, save=True)

    def restore(self, slots: list[int], rows: list[int]) -> None:
        """The state of request row rows[i] = snapshot[slots[i]], every linear layer."""
        self.record(CopyKind.STATE_RESTORE, slots, rows)
        self._copy(rows, slots, save=False)

    def replay(self, order: CopyOrder) -> None:
        """Issue rank 0's copies on this rank's share of the states (or of its host tier's)."""
        src, dst = order.src.tolist(), order.dst.tolist()
        if order.kind is CopyKind.STATE_SAVE:
            self._copy(src, dst, save=True)
        elif order.kind is CopyKind.STATE_RESTORE:
            self._copy(dst, src, save=False)
        elif self.host is None:
            raise RuntimeError("rank 0 sent host-tier snapshot copies to a rank without host snapshots")
        else:
            self.host.replay(order)

    def record(self, kind: CopyKind, src: list[int], dst: list[int], seq: int = 0, payload: object = None) -> None:
        if self.log is not None and src:
            self.log.record(kind, slot_array(src), slot_array(dst), seq, payload)

    def _copy(self, rows: list[int], slots: list[int], *, save: bool) -> None:
        if not rows:
            return
        state = self.rows
        if len(rows) == 1:  # the usual case: views, no index tensor to send to the device
            row, slot = rows[0], slots[0]
            for layer in range(self.spec.num_layers):
                if save:
                    self.conv[layer][slot].copy_(state.conv[layer][row])
                    self.ssm[layer][slot].copy_(state.ssm[layer][row])
                else:
                    state.conv[layer][row].copy_(self.conv[layer][slot])
                    state.ssm[layer][row].copy_(self.ssm[layer][slot])
            return
        device = self.conv[0].device
        rows_t = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        slots_t = torch.tensor(slots, dtype=torch.int64).to(device, non_blocking=True)
        for layer in range(self.spec.num_layers):
            if save:
                self.conv[layer].index_copy_(0, slots_t, state.conv[layer].index_select(0, rows_t))
                self.ssm[layer].index_copy_(0, slots_t, state.ssm[layer].index_select(0, rows_t))
            else:
                state.conv[layer].index_copy_(0, rows_t, self.conv[layer].index_select(0, slots_t))
                state.ssm[layer].index_copy_(0, rows_t, self.ssm[layer].index_select(0, slots_t))



class HostStateSnapshots(_SlotFreeList):
    """The host tier's snapshot slots: per linear layer conv [slots, kernel - 1, channels] and ssm
    [slots, v_heads, k_head_dim, v_head_dim], views of one byte buffer (pinned on CUDA as a whole),
    and the copies between them and the device snapshot slots of `device`, issued on the host
    tier's copy engine `copier` (its copy stream, its numbering)."""

    def __init__(self, num_slots: int, device: StateSnapshots, *, pin: bool, copier: CopyIssuer):
        if num_slots < 1:
            raise ValueError("a host snapshot pool holds at least one slot")
        self.copier = copier
        spec = device.spec
        self.spec = spec
        self.device = device
        self.num_slots = num_slots

        def block(shape: tuple[int, ...], dtype: torch.dtype) -> int:
            size = num_slots * prod(shape) * torch.tensor([], dtype=dtype).element_size()
            return -(-size // _HOST_ALIGN) * _HOST_ALIGN

        conv_block, ssm_block = block(spec.conv_shape, spec.conv_dtype), block(spec.ssm_shape, spec.ssm_dtype)
        total = spec.num_layers * (conv_block + ssm_block)
        check_host_memory(total, f"the host tier's state snapshots (--mamba-host-cache-size {num_slots} of "
                                 f"{spec.bytes_per_row} bytes)")
        self.buffer = torch.empty(total, dtype=torch.uint8)
        self.conv: list[torch.Tensor] = []
        self.ssm: list[torch.Tensor] = []
        offset = 0
        for _ in range(spec.num_layers):
            for views, shape, dtype, size in ((self.conv, spec.conv_shape, spec.conv_dtype, conv_block),
                                              (self.ssm, spec.ssm_shape, spec.ssm_dtype, ssm_block)):
                n = num_slots * prod(shape) * torch.tensor([], dtype=dtype).element_size()
                views.append(self.buffer[offset:offset + n].view(dtype).view(num_slots, *shape))
                offset += size
        self.pinned = pin and pin_in_place(self, self.buffer, "the host tier's state snapshots")
        self._free = list(range(num_slots - 1, -1, -1))
        self._staged: deque[int] = deque()  # the copy numbers of staged write-backs maybe in flight, one per snapshot
        device.host = self

    @property
    def bytes_per_slot(self) -> int:
        return self.spec.bytes_per_row

    @property
    def total_bytes(self) -> int:
        return self.buffer.numel()

    # ------------------------------------------------------------------ copies
    def write_back(self, device_slots: list[int], host_slots: list[int]) -> int:
        """host[host_slots[i]] = device snapshot device_slots[i], every linear layer, on the copy
        stream; returns the copy's number. Staged (gathered on the compute stream, the slots
        reusable at once) while fewer than STAGED_WRITE_BACKS staged snapshots are in flight;
        else read from the slots themselves, which are not reused before the copy is done."""
        done = self.copier.done_seq
        while self._staged and self._staged[0] <= done:
            self._staged.popleft()
        staged = len(self._staged) + len(device_slots) <= STAGED_WRITE_BACKS
        seq = self._write_back(device_slots, host_slots, staged)
        if staged:
            self._staged.extend([seq] * len(device_slots))
        self.device.record(CopyKind.STATE_WRITE_BACK, device_slots, host_slots, seq, staged)
        return seq

    def load(self, host_slots: list[int], device_slots: list[int]) -> int:
        """device snapshot device_slots[i] = host[host_slots[i]], every linear layer, on the copy
        stream; returns the copy's number (nothing may read the device slots before it is done)."""
        seq = self.copier.issue(lambda: self._copy(device_slots, host_slots, to_host=False))
        self.device.copying(device_slots, seq)
        self.device.record(CopyKind.STATE_LOAD, host_slots, device_slots, seq)
        return seq

    def replay(self, order: CopyOrder) -> None:
        """Issue rank 0's copy on this rank's share, staged where rank 0's was; it gets rank 0's number."""
        if order.kind is CopyKind.STATE_WRITE_BACK:
            seq = self._write_back(order.src.tolist(), order.dst.tolist(), bool(order.payload))
        else:
            dst, src = order.dst.tolist(), order.src.tolist()
            seq = self.copier.issue(lambda: self._copy(dst, src, to_host=False))
        if seq != order.seq:
            raise RuntimeError(f"snapshot copy {order.seq} of rank 0 was issued here as copy {seq}: the ranks' "
                               "host tiers have diverged")

    def _write_back(self, device_slots: list[int], host_slots: list[int], staged: bool) -> int:
        if not staged:
            seq = self.copier.issue(lambda: self._copy(device_slots, host_slots, to_host=True))
            self.device.copying(device_slots, seq)
            return seq
        # The gather is queued on the compute stream: after the work that wrote the slots, before
        # any that reuses them; the copy stream moves it on. Nobody waits for it but the host tier.
        dev = self.device
        staging = [(dev.conv[layer][d].clone(), dev.ssm[layer][d].clone())
                   for d in device_slots for layer in range(self.spec.num_layers)]

        def copy() -> None:
            layers = self.spec.num_layers
            for i, h in enumerate(host_slots):
                for layer in range(layers):
                    conv, ssm = staging[i * layers + layer]
                    self.conv[layer][h].copy_(conv, non_blocking=True)
                    self.ssm[layer][h].copy_(ssm, non_blocking=True)

        return self.copier.issue(copy, waits=False, uses=[t for pair in staging for t in pair])

    def _copy(self, device_slots: list[int], host_slots: list[int], *, to_host: bool) -> None:
        # One copy per layer and kind: a snapshot's block of each is contiguous on both sides.
        # Queued on the current stream (the copy stream); from or to pinned memory, without
        # blocking the host.
        dev = self.device
        for d, h in zip(device_slots, host_slots):
            for layer in range(self.spec.num_layers):
                if to_host:
                    self.conv[layer][h].copy_(dev.conv[layer][d], non_blocking=True)
                    self.ssm[layer][h].copy_(dev.ssm[layer][d], non_blocking=True)
                else:
                    dev.conv[layer][d].copy_(self.conv[layer][h], non_blocking=True)
                    dev.ssm[layer][d].copy_(self.ssm[layer][h], non_blocking=True)
