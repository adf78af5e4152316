"""The one place a prefix cache and the memory beside it are chosen and sized: the engine (rank 0's
tree), every tensor-parallel rank (the host tier and snapshot pools rank 0's copies replay into)
and the scheduler simulator all build through here, so none of them can drift from the others.

Sizing needs agreement between tensor-parallel ranks (every rank holds the same number of slots,
the fewest any rank has room for): the functions take `agree`, a collective minimum over the
ranks (the identity for one rank), rather than the distributed layer itself."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from radixserve.cache.disk_snapshots import DiskSnapshots, state_stamp
from radixserve.cache.disk_tier import LoadCost, StorageTier, measure_prefill_flops
from radixserve.cache.host_pool import CopyEngine, HostKVPool, make_copy_engine
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.no_cache import NoPrefixCache
from radixserve.cache.prefix_cache import OwnedPrefixCache
from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.state_pool import RecurrentStateSpec
from radixserve.cache.state_snapshots import HostStateSnapshots
from radixserve.cache.storage_shards import Report, ReportInbox, ShardedStore, StorageReplica
from radixserve.cache.stores.disk import READ_BUFFER_BYTES, DiskStore
from radixserve.cache.stores.host_kv import HostKV
from radixserve.cache.stores.host_snapshots import HostSnapshots
from radixserve.cache.stores.page_files import LocalFileBackend, PageBackend, StoreStamp, other_tp_layouts
from radixserve.cache.stores.redis_pages import RedisBackend
from radixserve.cache.stores.snapshots import BRANCH_MIN_TOKENS, SnapshotStore
from radixserve.settings import CPU_MAMBA_CACHE_SIZE, ServerSettings

logger = logging.getLogger("radixserve")

Agree = Callable[[int], int]  # the fewest over the tensor-parallel ranks


def _alone(n: int) -> int:
    return n


# Without --mamba-cache-size, the prefix cache keeps one recurrent-state snapshot per this many KV
# pool tokens: the memory the plan leaves for the pool is split between the two so (a snapshot is
# where one cached conversation or branch point resumes; a few thousand tokens of agent or chat
# history each, some of it shared).
SNAPSHOT_SPAN_TOKENS = 1024


# ---------------------------------------------------------------------------------------- sizing
def snapshot_split(settings: ServerSettings, spec: RecurrentStateSpec, device: torch.device, tokens: int,
                   per_token: int, *, planned: bool, room_bytes: Optional[int] = None) -> tuple[int, int]:
    """(slots of the prefix cache's state snapshot pool, KV pool tokens). --mamba-cache-size, else
    one per SNAPSHOT_SPAN_TOKENS of the KV pool, else on the CPU CPU_MAMBA_CACHE_SIZE; 0 with
    --disable-radix-cache. `planned`: `tokens` is what the memory plan left for the pool, in KV
    tokens, and the snapshots take their bytes out of it; else the pool has `tokens` (set by
    --max-total-tokens, or the CPU's) and the snapshots come beside it, in `room_bytes` (what
    --mem-fraction-static leaves beside that pool on a GPU; None: no bound): a 216,825-token pool
    of Qwen3.5-27B asks 211 snapshots of 147 MiB, 31 GiB an H100 does not have beside the weights."""
    if settings.disable_radix_cache:
        return 0, tokens
    snapshot = spec.bytes_per_row
    if settings.mamba_cache_size is not None:
        slots = settings.mamba_cache_size
    elif device.type != "cuda":
        slots = CPU_MAMBA_CACHE_SIZE
    elif planned:
        slots = tokens * per_token // (snapshot + SNAPSHOT_SPAN_TOKENS * per_token)
    else:
        slots = max(1, tokens // SNAPSHOT_SPAN_TOKENS)
    if not planned:
        return _fit_beside_the_pool(settings, slots, snapshot, tokens, room_bytes), tokens
    left = tokens - -(-slots * snapshot // per_token)
    if left < settings.page_size:
        raise ValueError(f"--mamba-cache-size {slots} snapshots of {snapshot / 2**20:.0f} MiB leave no room for a KV "
                         f"pool in what --mem-fraction-static {settings.mem_fraction_static} leaves "
                         f"({tokens * per_token / 2**30:.1f} GiB): fewer snapshots or a higher fraction")
    return slots, left


def _fit_beside_the_pool(settings: ServerSettings, slots: int, snapshot: int, tokens: int,
                         room_bytes: Optional[int]) -> int:
    """`slots` snapshots, or as many as fit in room_bytes: fewer (with a warning) when their count
    was derived from the pool, an error when --mamba-cache-size asked for them."""
    if room_bytes is None or slots * snapshot <= room_bytes:
        return slots
    fit = max(0, room_bytes // snapshot)
    room = f"{max(0, room_bytes) / 2**30:.1f} GiB"
    if settings.mamba_cache_size is not None:
        raise ValueError(f"--mamba-cache-size {slots} snapshots of {snapshot / 2**20:.0f} MiB need "
                         f"{slots * snapshot / 2**30:.1f} GiB; --mem-fraction-static {settings.mem_fraction_static} "
                         f"leaves {room} beside the {tokens}-token KV pool (--max-total-tokens): at most {fit} "
                         "snapshots, fewer KV tokens or a higher fraction")
    logger.warning("prefix cache: %d recurrent-state snapshots of %.0f MiB fit beside the %d-token KV pool "
                   "(--max-total-tokens) in what --mem-fraction-static %.2f leaves (%s), not the %d of one per "
                   "%d pool tokens%s", fit, snapshot / 2**20, tokens, settings.mem_fraction_static, room, slots,
                   SNAPSHOT_SPAN_TOKENS, "" if fit else ": a hybrid model then reuses no prefix; leave "
                   "--max-total-tokens out and the memory plan splits the memory between the two")
    return fit


def host_tier_tokens(settings: ServerSettings, kv_pool: KVPool, agree: Agree = _alone) -> int:
    """Slots of this rank's host tier (0: none): --hicache-size GB of this rank's KV bytes per
    token (so per rank), or --hicache-ratio times the device pool; the same on every rank (rank 0's
    tree numbers the host slots of every rank)."""
    if settings.disable_radix_cache or not settings.hicache_enabled:
        return 0
    return agree(settings.hicache_tokens(kv_pool.allocator.total_tokens, HostKVPool.token_bytes(kv_pool)))


def host_snapshot_slots(settings: ServerSettings, kv_pool: KVPool, host_tokens: int) -> int:
    """Slots of the host tier's state snapshot pool (0: none): --mamba-host-cache-size, else as many
    times the device snapshot pool as the host tier (host_tokens) is the device KV pool, at least
    one, but no more bytes than the host tier's KV (at least the device pool's count): a large
    model's snapshots are 150 MB each, and the ratio alone would pin hundreds of GB. 0 without a
    host tier or without device snapshots (a hybrid model only)."""
    snapshots = kv_pool.snapshots
    if not host_tokens or snapshots is None:
        return 0
    if settings.mamba_host_cache_size is not None:
        return settings.mamba_host_cache_size
    by_ratio = round(snapshots.num_slots * host_tokens / kv_pool.allocator.total_tokens)
    by_bytes = host_tokens * HostKVPool.token_bytes(kv_pool) // snapshots.bytes_per_slot
    return max(1, min(by_ratio, max(snapshots.num_slots, by_bytes)))


# ----------------------------------------------------------------------------------- the tiers
@dataclass
class HostTier:
    """One rank's host tier: its KV pool (this rank's heads of each token), the copy engine between
    it and the device pool, and a hybrid model's host snapshot pool (None: it keeps none)."""
    pool: HostKVPool
    copier: CopyEngine
    snapshots: Optional[HostStateSnapshots]


def host_tier(kv_pool: KVPool, tokens: int, snapshot_slots: int = 0, *, shared: bool = False) -> HostTier:
    """A host tier of `tokens` KV slots and `snapshot_slots` state snapshot slots (with a hybrid
    model's snapshot pool, kv_pool.snapshots, to which they attach: kv_pool.snapshots.host), pinned
    when the device pool is on CUDA; shared: its KV slots in memory the storage tier's I/O process
    maps too (it reads pages straight into them)."""
    pinned = kv_pool.k_buffers[0].device.type == "cuda"
    pool = HostKVPool(tokens, kv_pool, pin=pinned, shared=shared)
    copier = make_copy_engine(kv_pool, pool)
    snapshots = None
    if kv_pool.snapshots is not None and snapshot_slots:  # its copies go on the KV's copy stream
        snapshots = HostStateSnapshots(snapshot_slots, kv_pool.snapshots, pin=pinned, copier=copier)
    return HostTier(pool, copier, snapshots)


def make_host_tier(settings: ServerSettings, kv_pool: KVPool, agree: Agree = _alone) -> Optional[HostTier]:
    """This rank's host tier as the settings size it, alike on every rank; None without one."""
    tokens = host_tier_tokens(settings, kv_pool, agree)
    if not tokens:
        return None
    slots = 0
    if kv_pool.snapshots is not None:  # the device pool's slots are agreed: the same branch on every rank
        slots = agree(host_snapshot_slots(settings, kv_pool, tokens))
    return host_tier(kv_pool, tokens, slots, shared=settings.storage_enabled)


# ----------------------------------------------------------------------------------- the cache
def build_prefix_cache(settings: ServerSettings, kv_pool: KVPool, host: Optional[HostTier], *,
                       recurrent: bool) -> OwnedPrefixCache:
    """The prefix cache the settings ask for: none (--disable-radix-cache, or a hybrid model without
    a snapshot pool: its requests cannot resume from KV alone), else the tree over what there is."""
    if settings.disable_radix_cache or (recurrent and kv_pool.snapshots is None):
        return NoPrefixCache(kv_pool.allocator, page_size=kv_pool.page_size)
    return tree_cache(kv_pool, host, eviction_policy=settings.radix_eviction_policy,
                      write_through=settings.hicache_write_policy == "write_through")


def tree_cache(kv_pool: KVPool, host: Optional[HostTier] = None, *, eviction_policy: str = "lru",
               write_through: bool = False, branch_min_tokens: int = BRANCH_MIN_TOKENS) -> RadixCache:
    """The radix tree over kv_pool with the stores there are: a hybrid model's state snapshots
    (kv_pool.snapshots) where there are some, the host tier `host` where there is one (its
    snapshot slots, host.snapshots, under the snapshot store)."""
    page_size = kv_pool.page_size
    host_kv = states = None
    if host is not None:
        host_kv = HostKV(host.pool, host.copier, page_size=page_size, write_through=write_through)
    if kv_pool.snapshots is not None:
        host_states = HostSnapshots(host.snapshots) if host is not None and host.snapshots is not None else None
        states = SnapshotStore(kv_pool.snapshots, host_states, page_size=page_size,
                               branch_min_tokens=branch_min_tokens)
    return RadixCache(kv_pool.allocator, page_size=page_size, eviction_policy=eviction_policy,
                      host=host_kv, states=states)


# ----------------------------------------------------------------------------------- the storage tier
# A hybrid's state snapshots the reads in flight may hold at once (each read carries one).
READ_SNAPSHOTS = 4

def make_storage_tier(settings: ServerSettings, cache: OwnedPrefixCache, kv_pool: KVPool, *, model: str,
                      flops_per_token: float, attention_flops_per_pair: float,
                      prefill_flops_per_s: Optional[float] = None,
                      read_bytes_per_s: Optional[float] = None, synchronous: bool = False,
                      hidden: int = 4096, inbox: Optional[ReportInbox] = None,
                      context_len: Optional[int] = None) -> Optional[StorageTier]:
    """The storage tier --storage-dir asks for, attached under cache's host tier (None: not asked
    for, or nothing cached). The read bandwidth and prefill rate are measured here unless given
    (the simulator gives its model's); `model` names the weights in the directory's version stamp;
    `context_len` bounds the loads, so the pages no load could pay for are not written.
    Under tensor parallelism this is rank 0's (its shard's store, `inbox`: the other ranks'
    reports); the other ranks build theirs with `make_storage_replica`, at the same point."""
    if not settings.storage_enabled or not cache.keeps_prefixes:
        return None
    host = cache.host if isinstance(cache, RadixCache) else None
    if host is None:
        raise ValueError("the storage tier (storage_dir) sits under the host tier: give hicache_ratio or hicache_size")
    states = cache.states if isinstance(cache, RadixCache) else None
    if states is not None and states.host is None:
        raise ValueError("the storage tier (storage_dir) keeps a hybrid model's state snapshots through the host "
                         "tier's snapshot slots: give mamba_host_cache_size > 0 (or leave it to its default)")
    k0 = kv_pool.k_buffers[0]
    stamp = _stamp(settings, kv_pool, host.host_pool, model, states.snapshots if states is not None else None, 0)
    where, backend = _backend(settings, 0)
    if inbox is not None:  # rank 0 of a tensor-parallel engine
        store: DiskStore = ShardedStore(backend, stamp, tp_size=settings.tp_size, inbox=inbox, log=None,
                                        read_buffer_bytes=_read_buffer_bytes(kv_pool), host_pool=host.host_pool)
    else:
        store = DiskStore(backend, stamp, synchronous=synchronous, read_buffer_bytes=_read_buffer_bytes(kv_pool),
                          host_pool=host.host_pool)
    if read_bytes_per_s is None:
        read_bytes_per_s = settings.storage_read_gbps * 1e9 or backend.probe_read_bandwidth(stamp.page_bytes)
    if prefill_flops_per_s is None:
        prefill_flops_per_s = settings.storage_prefill_tflops * 1e12 or measure_prefill_flops(k0.device, k0.dtype, hidden)
    cost = LoadCost(read_bytes_per_s, host.host_pool.bytes_per_token, flops_per_token, attention_flops_per_pair,
                    prefill_flops_per_s)
    disk_states = DiskSnapshots(states, store, kv_pool.page_size) if states is not None else None
    tier = StorageTier(store, host.host_pool, cost, disk_states, context_len=context_len)
    host.storage = tier
    shards = ""
    if inbox is not None:
        shards = (" (rank 0's shard; each rank's under keys of its own)" if backend.shared else
                  f" (rank 0's shard; rank r's in tp{settings.tp_size}-rank<r> beside it)")
    logger.info("storage tier: %s%s, %.1f GB, %d pages found (%.1f GB); reads %.2f GB/s, prefill %.2f TFLOP/s "
                "(measured): a load pays from %.0f tokens of context", where, shards, settings.storage_size,
                store.num_pages, store.used_bytes / 1e9, read_bytes_per_s / 1e9, prefill_flops_per_s / 1e12,
                cost.break_even())
    if context_len is not None and tier.first_saved_position >= context_len:
        logger.warning("storage tier: at %.2f GB/s no load pays within the context length (%d tokens): it writes "
                       "nothing; a faster disk (or --storage-read-gbps, if the measurement was wrong) makes it pay",
                       read_bytes_per_s / 1e9, context_len)
    elif tier.first_saved_position > 0:
        logger.info("storage tier: pages before position %.0f are not written (no load reading them pays)",
                    tier.first_saved_position)
    return tier


def make_storage_replica(settings: ServerSettings, kv_pool: KVPool, host: Optional[HostTier], rank: int,
                         report: Callable[[Report], None], *, model: str) -> Optional[StorageReplica]:
    """A tensor-parallel rank other than 0: its shard of the storage tier, which replays rank 0's
    storage orders and reports to rank 0 through `report` (None: no storage tier, or no cache)."""
    if not settings.storage_enabled or settings.disable_radix_cache or host is None:
        return None
    if kv_pool.state is not None and kv_pool.snapshots is None:
        return None  # a hybrid without snapshots caches nothing (rank 0 builds no tier either)
    stamp = _stamp(settings, kv_pool, host.pool, model, kv_pool.snapshots, rank)
    _, backend = _backend(settings, rank)
    store = DiskStore(backend, stamp, read_buffer_bytes=_read_buffer_bytes(kv_pool), host_pool=host.pool)
    return StorageReplica(store, rank, report, kv_pool, host.pool, host.copier, kv_pool.snapshots)


def _read_buffer_bytes(kv_pool: KVPool) -> int:
    """What the reads' state snapshots in flight may hold together (the pages go straight into the
    host tier): a hybrid's READ_SNAPSHOTS; the rest of the read buffer's default beside them.
    Every rank's the same, so a read buffer with room on rank 0 has room on every rank."""
    snapshot = kv_pool.snapshots.bytes_per_slot if kv_pool.snapshots is not None else 0
    return READ_BUFFER_BYTES + READ_SNAPSHOTS * snapshot


def _stamp(settings: ServerSettings, kv_pool: KVPool, host_pool: HostKVPool, model: str, snapshots, rank: int
           ) -> StoreStamp:
    """What this rank's pages depend on: the model, the page size, this rank's shard of the KV (its
    bytes per token; the tp size and rank) and of a hybrid's states."""
    k0 = kv_pool.k_buffers[0]
    return StoreStamp(model=model, page_size=kv_pool.page_size, kv_dtype=str(k0.dtype).replace("torch.", ""),
                      bytes_per_token=host_pool.bytes_per_token, num_layers=len(kv_pool.k_buffers),
                      tp_size=settings.tp_size, tp_rank=rank,
                      states=state_stamp(snapshots.spec) if snapshots is not None else "")


def _backend(settings: ServerSettings, rank: int) -> tuple[str, PageBackend]:
    """Where rank `rank`'s pages live: --storage-dir (under tp N, its tp<N>-rank<r> directory), or
    the Redis server (every rank's: its stamp, which names the rank, keeps its keys apart)."""
    latency, capacity = settings.storage_read_latency_ms / 1e3, int(settings.storage_size * 1e9)
    if settings.storage_backend == "redis":
        return settings.storage_url, RedisBackend(settings.storage_url, capacity, read_latency_s=latency)
    where = settings.storage_dir
    if settings.dp_size > 1:  # each worker its own store: one server per directory
        where = os.path.join(where, f"worker-{settings.dp_rank}")
    if rank == 0:
        os.makedirs(where, mode=0o700, exist_ok=True)  # page records hold every tenant's token ids
        for other in other_tp_layouts(where, settings.tp_size):
            logger.warning("storage tier: %s; this server (tp_size %d) does not read them: it keeps its pages in "
                           "%s. Remove them to free their space (storage_size does not count them)", other,
                           settings.tp_size, f"{where}/tp{settings.tp_size}-rank<r>" if settings.tp_size > 1
                           else where)
    if settings.tp_size > 1:
        where = os.path.join(where, f"tp{settings.tp_size}-rank{rank}")
    return where, LocalFileBackend(where, capacity, read_latency_s=latency)
