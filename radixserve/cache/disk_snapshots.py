"""The storage tier's part for a hybrid model: its recurrent-state snapshots beside its pages.

A hybrid request resumes only where a snapshot of its linear-attention layers' states lies
(stores/snapshots.py), so pages on disk are worth reading only up to a page whose snapshot is on
disk too. The store keeps such snapshots as records of their own kind (page_files.py: their own
magic and checksum), keyed by `snapshot_key` of the hash of the page they end: the hash names the
whole prefix, so a snapshot found under it is the state after exactly those tokens.

- **Save**: when the host tier drops a node (its KV for room) or only its host snapshot (the host
  snapshot pool's own eviction), the host snapshot at the node's end is copied out and queued
  beside its pages; at shutdown every snapshot in the tree, from the host or the device.
- **Fetch**: of the consecutive pages on disk past a request's usable prefix, only those up to
  the deepest one whose snapshot is on disk count (`usable_pages`); the read costs their bytes and
  the snapshot's, and reads the snapshot first (without it the pages resume nobody).
- **Attach**: the pages become a host-only leaf as for an attention model (`HostKV.attach`), and
  the snapshot a host snapshot on the node at their end (`HostSnapshots.adopt`): from there the host
  tier's own path loads the KV, brings the snapshot to the device and resumes from it, counted as a
  host hit, exactly as for a snapshot the host tier had kept itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from radixserve.cache.page_events import path_page_hash
from radixserve.cache.state_pool import RecurrentStateSpec
from radixserve.cache.stores.disk import DiskStore
from radixserve.cache.stores.page_files import snapshot_key, snapshot_record
from radixserve.cache.stores.snapshots import SnapshotStore
from radixserve.cache.tree import TreeNode

if TYPE_CHECKING:
    from radixserve.cache.disk_tier import HostPlace


def state_stamp(spec: RecurrentStateSpec) -> str:
    """What a snapshot record's bytes depend on, for the store's version stamp."""
    def dtype(d: torch.dtype) -> str:
        return str(d).replace("torch.", "")
    return (f"{spec.num_layers} linear-attention layers: conv {list(spec.conv_shape)} {dtype(spec.conv_dtype)}, "
            f"recurrent {list(spec.ssm_shape)} {dtype(spec.ssm_dtype)}")


def state_bytes(conv: Sequence[torch.Tensor], ssm: Sequence[torch.Tensor], slot: int) -> torch.Tensor:
    """A snapshot slot's states (per layer its conv window, then its recurrent state) as one uint8
    tensor on the CPU, a copy (the slot is reused once it is freed)."""
    parts = []
    for c, s in zip(conv, ssm):
        parts += [c[slot].reshape(-1).view(torch.uint8), s[slot].reshape(-1).view(torch.uint8)]
    return torch.cat(parts).cpu()


def fill_state(conv: Sequence[torch.Tensor], ssm: Sequence[torch.Tensor], slot: int, data: torch.Tensor) -> None:
    """The inverse of state_bytes: the slot's states from data."""
    offset = 0
    for c, s in zip(conv, ssm):
        for t in (c[slot], s[slot]):
            n = t.numel() * t.element_size()
            t.copy_(data[offset:offset + n].view(t.dtype).view(t.shape))
            offset += n
    assert offset == data.numel(), f"a snapshot of {data.numel()} bytes for slots of {offset}"


class DiskSnapshots:
    def __init__(self, states: SnapshotStore, store: DiskStore, page_size: int):
        if states.host is None:
            raise ValueError("the storage tier keeps a hybrid model's snapshots through the host tier's snapshot "
                             "slots: give mamba_host_cache_size > 0 (or leave it to its default)")
        self.states = states
        self.host = states.host
        self.store = store
        self.page_size = page_size
        self.state_bytes = states.snapshots.bytes_per_slot
        self.written = 0  # snapshots queued for the store
        self.loaded = 0  # snapshots read back and hung on the tree
        # A host snapshot evicted for room (its node's KV stays) goes to disk too.
        self.host.on_evict = self._host_evicts

    # ------------------------------------------------------------------ save
    def save(self, node: TreeNode, page_hash: Optional[int], *, wait: bool = False) -> None:
        """Queue the snapshot at node's end (page_hash: its last page's) when it has one on the host,
        or, with wait (at shutdown), on either tier."""
        state = node.state
        if state is None or page_hash is None or snapshot_key(page_hash) in self.store:
            return
        if state.host_slot is not None:
            # Its write-back may still be on the copy stream: that copy alone is waited for (mostly
            # long done: a host snapshot goes to disk when the host tier evicts it).
            host = self.host.snapshots
            host.copier.wait(state.written_seq)
            data, source = state_bytes(host.conv, host.ssm, state.host_slot), ("host_state", state.host_slot)
        elif wait and state.slot is not None:
            self.states.snapshots.sync()  # its load may still be on the copy stream
            device = self.states.snapshots
            data, source = state_bytes(device.conv, device.ssm, state.slot), ("device_state", state.slot)
        else:
            return
        if self.store.write(snapshot_record(page_hash), data, wait=wait, source=source):
            self.written += 1
        self.store.flush()

    def _host_evicts(self, node: TreeNode) -> None:
        if node.key and len(node.key) % self.page_size == 0:
            self.save(node, path_page_hash(node, self.page_size))

    # ------------------------------------------------------------------ fetch
    def usable_pages(self, hashes: Sequence[int], first: int, n: int) -> int:
        """Of the n pages on disk from page `first`, how many a request can resume after: up to the
        deepest one whose snapshot is on disk (0: none)."""
        for k in range(n, 0, -1):
            if self.store.has(snapshot_key(hashes[first + k - 1])):
                return k
        return 0

    # ------------------------------------------------------------------ attach
    def attach(self, host: HostPlace, tokens: Sequence[int], start: int, slots: torch.Tensor,
               namespace: Optional[str], data: torch.Tensor) -> int:
        """Hang pages tokens[start:] (read into the reserved host slots `slots`) into the tree where
        it lacks them (host.attach, which takes the slots) and the snapshot (data) on the node at
        their end; the tokens made resumable (0: none)."""
        tree = self.states.tree
        end = len(tokens)
        held = max((pos + n for _, n, pos in tree.walk(tokens, namespace)), default=0)
        if held >= end:
            host.free_reserved(slots)  # the tree holds those pages again meanwhile
        elif not host.attach(tokens, start, slots, namespace):
            return 0
        node = tree.node_ending_at(tokens, end, namespace)
        if node is None or node.removed:
            return 0
        state = node.state
        if state is not None and state.held:
            return end - start  # a snapshot came back there meanwhile
        host = self.host.snapshots
        self.states.snapshots.sync()  # a freed host slot may still be read by a queued load
        def fill(slot: int) -> None:
            fill_state(host.conv, host.ssm, slot, data)
            self.store.placed_state(slot)  # the other tensor-parallel ranks fill theirs

        if not self.host.adopt(node, fill, saves=end):
            return 0
        self.loaded += 1
        return end - start
