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
right moments: `radixserve.cache.snapshot_cache`). The slots' bookkeeping (who owns each) is the
cache's; this module only hands out free slots and copies.

Under tensor parallelism each rank holds its heads' share of every state and of every snapshot,
with the same slot numbering. Rank 0's copies are recorded (`orders`, when it is a list) and sent
with the next step, and every other rank replays them in order before that step's forward
(`replay`): rank 0 issued them between the same two forward passes.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Optional

import torch

from radixserve.cache.state_pool import RecurrentStatePool, RecurrentStateSpec


@dataclass
class StateCopyOrder:
    """One batch of copies as rank 0 issued it: `save` row -> slot, else slot -> row."""
    save: bool
    rows: array
    slots: array


class StateSnapshots:
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
        self.orders: Optional[list[StateCopyOrder]] = None  # rank 0 of a tensor-parallel engine records its copies

    @property
    def bytes_per_slot(self) -> int:
        return self.spec.bytes_per_row

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.spec.bytes_per_row

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def free_slot_list(self) -> list[int]:
        return list(self._free)

    def alloc(self) -> Optional[int]:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)

    # ------------------------------------------------------------------ copies
    def save(self, rows: list[int], slots: list[int]) -> None:
        """snapshot[slots[i]] = the state of request row rows[i], every linear layer."""
        self._record(True, rows, slots)
        self._copy(rows, slots, save=True)

    def restore(self, slots: list[int], rows: list[int]) -> None:
        """The state of request row rows[i] = snapshot[slots[i]], every linear layer."""
        self._record(False, rows, slots)
        self._copy(rows, slots, save=False)

    def replay(self, order: StateCopyOrder) -> None:
        """Issue rank 0's copies on this rank's share of the states."""
        self._copy(order.rows.tolist(), order.slots.tolist(), save=order.save)

    def _record(self, save: bool, rows: list[int], slots: list[int]) -> None:
        if self.orders is not None and rows:
            self.orders.append(StateCopyOrder(save, array("q", rows), array("q", slots)))

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

    def take_orders(self) -> Optional[list[StateCopyOrder]]:
        """The copies recorded since the last call (None: none), for the other ranks."""
        if not self.orders:
            return None
        taken, self.orders = self.orders, []
        return taken
