"""The host KV store: a node's KV copied to a host-memory pool (`TreeNode.host`, a `HostCopy`),
the tier under the device.

A node holds its tokens' KV on the device (`value`), on the host (`host`), or both. The nodes on
the device form a tree hanging from the root (a device node's parent is on the device), so every
match is a device part followed by a host part. Evicting a device leaf copies it to the host when
it has no host copy yet (write-back; `write_through` copies every new node at insert instead) and
frees its device slots; the node stays in the tree. Evicting from the host drops a host copy: of a
node also on the device, or of a host-only leaf, which then leaves the tree.

A load copies the host part of a match back: it takes device slots (evicting if it must), locks
the loading nodes like a running request would (so they cannot be evicted while the copy writes
them) and marks their host copies busy (so they cannot be dropped while the copy reads them).
`poll` unlocks them once the copy engine reports the copy done; only then is their KV usable for
a match. Write-backs mark the new host copy busy until their copy is done, too.

Sizes: the tree's counters count device tokens only, so `free + evictable + protected + held ==
total` still holds for the device pool; the host pool satisfies `free + evictable + busy == total`
(`check`).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from radixserve.cache.admission import Verdict
from radixserve.cache.host_pool import CopyEngine, CopyStats, HostKVPool
from radixserve.cache.prefix_cache import check_slot_ownership
from radixserve.cache.stores.device_kv import DeviceKV
from radixserve.cache.tree import CPU, RadixTree, TreeNode

if TYPE_CHECKING:
    from radixserve.cache.admission import Waiter
    from radixserve.cache.disk_tier import StorageTier

# HostCopy.seq of host copies a copy being prepared will use: busy until the copy is issued.
RESERVED = 1 << 62
# Loads started for one request at most: a prefix evicted again each time before its request got
# in is computed by that request instead of being copied back a fourth time.
MAX_LOADS_PER_REQUEST = 3


@dataclass(slots=True)
class HostCopy:
    """A node's KV in the host pool."""
    slots: torch.Tensor  # host slots, len == len(key)
    seq: int = 0  # the last copy that reads or writes them
    loading_seq: int = 0  # the copy that fills the node's device slots from them


class HostKV:
    ranks_eviction = False

    def __init__(self, host_pool: HostKVPool, copier: CopyEngine, *, page_size: int, write_through: bool = False):
        self.host_pool = host_pool
        self.host_allocator = host_pool.allocator
        self.copier: CopyEngine = copier
        self.page_size = page_size
        self.write_through = write_through
        self.tree: RadixTree
        self.device: DeviceKV
        self.make_room: Callable[[int], int]  # the cache's eviction (its counters count what it frees)
        # Loads in flight: (copy seq, the deepest loading node, tokens), in issue order.
        self._loads: deque[tuple[int, TreeNode, int]] = deque()
        self.loading_tokens = 0
        # Host copies in use by a copy: (copy seq, nodes), offered to host eviction once it is done.
        self._busy: deque[tuple[int, list[TreeNode]]] = deque()
        # The storage tier under this one (disk_tier.py; None: none): gets the host copies this
        # store drops, and its reads come back as host-only leaves (attach).
        self.storage: Optional[StorageTier] = None
        self.reset()

    def bind(self, tree: RadixTree, device: DeviceKV, make_room: Callable[[int], int]) -> None:
        self.tree, self.device, self.make_room = tree, device, make_room

    def reset(self) -> None:
        self.host_size = 0  # tokens with a host copy
        self._host_heap: list[tuple[tuple, TreeNode]] = []

    def reset_counters(self) -> None:
        self.copier.stats = CopyStats()

    # ------------------------------------------------------------------ node states
    def loading(self, node: TreeNode) -> bool:
        return node.host is not None and node.host.loading_seq > self.copier.done_seq

    def busy(self, node: TreeNode) -> bool:
        return node.host is not None and node.host.seq > self.copier.done_seq

    def reserved(self, node: TreeNode) -> bool:
        """A load or write-back being prepared will use node's host copy."""
        return node.host is not None and node.host.seq == RESERVED

    # ------------------------------------------------------------------ the tree's hooks
    def on_split(self, upper: TreeNode, lower: TreeNode, n: int) -> None:
        host = lower.host
        if host is None:
            return
        upper.host = HostCopy(host.slots[:n].clone(), host.seq, host.loading_seq)
        host.slots = host.slots[n:].clone()
        if self.busy(lower):  # offered to host eviction with the lower part once its copy is done
            next(nodes for seq, nodes in self._busy if seq == host.seq).append(upper)
        else:
            self._push_host(upper)

    def on_remove(self, node: TreeNode) -> None:
        if node.host is not None:
            tree = self.tree
            if tree.events is not None:
                tree.events.removed(CPU, node)
            self.host_allocator.free_slots(node.host.slots)
            self.host_size -= len(node.key)

    def after_remove(self, node: TreeNode, parent: TreeNode) -> None:
        if parent is not self.tree.root:
            self._push_host(parent)  # it may leave the host now

    def on_flush(self, node: TreeNode) -> None:
        if node.host is not None:
            self.host_allocator.free_slots(node.host.slots)

    def leaves_device(self, node: TreeNode) -> None:
        return None

    def eviction_rank(self, node: TreeNode) -> tuple:
        return ()

    # ------------------------------------------------------------------ lookups
    def host_part(self, length: int, node: TreeNode) -> tuple[int, bool]:
        """Of a match of `length` tokens ending in node (from peek): how many are not on the device
        ready to use, and whether a load of some of them is in flight."""
        root = self.tree.root
        path = []
        while node is not root:
            path.append(node)
            node = node.parent
        device_end, loading = 0, False
        for node in reversed(path):
            if node.value is not None and not self.loading(node):
                device_end += len(node.key)
            elif self.loading(node):
                loading = True
        return max(0, length - device_end), loading

    def admit(self, waiter: "Waiter", room: int, *, spare_only: bool,
              load: Callable[..., int]) -> tuple[Verdict, int]:
        """The host-load policy for a waiting request (admission.Admission): whether it may start on
        the device part of its cached prefix (READY), waits for more of it to be copied back from
        the storage tier or from this one (WAITS; the copy is started here, within `room` device
        tokens, when none is running), or could use a copy that finds no device room now
        (NO_ROOM). Returns the verdict and the device tokens a copy started here takes. load: the
        cache's `load` (it stops at the deepest position a resume can use)."""
        record = waiter.admission_record
        if self.storage is not None and self.storage.fetch(waiter.rid, waiter.match_target, waiter.peek_len,
                                                           waiter.cache_namespace, self):
            return Verdict.WAITS, 0  # more of its prefix is being read from the storage tier into this one
        peek_len = waiter.peek_len
        host, in_flight = self.host_part(peek_len, waiter.peek_node)
        if not host:
            return Verdict.READY, 0
        if in_flight:
            record.note_span(peek_len - host, peek_len)
            return Verdict.WAITS, 0
        if record.loads >= MAX_LOADS_PER_REQUEST:
            return Verdict.READY, 0
        if host > room:
            return Verdict.NO_ROOM, 0
        loaded = load(waiter.match_target(), spare_only=spare_only, namespace=waiter.cache_namespace)
        if not loaded:
            return Verdict.NO_ROOM, 0
        record.loads += 1
        record.note_span(peek_len - host, peek_len)
        return Verdict.WAITS, loaded

    def stats(self) -> dict[str, float]:
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
        tree = self.tree
        path = []
        for node, n, _ in tree.walk(tokens, namespace):
            if self.loading(node):
                return 0  # already on its way: the caller waits for it
            if n < len(node.key) and node.value is None:
                node = tree.split(node, n)
            path.append(node)
        segment = [n for n in path if n.value is None]
        if not segment:
            return 0
        frontier = segment[0].parent
        need = sum(len(n.key) for n in segment)
        tree.inc_lock(frontier)  # the device part must stay while room is made
        busy = [n.host.seq for n in segment]
        for n in segment:
            n.host.seq = RESERVED  # host eviction (for write-backs) must not drop what we will read
        spare = tree.reclaimable_size if spare_only else tree.evictable_size
        allocator = self.device.allocator
        ok = allocator.free_tokens + spare >= need and self._ensure_free(need)
        for n, seq in zip(segment, busy):
            n.host.seq = seq
        if not ok:
            tree.dec_lock(frontier)
            for n in segment:
                self._push_host(n)  # host eviction may have passed over them meanwhile
            return 0
        slots = allocator.pages_to_slots(allocator.alloc_pages(need // self.page_size))
        seq = self.copier.load(torch.cat([n.host.slots for n in segment]), slots)
        tick = tree.next_tick()
        offset = 0
        for n in segment:
            n.value = slots[offset:offset + len(n.key)].clone()
            offset += len(n.key)
            n.host.loading_seq = n.host.seq = seq
            n.last_access = tick
            tree.gained_device(n)
        tree.inc_lock(segment[-1])
        tree.dec_lock(frontier)
        self._loads.append((seq, segment[-1], need))
        self._busy.append((seq, segment))
        self.loading_tokens += need
        return need

    def _ensure_free(self, tokens: int) -> bool:
        allocator = self.device.allocator
        short = tokens - allocator.free_tokens
        if short > 0:
            self.make_room(short)
        return allocator.free_tokens >= tokens

    def take_in_copies(self) -> bool:
        """Take in the copies done since the last call; True when a load finished."""
        done = self.copier.poll()
        while self._busy and self._busy[0][0] <= done:
            for node in self._busy.popleft()[1]:
                self._push_host(node)
        finished = False
        while self._loads and self._loads[0][0] <= done:
            _, last, tokens = self._loads.popleft()
            self.loading_tokens -= tokens
            self.tree.dec_lock(last)
            finished = True
        return finished

    def finish_loads_on(self, tokens: Sequence[int], namespace: Optional[str]) -> None:
        """Wait for the loads on tokens' path: their slots must hold their KV before they count as cached."""
        seq = max((n.host.loading_seq for n, _, _ in self.tree.walk(tokens, namespace) if self.loading(n)),
                  default=0)
        if seq:
            self.copier.wait(seq)
            self.take_in_copies()

    def adopted(self, node: TreeNode) -> None:
        """A host-only node on an insert's path took the inserting request's slots: its host copy
        may go now, whatever its children."""
        self._push_host(node)

    def flush(self) -> None:
        """Before the tree is dropped: every copy done, and finished loads unlock their nodes."""
        self.copier.wait_all()
        self.take_in_copies()

    # ------------------------------------------------------------------ device eviction
    def evict_device(self, num_tokens: int) -> int:
        """Free device slots of unlocked device leaves in policy order; each keeps (or gets, by a
        write-back) a host copy. Without host room a childless node leaves the tree as without a tier."""
        tree = self.tree
        freed = 0
        copies: list[tuple[TreeNode, torch.Tensor]] = []
        skipped: list[tuple[tuple, TreeNode]] = []
        while freed < num_tokens:
            entry = tree.pop_evictable()
            if entry is None:
                break
            node = entry[1]
            if node.host is None:
                host = self._host_slots(len(node.key))
                if host is None:  # no host room: the node leaves the tree, with its host-only subtree
                    if not self._remove_subtree(node):
                        skipped.append(entry)  # a copy is using part of the subtree: not now
                        continue
                    freed += len(node.key)
                    continue
                node.host = HostCopy(host, RESERVED)  # busy from now: the copy into it is issued below
                self.host_size += len(node.key)
                self._stored_on_host(node)
                copies.append((node, node.value))
            freed += len(node.key)
            tree.leave_device(node)
        # The freed slots are reused only by work launched after this copy reads them.
        if copies:
            self._copy_out([n for n, _ in copies], [v for _, v in copies])
        tree.repush(skipped)
        return freed

    def _copy_out(self, nodes: list[TreeNode], device_slots: list[torch.Tensor]) -> None:
        """Issue the device-to-host copy of nodes whose host slots are set."""
        seq = self.copier.write_back(torch.cat(device_slots), torch.cat([n.host.slots for n in nodes]))
        for n in nodes:
            n.host.seq = seq
        self._busy.append((seq, nodes))

    def inserted(self, leaf: TreeNode) -> None:
        """A just-cached leaf: with write-through, copied to the host now (it stays device-only when
        the host has no room)."""
        if not self.write_through:
            return
        host = self._host_slots(len(leaf.key))
        if host is not None:
            leaf.host = HostCopy(host)
            self.host_size += len(leaf.key)
            self._stored_on_host(leaf)
            self._copy_out([leaf], [leaf.value])

    # ------------------------------------------------------------------ the storage tier's reads
    def reserve_slots(self, tokens: int) -> Optional[torch.Tensor]:
        """Host slots for a storage read of tokens (whole pages), making room as for a host copy;
        None: no room. They are the read's until `attach` takes them or `free_reserved` gives them back."""
        return self._host_slots(tokens)

    def copying(self) -> bool:
        """Copies between the tiers are in flight: the host copies they use may go once they are done."""
        return self.copier.issued_seq > self.copier.done_seq

    def free_reserved(self, slots: torch.Tensor) -> None:
        if len(slots):
            self.host_allocator.free_slots(slots)

    def attach(self, tokens: Sequence[int], start: int, slots: torch.Tensor, namespace: Optional[str]) -> int:
        """Hang tokens[start:] (whole pages, read from the storage tier into the reserved host slots
        `slots`) into the tree as a host-only leaf under the cached path of tokens[:start]; the
        tokens added (0: that path is no longer cached). Takes the slots: those it does not use
        (all of them, or the part the tree meanwhile holds) are freed."""
        tree = self.tree
        top = tree.namespace_root(namespace, create=True)
        node, pos = top, 0
        for child, n, child_pos in tree.walk(tokens, namespace):
            node, pos = (child if n == len(child.key) else tree.split(child, n)), child_pos + n
        need = len(tokens) - pos
        if not start <= pos < len(tokens) or node.removed:  # node, a host-only leaf, may have gone for room
            self.free_reserved(slots)
            tree.drop_namespace_if_empty(top)
            return 0
        self.free_reserved(slots[:pos - start])
        host = slots[pos - start:]
        leaf = tree.new_node(list(tokens[pos:]), None, node, tree.next_tick())
        leaf.host = HostCopy(host)
        node.children[tree.child_key(tokens, pos)] = leaf
        tree.num_nodes += 1
        self.host_size += need
        self._stored_on_host(leaf)
        self._push_host(leaf)
        tree.touched.add((node, tree.child_key(tokens, pos)))
        if tree.events is not None:
            tree.events.usable(leaf)
        return need

    def _stored_on_host(self, node: TreeNode) -> None:
        tree = self.tree
        if tree.events is not None:
            tree.events.stored(CPU, node)

    def _remove_subtree(self, node: TreeNode) -> bool:
        """Take an unlocked device leaf and its host-only descendants out of the tree, unless a
        copy is using one of them (False)."""
        below, stack = [], list(node.children.values())
        while stack:
            n = stack.pop()
            below.append(n)
            stack.extend(n.children.values())
        if any(self.busy(n) for n in below):
            return False
        tree = self.tree
        for n in reversed(below):  # children before their parents
            tree.remove_leaf(n)
        tree.remove_leaf(node)
        return True

    # ------------------------------------------------------------------ the host pool
    @staticmethod
    def _host_priority(node: TreeNode) -> tuple:
        return (node.waiters > 0, node.last_access)

    def _push_host(self, node: TreeNode) -> None:
        if node.host is not None and not node.removed:
            heapq.heappush(self._host_heap, (self._host_priority(node), node))
            if len(self._host_heap) > 4 * self.tree.num_nodes + 1024:
                current = {n: (self._host_priority(n), n) for _, n in self._host_heap if self._host_evictable(n)}
                self._host_heap = list(current.values())
                heapq.heapify(self._host_heap)

    def _host_evictable(self, node: TreeNode) -> bool:
        """A host copy that may go: not in use by a copy, and not the only copy of a node with children."""
        return (node.host is not None and not node.removed and not self.busy(node)
                and (node.value is not None or not node.children))

    def _host_slots(self, tokens: int) -> Optional[torch.Tensor]:
        """Host slots for tokens, dropping host copies in LRU order (waited-for ones last) if needed."""
        short = tokens - self.host_allocator.free_tokens
        tree = self.tree
        while short > 0 and self._host_heap:
            prio, node = heapq.heappop(self._host_heap)
            if not self._host_evictable(node):
                continue  # offered again when its copy is done or its last child leaves
            if prio != self._host_priority(node):
                self._push_host(node)
                continue
            short -= len(node.key)
            if self.storage is not None:
                self.storage.save(node, node.host.slots)
            if node.value is not None:
                if tree.events is not None:
                    tree.events.removed(CPU, node)
                self.host_allocator.free_slots(node.host.slots)
                node.host = None
                self.host_size -= len(node.key)
            else:
                tree.remove_leaf(node)
        return self.host_pool.alloc(tokens)

    # ------------------------------------------------------------------ checks
    def check(self, held_by_running: int, running_slots: Sequence[torch.Tensor], running_rows: Sequence[int]) -> None:
        """The device nodes a tree from the root, and the host pool's free + evictable + busy ==
        total with no host slot owned twice."""
        tree = self.tree
        host_slots, busy = [], 0
        for node in tree.iter_nodes():
            if node is tree.root:
                continue
            assert node.value is not None or node.host is not None, f"{node} is on neither tier"
            if node.value is not None and node.parent is not tree.root:
                assert node.parent.value is not None, f"{node} is on the device under a host-only parent"
            assert node.value is not None or node.lock_ref == 0, f"{node} is locked but not on the device"
            assert not self.loading(node) or node.lock_ref > 0, f"{node} is loading but not locked"
            if node.host is not None:
                assert len(node.host.slots) == len(node.key), f"{node}: host key/value length mismatch"
                host_slots.append(node.host.slots)
                busy += len(node.key) if self.busy(node) else 0
        offered = {n for _, n in self._host_heap}
        for node in tree.iter_nodes():
            assert not self._host_evictable(node) or node in offered, f"{node}'s host copy can never be evicted"
        total = self.host_allocator.total_tokens
        held = sum(len(s) for s in host_slots)
        assert held == self.host_size, f"host counter {self.host_size} != {held}"
        free = self.host_allocator.free_tokens
        reading = self.storage.reserved_slots() if self.storage is not None else []  # storage reads in flight
        read = sum(len(s) for s in reading)
        assert free + (held - busy) + busy + read == total, (
            f"host: free {free} + evictable {held - busy} + busy {busy} + storage reads {read} != {total}")
        check_slot_ownership(host_slots + reading + [self.host_allocator.free_slot_tensor()], total, self.page_size,
                             "host")
