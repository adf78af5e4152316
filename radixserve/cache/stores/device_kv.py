"""The device KV store: each node's KV slots in the device pool (`TreeNode.value`).

The device part of the tree hangs from the root (a device node's parent is on the device); its
tokens are what the tree's counters count and what its eviction order frees. A split cuts the
slots with the key; a node leaving the tree, or leaving the device while a lower tier keeps it,
gives its slots back to the page allocator."""

from __future__ import annotations

from typing import Sequence

import torch

from radixserve.cache.kv_pool import PageAllocator
from radixserve.cache.prefix_cache import check_slot_ownership
from radixserve.cache.tree import NAMESPACE, RadixTree, TreeNode


class DeviceKV:
    ranks_eviction = False

    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self.tree: RadixTree  # set by the cache that holds both

    # ------------------------------------------------------------------ the tree's hooks
    def on_split(self, upper: TreeNode, lower: TreeNode, n: int) -> None:
        if lower.value is not None:
            upper.value = lower.value[:n].clone()
            lower.value = lower.value[n:].clone()

    def on_remove(self, node: TreeNode) -> None:
        if node.value is not None:
            self.tree.lost_device(node)
            self.allocator.free_slots(node.value)

    def after_remove(self, node: TreeNode, parent: TreeNode) -> None:
        return None

    def on_flush(self, node: TreeNode) -> None:
        if node.value is not None:
            self.allocator.free_slots(node.value)

    def leaves_device(self, node: TreeNode) -> None:
        """Free the device slots of an unlocked device leaf a lower tier keeps; it stays in the tree."""
        self.tree.lost_device(node)
        self.allocator.free_slots(node.value)
        node.value = None
        parent = node.parent
        if parent is not self.tree.root:
            self.tree.push_if_evictable(parent)

    def eviction_rank(self, node: TreeNode) -> tuple:
        return ()

    def reset(self) -> None:
        return None

    def reset_counters(self) -> None:
        return None

    def all_slots(self) -> list[torch.Tensor]:
        return [n.value for n in self.tree.iter_nodes() if n is not self.tree.root and n.value is not None]

    def check(self, held_by_running: int, running_slots: Sequence[torch.Tensor], running_rows: Sequence[int]) -> None:
        """Sizes add up to the pool, no slot is owned twice, locks and pages are consistent."""
        tree = self.tree
        evictable = protected = waited = 0
        for node in tree.iter_nodes():
            if node is tree.root:
                continue
            assert not node.removed, f"{node} is in the tree but marked removed"
            if node.namespace is not None:
                assert node.parent is tree.root and tree.root.children.get((NAMESPACE, node.namespace)) is node
                assert not node.key and node.lock_ref >= 1, f"{node}: a namespace root holds tokens or is unlocked"
                assert node.children or node.lock_ref > 1 or node.waiters, f"{node}: an empty namespace root is kept"
                continue
            assert len(node.key) % self.page_size == 0 and node.key, f"{node}: not whole pages"
            assert node.parent.children.get(tree.child_key(node.key, 0)) is node, f"{node}: bad parent link"
            if node.parent is not tree.root:
                assert node.parent.lock_ref >= node.lock_ref, f"{node}: locked more than its parent"
            if node.value is None:
                continue  # a lower tier's node: its store checks it
            assert len(node.key) == len(node.value), f"{node}: key/value length mismatch"
            if node.waiters and not node.lock_ref:
                waited += len(node.key)
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert evictable == tree.evictable_size, f"evictable counter {tree.evictable_size} != {evictable}"
        assert protected == tree.protected_size, f"protected counter {tree.protected_size} != {protected}"
        assert waited == tree.waited_evictable_size, f"waited counter {tree.waited_evictable_size} != {waited}"
        total = self.allocator.total_tokens
        free = self.allocator.free_tokens
        assert free + evictable + protected + held_by_running == total, (
            f"free {free} + evictable {evictable} + protected {protected} + held {held_by_running} != {total}")
        owned = self.all_slots() + [self.allocator.free_slot_tensor()] + list(running_slots)
        check_slot_ownership(owned, total, self.page_size)
