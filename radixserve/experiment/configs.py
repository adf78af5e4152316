"""The experiment's configurations: server flags per row, the router rows, the default workload."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from radixserve.bench.oracle import SimRadixCache


@dataclass
class Config:
    name: str
    server_args: list[str]
    small_pool: bool = False
    description: str = ""
    router_policy: Optional[str] = None  # set: a router with this policy over the router workers


def all_configs() -> list[Config]:
    return [
        Config("lpm", ["--schedule-policy", "lpm", "--radix-eviction-policy", "lru"],
               description="LPM scheduling, radix cache on (LRU)"),
        Config("fcfs", ["--schedule-policy", "fcfs", "--radix-eviction-policy", "lru"],
               description="FCFS scheduling, radix cache on (LRU)"),
        Config("no-radix", ["--schedule-policy", "fcfs", "--disable-radix-cache"],
               description="radix cache off (every prompt computed in full)"),
        Config("lpm-small-pool", ["--schedule-policy", "lpm", "--radix-eviction-policy", "lru"], small_pool=True,
               description="LPM, LRU eviction, small KV pool"),
        Config("fcfs-small-pool", ["--schedule-policy", "fcfs", "--radix-eviction-policy", "lru"], small_pool=True,
               description="FCFS, LRU eviction, small KV pool"),
        Config("lpm-fifo-small-pool", ["--schedule-policy", "lpm", "--radix-eviction-policy", "fifo"],
               small_pool=True, description="LPM, FIFO eviction, small KV pool"),
        Config("lpm-hicache-small-pool", ["--schedule-policy", "lpm", "--radix-eviction-policy", "lru",
                                          "--hicache-ratio", "4"], small_pool=True,
               description="LPM, small KV pool plus a host tier 4x its size (evicted prefixes copied back)"),
    ]


# The policies `--router-policies all` compares: the router's placement policies.
ROUTER_POLICIES_ALL = ("round_robin", "cache_aware", "kv_aware")
ROUTER_WORKER_ARGS = ["--schedule-policy", "lpm", "--radix-eviction-policy", "lru"]


def router_configs(policies: list[str], n_workers: int) -> list[Config]:
    return [Config(f"router-{p}", [], router_policy=p,
                   description=f"{p} router over {n_workers} workers (each LPM, LRU eviction)") for p in policies]


def parse_router_policies(values: list[str]) -> list[str]:
    """`a b`, `a,b` or `all` -> policy names (ValueError names the bad ones)."""
    from radixserve.router.policies import POLICIES

    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    out: list[str] = []
    for n in names:
        for p in (ROUTER_POLICIES_ALL if n == "all" else (n,)):
            if p not in POLICIES:
                raise ValueError(f"unknown router policy {p!r}; choose from all, {', '.join(POLICIES)}")
            if p not in out:
                out.append(p)
    return out


def pool_arg(value: str) -> Optional[int]:
    """--router-pool-tokens: 'full' -> None (the server's default pool), else an int >= 0."""
    if value == "full":
        return None
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or 'full', got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 or 'full', got {n}")
    return n


# The default workload: SGLang's generated-shared-prefix, 8 groups of 8 questions over a 384-token
# system prompt each, all sent at once. The server is saturated from the first request, and the
# small pool (a third of the distinct tokens) holds only some of the groups' prefixes at a time,
# so the order in which requests are admitted decides what stays cached. Sized for a few minutes
# on 2 CPU cores with the built-in tiny model.
BENCH_DEFAULTS = ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "8", "--gsp-prompts-per-group", "8",
                  "--gsp-system-prompt-len", "384", "--gsp-question-len", "32", "--gsp-output-len", "8",
                  "--request-rate", "inf", "--seed", "1", "--warmup-requests", "1"]


def auto_small_pool(requests) -> int:
    """A third of the workload's distinct tokens (prompts + outputs), room for 4 of its longest requests."""
    cache = SimRadixCache()
    longest = 0
    for r in requests:
        cache.insert(list(r.prompt_ids) + [-1 - i for i in range(r.output_len)])  # outputs never shared
        longest = max(longest, r.prompt_len + r.output_len)
    return max(4 * longest, cache.size // 3)
