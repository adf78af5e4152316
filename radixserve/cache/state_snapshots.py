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
`radixserve.cache.stores.host_snapshots`). Its copies are queued on the compute stream too, so
they are ordered with every save and restore without events: a device slot freed after its
write-back is reused only by copies queued after it, and a host slot is read back only by a load
queued after the write-back that filled it. The host side never reads the buffer itself.

Under tensor parallelism each rank holds its heads' share of every state and of every snapshot,
on both tiers, with the same slot numbering. Rank 0's copies (host ones included) are recorded
(into `log`, cache/copy_log.py, when it has one) and sent with the next step, and every other rank replays them in
order before that step's forward (`replay`): rank 0 issued them between the same two forward passes.
"""

from __future__ import annotations

from math import prod
from typing import Optional

import torch

from radixserve.cache.copy_log import CopyKind, CopyLog, CopyOrder, slot_array
from radixserve.cache.host_memory import check_host_memory, pin_in_place
from radixserve.cache.state_pool import RecurrentStatePool, RecurrentStateSpec

# Each layer's conv and ssm block of the host buffer starts at a multiple of this many bytes, so
# its view in the state's dtype is aligned.
_HOST_ALIGN = 64


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
    rows of `rows`."""

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

    @property
    def bytes_per_slot(self) -> int:
        return self.spec.bytes_per_row

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.spec.bytes_per_row

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

    def record(self, kind: CopyKind, src: list[int], dst: list[int]) -> None:
        if self.log is not None and src:
            self.log.record(kind, slot_array(src), slot_array(dst))

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
    and the copies between them and the device snapshot slots of `device`."""

    def __init__(self, num_slots: int, device: StateSnapshots, *, pin: bool):
        if num_slots < 1:
            raise ValueError("a host snapshot pool holds at least one slot")
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
        device.host = self

    @property
    def bytes_per_slot(self) -> int:
        return self.spec.bytes_per_row

    @property
    def total_bytes(self) -> int:
        return self.buffer.numel()

    # ------------------------------------------------------------------ copies
    def write_back(self, device_slots: list[int], host_slots: list[int]) -> None:
        """host[host_slots[i]] = device snapshot device_slots[i], every linear layer."""
        self.device.record(CopyKind.STATE_WRITE_BACK, device_slots, host_slots)
        self._copy(device_slots, host_slots, to_host=True)

    def load(self, host_slots: list[int], device_slots: list[int]) -> None:
        """device snapshot device_slots[i] = host[host_slots[i]], every linear layer."""
        self.device.record(CopyKind.STATE_LOAD, host_slots, device_slots)
        self._copy(device_slots, host_slots, to_host=False)

    def replay(self, order: CopyOrder) -> None:
        if order.kind is CopyKind.STATE_WRITE_BACK:
            self._copy(order.src.tolist(), order.dst.tolist(), to_host=True)
        else:
            self._copy(order.dst.tolist(), order.src.tolist(), to_host=False)

    def _copy(self, device_slots: list[int], host_slots: list[int], *, to_host: bool) -> None:
        # One copy per layer and kind: a snapshot's block of each is contiguous on both sides.
        # Queued on the current (compute) stream; from pinned memory, without blocking the host.
        dev = self.device
        for d, h in zip(device_slots, host_slots):
            for layer in range(self.spec.num_layers):
                if to_host:
                    self.conv[layer][h].copy_(dev.conv[layer][d], non_blocking=True)
                    self.ssm[layer][h].copy_(dev.ssm[layer][d], non_blocking=True)
                else:
                    dev.conv[layer][d].copy_(self.conv[layer][h], non_blocking=True)
                    dev.ssm[layer][d].copy_(self.ssm[layer][h], non_blocking=True)
