"""The oracle prefix hit rate: the best a prefix cache could do on a request sequence.

The model (documented in docs/experiment.md):

- Requests are taken in the order they are issued (the dataset's arrival order). Each request
  first looks its prompt up in the cache, then, as if it had finished before the next request
  arrives, its prompt + output tokens are inserted.
- A lookup may match at most `len(prompt) - 1` tokens (`match_cap=1`): the last prompt token must
  be computed to get the logits of the first output token, as in radixserve and SGLang.
- The hit rate is sum(matched tokens) / sum(prompt tokens).
- **Unlimited capacity**: nothing is ever evicted, so each request matches its longest common
  token prefix with any earlier request's prompt + output.
- **Server capacity**: a radix tree of at most `capacity` tokens (the server's KV pool). Before an
  insert needs room, least recently used leaves are evicted (LRU over last lookup/insert time);
  the path the current request matched is protected. Tokens held by running requests outside the
  tree are not modelled, so this is an upper bound for a server with the same pool.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Optional, Sequence


@dataclass
class OracleRequest:
    prompt: Sequence[int]
    output: Sequence[int] = ()


@dataclass
class OracleResult:
    prompt_tokens: int
    hit_tokens: int
    per_request_hits: list[int] = field(default_factory=list)
    evicted_tokens: int = 0
    capacity: Optional[int] = None

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class _Node:
    __slots__ = ("key", "children", "parent", "last_access", "uid")
    _ids = itertools.count()

    def __init__(self, key: tuple[int, ...], parent: Optional["_Node"]):
        self.key = key
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last_access = 0
        self.uid = next(_Node._ids)


class SimRadixCache:
    """A token radix tree with a capacity in tokens and LRU leaf eviction (no KV, counts only)."""

    def __init__(self, capacity: Optional[int] = None):
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.root = _Node((), None)
        self.size = 0
        self.clock = 0
        self.evicted = 0

    def _walk(self, tokens: Sequence[int], touch: bool) -> tuple[int, list[_Node]]:
        """Length of the longest cached prefix of tokens, and the nodes fully or partly on it."""
        node, i, path = self.root, 0, []
        n = len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                break
            key = child.key
            j = 0
            while j < len(key) and i + j < n and key[j] == tokens[i + j]:
                j += 1
            path.append(child)
            if touch:
                child.last_access = self.clock
            i += j
            if j < len(key):
                break
            node = child
        return i, path

    def match(self, tokens: Sequence[int]) -> int:
        self.clock += 1
        return self._walk(tokens, touch=True)[0]

    def insert(self, tokens: Sequence[int], protect: Sequence[_Node] = ()) -> int:
        """Insert tokens (truncated to the capacity); returns how many were new.

        The prefix already cached is protected from the eviction that makes room (a node matched
        only partly is split first, so its unmatched tail can go), and so are `protect`'s nodes.
        """
        self.clock += 1
        tokens = tuple(tokens if self.capacity is None else tokens[: self.capacity])
        matched, path = self._walk(tokens, touch=True)
        new = len(tokens) - matched
        if new == 0:
            return 0
        if self.capacity is not None and self.size + new > self.capacity:
            _, path = self._split_at(matched, path)
            self._evict(self.size + new - self.capacity, set(map(id, path)) | set(map(id, protect)))
            matched, path = self._walk(tokens, touch=True)  # eviction never touches the path
            new = len(tokens) - matched
        parent, _ = self._split_at(matched, path)
        rest = tokens[matched:]
        leaf = _Node(rest, parent)
        leaf.last_access = self.clock
        parent.children[rest[0]] = leaf
        self.size += new
        return new

    def _split_at(self, matched: int, path: list[_Node]) -> tuple[_Node, list[_Node]]:
        """Split the node the match ends inside; returns the node the match ends at and its path."""
        parent, consumed, full = self.root, 0, []
        for node in path:
            if consumed + len(node.key) <= matched:
                parent, consumed = node, consumed + len(node.key)
                full.append(node)
                continue
            if matched == consumed:
                break
            cut = matched - consumed
            upper = _Node(node.key[:cut], parent)
            upper.last_access = self.clock
            parent.children[upper.key[0]] = upper
            node.key = node.key[cut:]
            node.parent = upper
            upper.children[node.key[0]] = node
            full.append(upper)
            parent = upper
            break
        return parent, full

    def _evict(self, need: int, protected: set[int]) -> None:
        def leaves():
            stack = [self.root]
            while stack:
                node = stack.pop()
                if node is not self.root and not node.children:
                    yield node
                stack.extend(node.children.values())

        heap = [(n.last_access, n.uid, n) for n in leaves() if id(n) not in protected]
        heapq.heapify(heap)
        freed = 0
        while freed < need and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key[0]]
            freed += len(node.key)
            self.size -= len(node.key)
            self.evicted += len(node.key)
            if parent is not self.root and not parent.children and id(parent) not in protected:
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))


def oracle_hit_rate(requests: Sequence[OracleRequest], capacity: Optional[int] = None,
                    match_cap: int = 1) -> OracleResult:
    """Simulate the cache over requests in order; capacity None is unlimited."""
    cache = SimRadixCache(capacity)
    result = OracleResult(prompt_tokens=0, hit_tokens=0, capacity=capacity)
    for req in requests:
        prompt = list(req.prompt)
        target = prompt[: max(0, len(prompt) - match_cap)]
        hit = cache.match(target)
        result.prompt_tokens += len(prompt)
        result.hit_tokens += hit
        result.per_request_hits.append(hit)
        cache.insert(prompt + list(req.output))
    result.evicted_tokens = cache.evicted
    return result
