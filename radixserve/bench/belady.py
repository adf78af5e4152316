"""Belady's MIN at the server's capacity: the best hit rate any eviction policy can reach on a
request sequence taken in the order it was sent.

The model (documented in docs/experiment.md):

- Requests are served in the order given (the order the client sent them). At most `running`
  requests run at once (default 1: each finishes before the next starts).
- A request looks its prompt up first; a lookup matches at most `len(prompt) - match_cap` tokens,
  in whole pages of `page_size` tokens (the server's radix cache works in pages).
- While it runs, a request holds its prompt (cached, matchable by later requests, never evicted)
  and room for its output (not matchable yet). When it finishes, prompt + output are cached and
  become evictable. A request's prompt + output is cut to the capacity.
- Prompt + output + cached tokens never exceed `capacity` tokens. To make room, the cached
  tokens whose next use (the next request whose lookup would match them) lies furthest in the
  future are evicted first, from the tail of a cached branch, token by token (page by page). When
  even evicting every evictable token is not enough, the oldest running requests finish early
  (the server would run fewer at once).

With `running=1` this is Belady's MIN over the pages, and MIN is optimal: no eviction policy
gets a higher hit rate on this order (the next use of a token is never earlier than that of the
token before it on its branch, so evicting the furthest tail keeps every cached branch a
prefix; tests/test_bench_oracle.py checks it against an exhaustive search over every eviction
choice on small traces). It is the optimum **for this order**: a scheduler that reorders requests (LPM) can in
principle exceed it, and a server running many requests at once holds more tokens and
reaches less. With `running > 1`, it is MIN's choice under those holds, not a proven optimum.

Per request, only whole nodes of a static trie over every sequence the run will see are
touched (the trie's node boundaries are all match and insert boundaries), so a cached branch is
one count per node and the next use of a node is one bisect into the sorted list of requests
whose lookup covers it: pure Python, seconds for a thousand requests of thousands of tokens.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Optional, Sequence

NEVER = float("inf")


@dataclass
class BeladyResult:
    prompt_tokens: int
    hit_tokens: int
    per_request_hits: list[int] = field(default_factory=list)
    evicted_tokens: int = 0
    early_finishes: int = 0  # running requests finished early because the holds did not fit
    capacity: int = 0
    page_size: int = 1
    running: int = 1

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class _Node:
    __slots__ = ("key", "children", "parent", "uses", "cached", "cached_children", "locks", "uid")

    def __init__(self, key: tuple, parent: Optional["_Node"], uid: int):
        self.key = key
        self.children: dict = {}
        self.parent = parent
        self.uses: list[int] = []  # indices of the requests whose lookup covers this node, ascending
        self.cached = 0  # symbols of key cached, from its start
        self.cached_children = 0
        self.locks = 0  # running requests holding this node
        self.uid = uid


def _common_len(a: tuple, b: tuple, b_off: int, n: int) -> int:
    """Longest common prefix of a[:n] and b[b_off:b_off + n], by slice comparisons (C speed)."""
    if a[:n] == b[b_off:b_off + n]:
        return n
    lo, hi = 0, n  # a[:lo] matches, a[:hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[b_off:b_off + mid]:
            lo = mid
        else:
            hi = mid
    return lo


class _StaticTrie:
    """A radix trie over symbol sequences with a node boundary at the end of each one inserted."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self.root = _Node((), None, next(self._ids))

    def insert(self, seq: tuple) -> None:
        node, i, n = self.root, 0, len(seq)
        while i < n:
            child = node.children.get(seq[i])
            if child is None:
                node.children[seq[i]] = _Node(seq[i:], node, next(self._ids))
                return
            m = _common_len(child.key, seq, i, min(len(child.key), n - i))
            if m < len(child.key):
                child = self._split(child, m)
            node, i = child, i + m

    def _split(self, node: _Node, m: int) -> _Node:
        upper = _Node(node.key[:m], node.parent, next(self._ids))
        node.parent.children[upper.key[0]] = upper
        node.key = node.key[m:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    def path(self, seq: tuple) -> list[_Node]:
        """The nodes spelling an inserted sequence exactly."""
        out, node, i = [], self.root, 0
        while i < len(seq):
            node = node.children[seq[i]]
            out.append(node)
            i += len(node.key)
        return out


def _pages(tokens: Sequence[int], page_size: int) -> tuple:
    if page_size == 1:
        return tuple(tokens)
    n = len(tokens) - len(tokens) % page_size
    return tuple(tuple(tokens[i:i + page_size]) for i in range(0, n, page_size))


class _Simulation:
    def __init__(self, trie: _StaticTrie, capacity: int):
        self.capacity = capacity
        self.size = 0  # cached symbols
        self.held = 0  # symbols reserved for outputs of running requests
        self.leaves: set[_Node] = set()  # cached nodes without a cached child
        self.evicted = 0
        self.root = trie.root

    def match(self, path: list[_Node]) -> int:
        hit = 0
        for node in path:
            hit += node.cached
            if node.cached < len(node.key):
                break
        return hit

    def cache(self, path: list[_Node]) -> None:
        for node in path:
            if node.cached == len(node.key):
                continue
            if node.cached == 0:
                parent = node.parent
                if parent is not self.root:
                    parent.cached_children += 1
                    self.leaves.discard(parent)
                if node.cached_children == 0:
                    self.leaves.add(node)
            self.size += len(node.key) - node.cached
            node.cached = len(node.key)

    def missing(self, path: list[_Node]) -> int:
        return sum(len(n.key) - n.cached for n in path)

    def evict(self, need: int, now: int) -> int:
        """Free up to `need` symbols, furthest next use first; returns how many were freed."""
        def entry(node: _Node):
            k = bisect.bisect_right(node.uses, now)
            nxt = node.uses[k] if k < len(node.uses) else NEVER
            return (-nxt, node.uid, node)

        heap = [entry(n) for n in self.leaves if n.locks == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < need and heap:
            _, _, node = heapq.heappop(heap)
            take = min(node.cached, need - freed)
            node.cached -= take
            freed += take
            if node.cached:
                continue
            self.leaves.discard(node)
            parent = node.parent
            if parent is not self.root:
                parent.cached_children -= 1
                if parent.cached_children == 0:
                    self.leaves.add(parent)
                    if parent.locks == 0:
                        heapq.heappush(heap, entry(parent))
        self.size -= freed
        self.evicted += freed
        return freed


@dataclass
class _Run:
    prompt_path: list[_Node]
    full_path: list[_Node]
    output_room: int


def belady_hit_rate(requests: Sequence, capacity: int, *, page_size: int = 1, running: int = 1,
                    match_cap: int = 1) -> BeladyResult:
    """MIN over `requests` (objects with `.prompt` and `.output` token lists) in their order.

    `capacity` and the hits are in tokens; see the module docstring for the model.
    """
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if running < 1:
        raise ValueError(f"running must be >= 1, got {running}")
    cap = capacity // page_size
    trie = _StaticTrie()
    targets, fulls, prompts = [], [], []
    for req in requests:
        prompt = list(req.prompt)
        targets.append(_pages(prompt[: max(0, len(prompt) - match_cap)], page_size))
        full = _pages(prompt + list(req.output), page_size)[:cap]
        fulls.append(full)
        prompts.append(full[: len(prompt) // page_size])
        for seq in (targets[-1], full, prompts[-1]):
            trie.insert(seq)
    for j, target in enumerate(targets):
        for node in trie.path(target):
            node.uses.append(j)

    sim = _Simulation(trie, cap)
    result = BeladyResult(prompt_tokens=0, hit_tokens=0, capacity=capacity, page_size=page_size, running=running)
    active: collections.deque[_Run] = collections.deque()

    def finish(run: _Run) -> None:
        sim.held -= run.output_room
        sim.cache(run.full_path)
        for node in run.prompt_path:
            node.locks -= 1

    for j, req in enumerate(requests):
        while len(active) >= running:
            finish(active.popleft())
        hit = sim.match(trie.path(targets[j])) * page_size
        result.prompt_tokens += len(req.prompt)
        result.hit_tokens += hit
        result.per_request_hits.append(hit)
        run = _Run(trie.path(prompts[j]), trie.path(fulls[j]), len(fulls[j]) - len(prompts[j]))
        for node in run.prompt_path:
            node.locks += 1
        while True:
            excess = sim.size + sim.held + sim.missing(run.prompt_path) + run.output_room - sim.capacity
            if excess <= 0 or (sim.evict(excess, j) >= excess):
                break
            if not active:  # cannot happen: the request alone is cut to the capacity
                raise AssertionError("a request's holds exceed the capacity")
            finish(active.popleft())
            result.early_finishes += 1
        sim.cache(run.prompt_path)
        sim.held += run.output_room
        active.append(run)
    result.evicted_tokens = sim.evicted * page_size
    return result
