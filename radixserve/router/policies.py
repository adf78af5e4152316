"""Routing policies: pick one of the healthy workers for a request.

Every policy returns `(worker, decision)`. `decision` is what the router's metrics count:
- `matched`: a worker's tree covers at least `cache_threshold` of the prompt;
- `balanced`: loads were imbalanced, so the least-loaded worker was taken regardless of prefixes;
- `fallback`: no worker matched enough; the least-loaded one was taken;
- `direct`: a policy that does not look at prefixes (round_robin, random, power_of_two).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Optional

from radixserve.router.prefix_tree import Key
from radixserve.router.workers import Worker

POLICIES = ("round_robin", "random", "power_of_two", "cache_aware", "kv_aware")
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
    raise ValueError(f"unknown policy {name!r}; use one of {', '.join(POLICIES)}")
