"""Routing policies: pick one of the healthy workers for a request.

Every policy returns `(worker, decision)`. `decision` is what the router's metrics count:
- `matched`: a worker's tree covers at least `cache_threshold` of the prompt;
- `balanced`: loads were imbalanced, so the least-loaded worker was taken regardless of prefixes;
- `fallback`: no worker matched enough; the least-loaded one was taken;
- `direct`: a policy that does not look at prefixes (round_robin, random, power_of_two).

For `balanced` (one cost per worker, cache saving against load), `matched` means the cheapest worker
also had the longest match, `balanced` that load outweighed a long enough match elsewhere, and
`fallback` that no worker matched enough.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Optional

from radixserve.router.prefix_tree import Key
from radixserve.router.workers import Worker

POLICIES = ("round_robin", "random", "power_of_two", "cache_aware", "kv_aware", "balanced")
DECISIONS = ("matched", "balanced", "fallback", "direct")


@dataclass
class RoutingKeys:
    """What a request is matched on: `text` for cache_aware, `tokens` for kv_aware."""
    text: Optional[Key]
    tokens: Optional[list[int]]


@dataclass
class BalanceConfig:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    # balanced: what one symbol of outstanding work on a worker costs against one symbol of prompt
    # the worker would have to compute now because it is not cached there. At 1.0 every group
    # spread over every worker on a skewed workload (the in-flight counts differ by a request or
    # two at any time); at 0.25 a group moves only when a worker is several requests busier.
    load_weight: float = 0.25


class Policy:
    name = ""

    def choose(self, workers: list[Worker], keys: RoutingKeys) -> tuple[Worker, str]:
        raise NotImplementedError

    def key_of(self, keys: RoutingKeys) -> Optional[Key]:
        """The key this policy would remember for a request in flight (kv_aware only)."""
        return None


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, workers, keys):
        ordered = sorted(workers, key=lambda w: w.id)
        return ordered[next(self._counter) % len(ordered)], "direct"


class Random(Policy):
    name = "random"

    def __init__(self, rng: Optional[random.Random] = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, workers, keys):
        return self.rng.choice(workers), "direct"


class PowerOfTwo(Policy):
    name = "power_of_two"

    def __init__(self, rng: Optional[random.Random] = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, workers, keys):
        if len(workers) == 1:
            return workers[0], "direct"
        a, b = self.rng.sample(workers, 2)
        return (a if a.load <= b.load else b), "direct"


class _PrefixPolicy(Policy):
    def __init__(self, config: BalanceConfig) -> None:
        self.config = config
        self._counter = itertools.count()

    def imbalanced(self, workers: list[Worker]) -> bool:
        loads = [w.load for w in workers]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.config.balance_abs_threshold and hi > lo * self.config.balance_rel_threshold

    def least_loaded(self, workers: list[Worker]) -> Worker:
        # Ties go to the worker holding least (spreads new prefixes), then in turn.
        turn = next(self._counter)
        n = len(workers)
        return min(enumerate(sorted(workers, key=lambda w: w.id)),
                   key=lambda iw: (iw[1].load, self.held(iw[1]), (iw[0] - turn) % n))[1]

    def held(self, worker: Worker) -> int:
        raise NotImplementedError

    def match(self, worker: Worker, key: Key) -> int:
        raise NotImplementedError

    def route(self, workers: list[Worker], key: Optional[Key]) -> tuple[Worker, str]:
        if len(workers) > 1 and self.imbalanced(workers):
            return self.least_loaded(workers), "balanced"
        if key is not None and len(key):
            best, best_len = None, -1
            for w in sorted(workers, key=lambda w: (w.load, w.id)):
                n = self.match(w, key)
                if n > best_len:
                    best, best_len = w, n
            if best is not None and best_len >= self.config.cache_threshold * len(key) and best_len > 0:
                return best, "matched"
        return self.least_loaded(workers), "fallback"


class CacheAware(_PrefixPolicy):
    """SGLang's approach: an approximate tree per worker of what was routed there (by text)."""
    name = "cache_aware"

    def held(self, worker):
        return len(worker.tree)

    def match(self, worker, key):
        return worker.tree.match_len(key)

    def choose(self, workers, keys):
        key = keys.text if keys.text is not None else keys.tokens
        worker, decision = self.route(workers, key)
        if key is not None and len(key):
            worker.tree.insert(key)
        return worker, decision


class KvAware(_PrefixPolicy):
    """Routes on what each worker's radix cache really holds (its insert/evict events, by token
    ids), plus the prompts in flight there (cached as soon as their prefill runs)."""
    name = "kv_aware"

    def held(self, worker):
        return len(worker.mirror)

    def match(self, worker, key):
        return max(worker.mirror.match_len(key), worker.pending_match(key))

    def key_of(self, keys):
        return keys.tokens

    def choose(self, workers, keys):
        return self.route(workers, keys.tokens)


class Balanced(Policy):
    """One cost per worker: the prompt it would compute (not cached there) plus its load.

    cost(w) = (prompt - matched(w)) + load_weight * (outstanding(w) + in_flight(w) * mean prompt)

    `matched` is the approximate tree of what was routed to w (as cache_aware keeps it);
    `outstanding` the uncached prompt symbols of the requests in flight there (their prefill still
    to run); each request in flight also counts as one mean-sized prompt of work (its decode, and its
    hold on the worker's pool). A group of requests sharing a prefix stays on one worker while that
    worker is not busier than one uncomputed prefix's worth; past that, the group spreads to
    another worker, which then holds the prefix too. Symbols are characters for text keys and
    tokens for token-id prompts, like cache_aware's. Cost per request: one tree match per worker.
    """
    name = "balanced"
    MEAN_DECAY = 0.98  # the mean prompt length is a moving average over about 50 requests

    def __init__(self, config: BalanceConfig) -> None:
        self.config = config
        self._counter = itertools.count()
        self.mean_prompt = 0.0

    def cost(self, worker: Worker, prompt: int, matched: int) -> float:
        load = worker.outstanding_work + worker.load * self.mean_prompt
        return (prompt - matched) + self.config.load_weight * load

    def choose(self, workers, keys):
        key = keys.text if keys.text is not None else keys.tokens
        n = len(key) if key is not None else 0
        self.mean_prompt = n if self.mean_prompt == 0 else \
            self.MEAN_DECAY * self.mean_prompt + (1 - self.MEAN_DECAY) * n
        turn = next(self._counter)
        ordered = sorted(workers, key=lambda w: w.id)
        matches = [w.tree.match_len(key) if n else 0 for w in ordered]
        # ties go in turn, so equal workers share the new prefixes
        best = min(range(len(ordered)), key=lambda i: (self.cost(ordered[i], n, matches[i]),
                                                       (i - turn) % len(ordered)))
        worker, matched = ordered[best], matches[best]
        if n:
            worker.tree.insert(key)
        worker.assign_work(n - matched)
        def enough(m: int) -> bool:
            return m > 0 and m >= self.config.cache_threshold * n

        if enough(max(matches)) and matched < max(matches):
            return worker, "balanced"
        return worker, ("matched" if enough(matched) else "fallback")


def make_policy(name: str, config: BalanceConfig, seed: Optional[int] = None) -> Policy:
    rng = random.Random(seed)
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return Random(rng)
    if name == "power_of_two":
        return PowerOfTwo(rng)
    if name == "cache_aware":
        return CacheAware(config)
    if name == "kv_aware":
        return KvAware(config)
    if name == "balanced":
        return Balanced(config)
    raise ValueError(f"unknown policy {name!r}; use one of {', '.join(POLICIES)}")
