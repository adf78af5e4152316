"""The radix cache over two tiers: device KV slots and a host-memory pool under them.

A node holds its tokens' KV on the device (`value`), on the host (`host_value`), or both. The
nodes on the device form a tree hanging from the root (a device node's parent is on the device), so
every match is a device part followed by a host part. Evicting a device leaf copies it to the host
when it has no host copy yet (write-back; `write_through` copies every new node at insert instead)
and frees its device slots; the node stays in the tree. Evicting from the host drops a host copy:
of a node also on the device, or of a host-only leaf, which then leaves the tree.

A load copies the host part of a match back: it takes device slots (evicting if it must), locks
the loading nodes like a running request would (so they cannot be evicted while the copy writes
them) and marks their host copies busy (so they cannot be dropped while the copy reads them).
`poll` unlocks them once the copy engine reports the copy done; only then does `match` see them.
Write-backs mark the new host copy busy until their copy is done, too.

Sizes: the device counters (`evictable_size`, `protected_size`, `waited_evictable_size`) count
device tokens only, so `free + evictable + protected + held == total` still holds for the device
pool; the host pool satisfies `free + evictable + busy == total` (`check_invariants`).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from radixserve.cache.host_pool import CopyEngine, CopyStats, HostKVPool
from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.prefix_cache import CPU, GPU, PARTIAL, TreeNode, check_slot_ownership
from radixserve.cache.radix_cache import RadixCache, slots_tensor

if TYPE_CHECKING:
    from radixserve.cache.disk_tier import StorageTier

# host_seq of host copies a copy being prepared will use: busy until the copy is issued.
_RESERVED = 1 << 62


class HostTierNode(TreeNode):
    """A tree node that may hold its tokens' KV on the host too (or only there)."""

    __slots__ = ("host_value", "host_seq", "loading_seq")

    def __init__(self, key: list[int], value: Optional[torch.Tensor], parent: Optional[TreeNode], tick: int,
                 node_id: int):
        super().__init__(key, value, parent, tick, node_id)
        self.host_value: Optional[torch.Tensor] = None  # host slots, len == len(key); None: not on the host
        self.host_seq = 0  # the last copy that reads or writes host_value
        self.loading_seq = 0  # the copy that fills value from the host


class TieredRadixCache(RadixCache):
    node_type = HostTierNode

    def __init__(self, allocator: PageAllocator, host_pool: HostKVPool, copier: CopyEngine, *, page_size: int = 1,
                 eviction_policy: str = "lru", write_through: bool = False):
        super().__init__(allocator, page_size=page_size, eviction_policy=eviction_policy)
        self.host_pool = host_pool
        self.host_allocator = host_pool.allocator
        self.copier: CopyEngine = copier
        self.write_through = write_through
        # Loads in flight: (copy seq, the deepest loading node, tokens), in issue order.
        self._loads: deque[tuple[int, HostTierNode, int]] = deque()
        self.loading_tokens = 0
        # Host copies in use by a copy: (copy seq, nodes), offered to host eviction once it is done.
        self._busy: deque[tuple[int, list[HostTierNode]]] = deque()
        # The storage tier under the host tier (disk_tier.py; None: none): gets the host copies this
        # tier drops, and its reads come back as host-only leaves (attach_host).
        self.storage: Optional[StorageTier] = None

    def _reset(self) -> None:
        super()._reset()
        self.host_size = 0  # tokens with a host copy
        self._host_heap: list[tuple[tuple, HostTierNode]] = []

    def reset_counters(self) -> None:
        super().reset_counters()
        self.copier.stats = CopyStats()

    # ------------------------------------------------------------------ node states
    def _loading(self, node: HostTierNode) -> bool:
        return node.loading_seq > self.copier.done_seq

    def _ready(self, node: HostTierNode) -> bool:
        """On the device with its KV in place (not waiting for a load): host-only and loading nodes
        end a match."""
        return node.value is not None and node.loading_seq <= self.copier.done_seq

    def _host_busy(self, node: HostTierNode) -> bool:
        return node.host_seq > self.copier.done_seq

    def _evictable_leaf(self, node: HostTierNode) -> bool:
        return not any(c.value is not None for c in node.children.values())

    def _on_device(self, node: HostTierNode) -> bool:
        return node.value is not None

    def _is_current(self, entry: tuple[tuple, HostTierNode]) -> bool:
        return entry[1].value is not None and super()._is_current(entry)

    def _became_device(self, node: HostTierNode) -> None:
        """node (unlocked) just got device slots: count them as evictable."""
        if self.block_listener is not None:
            self.block_listener("stored", GPU, node)
        self.evictable_size += len(node.key)
        if node.waiters:
            self.waited_evictable_size += len(node.key)

    def _drop_device(self, node: HostTierNode) -> None:
        """Free the device slots of an unlocked device leaf that has a host copy; it stays in the tree."""
        if self.block_listener is not None:
            self.block_listener("removed", GPU, node)
        self.evictable_size -= len(node.key)
        if node.waiters:
            self.waited_evictable_size -= len(node.key)
        self.allocator.free_slots(node.value)
        node.value = None
        parent = node.parent
        if parent is not self.root and parent.lock_ref == 0 and self._evictable_leaf(parent):
            self._push(parent)

    # ------------------------------------------------------------------ lookup
    def host_part(self, length: int, node: HostTierNode) -> tuple[int, bool]:
        """Of a match of `length` tokens ending in node (from peek): how many are not on the device
        ready to use, and whether a load of some of them is in flight."""
        path = []
        while node is not self.root:
            path.append(node)
            node = node.parent
        device_end, loading = 0, False
        for node in reversed(path):
            if self._ready(node):
                device_end += len(node.key)
            elif self._loading(node):
                loading = True
        return max(0, length - device_end), loading

    def tier_stats(self) -> dict[str, float]:
        copies = self.copier.stats
        storage = self.storage.stats() if self.storage is not None else {}
        return {**storage, "host_pool_tokens": self.host_allocator.total_tokens,
                "host_free_tokens": self.host_allocator.free_tokens, "host_cached_tokens": self.host_size,
                "loading_tokens": self.loading_tokens,
                "loaded_tokens": copies.loaded_tokens, "loaded_bytes": copies.loaded_bytes,
                "written_back_bytes": copies.written_back_bytes, "load_bandwidth_gbps": copies.load_bandwidth / 1e9}

    # ------------------------------------------------------------------ loads
    def load(self, tokens: Sequence[int], *, spare_only: bool, namespace: Optional[str] = None) -> int:
        """Start copying the host part of tokens' cached prefix back to the device; returns the
        tokens now loading (0: none on the host, or no device room). spare_only: take only free
        slots and tree tokens no waiting request will reuse."""
        path = []
        for node, n, _ in self._walk(tokens, namespace):
            if self._loading(node):
                return 0  # already on its way: the caller waits for it
            if n < len(node.key) and node.value is None:
                node = self._split(node, n)
            path.append(node)
        segment = [n for n in path if n.value is None]
        if not segment:
            return 0
        frontier = segment[0].parent
        need = sum(len(n.key) for n in segment)
        self.inc_lock(frontier)  # the device part must stay while room is made
        busy = [n.host_seq for n in segment]
        for n in segment:
            n.host_seq = _RESERVED  # host eviction (for write-backs) must not drop what we will read
        spare = self.reclaimable_size if spare_only else self.evictable_size
        ok = self.allocator.free_tokens + spare >= need and self._ensure_free(need)
        for n, seq in zip(segment, busy):
            n.host_seq = seq
        if not ok:
            self.dec_lock(frontier)
            for n in segment:
                self._push_host(n)  # host eviction may have passed over them meanwhile
            return 0
        slots = self.allocator.pages_to_slots(self.allocator.alloc_pages(need // self.page_size))
        seq = self.copier.load(torch.cat([n.host_value for n in segment]), slots)
        tick = self._next_tick()
        offset = 0
        for n in segment:
            n.value = slots[offset:offset + len(n.key)].clone()
            offset += len(n.key)
            n.loading_seq = n.host_seq = seq
            n.last_access = tick
            self._became_device(n)
        self.inc_lock(segment[-1])
        self.dec_lock(frontier)
        self._loads.append((seq, segment[-1], need))
        self._busy.append((seq, segment))
        self.loading_tokens += need
        return need

    def _ensure_free(self, tokens: int) -> bool:
        short = tokens - self.allocator.free_tokens
        if short > 0:
            self.evict(short)
        return self.allocator.free_tokens >= tokens

    def poll(self) -> bool:
        """Take in the copies done since the last poll (and the storage tier's finished reads); True
        when a load finished."""
        read = self.storage is not None and self.storage.poll()
        return self._take_in_copies() or read

    def fetch(self, key: str, tokens: Callable[[], Sequence[int]], matched: int, *,
              namespace: Optional[str] = None) -> bool:
        """Whether the waiting request `key` waits for the storage tier to read more of its prefix
        than the `matched` tokens the tree has (disk_tier.StorageTier.fetch)."""
        if self.storage is None:
            return False
        return self.storage.fetch(key, tokens, matched, namespace, self.attach_host)

    def attach_host(self, tokens: Sequence[int], start: int, rows: torch.Tensor, namespace: Optional[str]) -> int:
        """Put tokens[start:] (whole pages; rows: their KV in the host pool's layout, read from the
        storage tier) into the tree as a host-only leaf under the cached path of tokens[:start];
        the tokens added (0: that path is no longer cached, or the host tier has no room)."""
        top = self._namespace_root(namespace, create=True)
        node, pos = top, 0
        for child, n, child_pos in self._walk(tokens, namespace):
            node, pos = (child if n == len(child.key) else self._split(child, n)), child_pos + n
        need = len(tokens) - pos
        host = self._host_slots(need) if start <= pos < len(tokens) else None
        if host is None or node.removed:  # node, a host-only leaf, may have gone for room
            if host is not None:
                self.host_allocator.free_slots(host)
            self._drop_namespace_if_empty(top)
            return 0
        self.host_pool.buffer[host] = rows.view(-1, *self.host_pool.buffer.shape[1:])[pos - start:]
        leaf = self.node_type(list(tokens[pos:]), None, node, self._next_tick(), next(self._ids))
        leaf.host_value = host
        node.children[self._child_key(tokens, pos)] = leaf
        self.num_nodes += 1
        self.host_size += need
        self._stored_on_host(leaf)
        self._push_host(leaf)
        self.touched.add((node, self._child_key(tokens, pos)))
        self._publish_insert(tokens, namespace)
        return need

    def _take_in_copies(self) -> bool:
        """poll's work: only this, where a lookup waits for a load (a cache keeping more state does
        more at a poll, at the start of a step's scheduling only)."""
        done = self.copier.poll()
        while self._busy and self._busy[0][0] <= done:
            for node in self._busy.popleft()[1]:
                self._push_host(node)
        finished = False
        while self._loads and self._loads[0][0] <= done:
            _, last, tokens = self._loads.popleft()
            self.loading_tokens -= tokens
            self.dec_lock(last)
            finished = True
        return finished

    def _finish_loads_on(self, tokens: Sequence[int], namespace: Optional[str]) -> None:
        seq = max((n.loading_seq for n, _, _ in self._walk(tokens, namespace) if self._loading(n)), default=0)
        if seq:
            self.copier.wait(seq)
            self._take_in_copies()

    # ------------------------------------------------------------------ mutation
    def _split(self, node: HostTierNode, n: int) -> HostTierNode:
        parent = node.parent
        assert parent is not None
        value = node.value[:n].clone() if node.value is not None else None
        upper = self.node_type(node.key[:n], value, parent, node.created, next(self._ids))
        upper.lock_ref, upper.last_access, upper.hit_count = node.lock_ref, node.last_access, node.hit_count
        upper.waiters, upper.host_seq, upper.loading_seq = node.waiters, node.host_seq, node.loading_seq
        upper.snapshots_below = node.snapshots_below
        if node.host_value is not None:
            upper.host_value = node.host_value[:n].clone()
            node.host_value = node.host_value[n:].clone()
            if self._host_busy(node):  # offered to host eviction with node once its copy is done
                next(nodes for seq, nodes in self._busy if seq == node.host_seq).append(upper)
            else:
                self._push_host(upper)
        parent.children[self._child_key(node.key, 0)] = upper
        node.key = node.key[n:]
        if node.value is not None:
            node.value = node.value[n:].clone()
        node.parent = upper
        upper.children[self._child_key(node.key, 0)] = node
        self.num_nodes += 1
        self.touched.add((node, PARTIAL))
        return upper

    def insert(self, tokens: Sequence[int], slots: Sequence[int] | torch.Tensor, *,
               namespace: Optional[str] = None) -> int:
        """As RadixCache.insert; a host-only node on the path takes the caller's slots (the caller
        computed those tokens itself), so the returned length is where the device copies end."""
        assert len(tokens) % self.page_size == 0 and len(tokens) == len(slots)
        top = self._namespace_root(namespace, create=bool(tokens))
        if top is None:
            return 0
        self._finish_loads_on(tokens, namespace)  # their slots must hold their KV before they count as cached
        tick = self._next_tick()
        node, pos, device_end = top, 0, 0
        for child, n, child_pos in self._walk(tokens, namespace):
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = tick
            if child.value is None:
                child.value = slots_tensor(slots, child_pos, child_pos + n)
                self._became_device(child)
                self._push_host(child)  # its host copy may go now, whatever its children
                if self._evictable_leaf(child):
                    self._push(child)
            else:
                device_end = child_pos + n
            node, pos = child, child_pos + n
        if pos < len(tokens):
            leaf = self._add_leaf(node, tokens, pos, slots, tick, namespace)
            if self.write_through:
                self._write_through(leaf)
        elif node is not self.root and self._evictable_leaf(node) and node.lock_ref == 0:
            self._push(node)
        return device_end

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """Free device slots of unlocked device leaves in policy order; each keeps (or gets, by a
        write-back) a host copy. Without host room a childless node leaves the tree as without a tier."""
        freed = 0
        copies: list[tuple[HostTierNode, torch.Tensor]] = []
        skipped: list[tuple[tuple, HostTierNode]] = []
        while freed < num_tokens and self._heap:
            entry = heapq.heappop(self._heap)
            if not self._is_current(entry):
                continue
            node = entry[1]
            if node.host_value is None:
                host = self._host_slots(len(node.key))
                if host is None:  # no host room: the node leaves the tree, with its host-only subtree
                    if not self._remove_subtree(node):
                        skipped.append(entry)  # a copy is using part of the subtree: not now
                        continue
                    freed += len(node.key)
                    continue
                node.host_value = host
                node.host_seq = _RESERVED  # busy from now: the copy into it is issued below
                self.host_size += len(node.key)
                self._stored_on_host(node)
                copies.append((node, node.value))
            freed += len(node.key)
            self._drop_device(node)
        # The freed slots are reused only by work launched after this copy reads them.
        if copies:
            self._copy_out([n for n, _ in copies], [v for _, v in copies])
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        self.counters.evicted_tokens += freed
        return freed

    def _copy_out(self, nodes: list[HostTierNode], device_slots: list[torch.Tensor]) -> None:
        """Issue the device-to-host copy of nodes whose host slots are set."""
        seq = self.copier.write_back(torch.cat(device_slots), torch.cat([n.host_value for n in nodes]))
        for n in nodes:
            n.host_seq = seq
        self._busy.append((seq, nodes))

    def _write_through(self, node: HostTierNode) -> None:
        """Copy a just-cached node to the host now (it stays device-only when the host has no room)."""
        host = self._host_slots(len(node.key))
        if host is not None:
            node.host_value = host
            self.host_size += len(node.key)
            self._stored_on_host(node)
            self._copy_out([node], [node.value])

    def _stored_on_host(self, node: HostTierNode) -> None:
        if self.block_listener is not None:
            self.block_listener("stored", CPU, node)

    def _remove_subtree(self, node: HostTierNode) -> bool:
        """Take an unlocked device leaf and its host-only descendants out of the tree, unless a
        copy is using one of them (False)."""
        below, stack = [], list(node.children.values())
        while stack:
            n = stack.pop()
            below.append(n)
            stack.extend(n.children.values())
        if any(self._host_busy(n) for n in below):
            return False
        for n in reversed(below):  # children before their parents
            self._remove_leaf(n)
        self._remove_leaf(node)
        return True

    def _remove_leaf(self, node: HostTierNode) -> int:
        """As the base, freeing the node's host copy too; the parent may now leave the host."""
        if node.host_value is not None:
            if self.block_listener is not None:
                self.block_listener("removed", CPU, node)
            self.host_allocator.free_slots(node.host_value)
            self.host_size -= len(node.key)
        tokens = super()._remove_leaf(node)
        if node.parent is not self.root:
            self._push_host(node.parent)
        return tokens

    # ------------------------------------------------------------------ the host pool
    def _host_priority(self, node: HostTierNode) -> tuple:
        return (node.waiters > 0, node.last_access)

    def _push_host(self, node: HostTierNode) -> None:
        if node.host_value is not None and not node.removed:
            heapq.heappush(self._host_heap, (self._host_priority(node), node))
            if len(self._host_heap) > 4 * self.num_nodes + 1024:
                current = {n: (self._host_priority(n), n) for _, n in self._host_heap if self._host_evictable(n)}
                self._host_heap = list(current.values())
                heapq.heapify(self._host_heap)

    def _host_evictable(self, node: HostTierNode) -> bool:
        """A host copy that may go: not in use by a copy, and not the only copy of a node with children."""
        return (node.host_value is not None and not node.removed and not self._host_busy(node)
                and (node.value is not None or not node.children))

    def _host_slots(self, tokens: int) -> Optional[torch.Tensor]:
        """Host slots for tokens, dropping host copies in LRU order (waited-for ones last) if needed."""
        short = tokens - self.host_allocator.free_tokens
        while short > 0 and self._host_heap:
            prio, node = heapq.heappop(self._host_heap)
            if not self._host_evictable(node):
                continue  # offered again when its copy is done or its last child leaves
            if prio != self._host_priority(node):
                self._push_host(node)
                continue
            short -= len(node.key)
            if self.storage is not None:
                self.storage.save(node, node.host_value)
            if node.value is not None:
                if self.block_listener is not None:
                    self.block_listener("removed", CPU, node)
                self.host_allocator.free_slots(node.host_value)
                node.host_value = None
                self.host_size -= len(node.key)
            else:
                self._remove_leaf(node)
        return self.host_pool.alloc(tokens)

    def flush(self) -> bool:
        self.copier.wait_all()
        self.poll()  # finished loads unlock their nodes
        return super().flush()

    def _free_node_slots(self, node: HostTierNode) -> None:
        if node.value is not None:
            self.allocator.free_slots(node.value)
        if node.host_value is not None:
            self.host_allocator.free_slots(node.host_value)

    # ------------------------------------------------------------------ checks
    def check_invariants(self, held_by_running: int = 0, running_slots: Sequence[torch.Tensor] = (),
                         running_rows: Sequence[int] = ()) -> None:
        """The device pool as without a tier (host-only nodes hold no device slot), the device nodes
        a tree from the root, and the host pool's free + evictable + busy == total with no host slot
        owned twice."""
        super().check_invariants(held_by_running, running_slots, running_rows)
        host_slots, busy = [], 0
        for node in self.iter_nodes():
            if node is self.root:
                continue
            assert node.value is not None or node.host_value is not None, f"{node} is on neither tier"
            if node.value is not None and node.parent is not self.root:
                assert node.parent.value is not None, f"{node} is on the device under a host-only parent"
            assert node.value is not None or node.lock_ref == 0, f"{node} is locked but not on the device"
            assert not self._loading(node) or node.lock_ref > 0, f"{node} is loading but not locked"
            if node.host_value is not None:
                assert len(node.host_value) == len(node.key), f"{node}: host key/value length mismatch"
                host_slots.append(node.host_value)
                busy += len(node.key) if self._host_busy(node) else 0
        offered = {n for _, n in self._host_heap}
        for node in self.iter_nodes():
            assert not self._host_evictable(node) or node in offered, f"{node}'s host copy can never be evicted"
        total = self.host_allocator.total_tokens
        held = sum(len(s) for s in host_slots)
        assert held == self.host_size, f"host counter {self.host_size} != {held}"
        free = self.host_allocator.free_tokens
        assert free + (held - busy) + busy == total, (
            f"host: free {free} + evictable {held - busy} + busy {busy} != {total}")
        check_slot_ownership(host_slots + [self.host_allocator.free_slot_tensor()], total, self.page_size, "host")

