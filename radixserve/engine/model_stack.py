"""What every rank of an engine builds the same way: the attention backend, the model (or its
shard) and the KV memory sized for it (with a hybrid model's recurrent state pool beside it).

Every function takes the rank's `TensorParallel`; a tp_size 1 engine passes `SingleRank`, whose
collectives are identities, so nothing here asks how many ranks there are."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.kv_pool import KVPool, ReqToTokenPool
from radixserve.cache.state_pool import RecurrentStatePool, RecurrentStateSpec
from radixserve.cache.state_snapshots import HostStateSnapshots, StateSnapshots
from radixserve.distributed import TensorParallel
from radixserve.engine.memory_plan import MemoryPlan, plan_kv_pool
from radixserve.model.config import ModelConfig
from radixserve.settings import CPU_KV_POOL_TOKENS, CPU_MAMBA_CACHE_SIZE, ServerSettings

logger = logging.getLogger("radixserve")

# --kv-cache-dtype values other than auto (which keeps the model's dtype).
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}
# A hybrid model without --max-running-requests runs at most as many requests as this share of the
# device memory left after the weights holds recurrent states for. Each row costs as much as a
# snapshot (151 MiB on Qwen3.5-27B), and a prefix-heavy workload gains more from snapshots than
# from rows: on the agent workload 236 rows beside 58 snapshots kept 0.53 of the prompt tokens in
# the scheduler simulator, 64 rows beside 236 snapshots 0.80 (docs/tuning.md).
STATE_POOL_SHARE = 0.15
# Without --mamba-cache-size, the prefix cache keeps one recurrent-state snapshot per this many KV
# pool tokens: the memory the plan leaves for the pool is split between the two so (a snapshot is
# where one cached conversation or branch point resumes; a few thousand tokens of agent or chat
# history each, some of it shared).
SNAPSHOT_SPAN_TOKENS = 1024


def kv_cache_dtype(settings: ServerSettings, dtype: torch.dtype) -> torch.dtype:
    return KV_CACHE_DTYPES.get(settings.kv_cache_dtype, dtype)


def make_attention_backend(choice: str, device: torch.device):
    backend = choice
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "triton":
        if device.type != "cuda":
            raise ValueError("attention_backend=triton needs a CUDA device")
        try:
            from radixserve.attention.triton_backend import TritonAttentionBackend
        except ImportError:
            if choice == "triton":
                raise
            backend = "torch"  # auto and the Triton backend is not available here
        else:
            return TritonAttentionBackend()
    from radixserve.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def load_rank_model(settings: ServerSettings, device: torch.device, dtype: torch.dtype, context_len: int,
                    tp: TensorParallel):
    """The model (this rank's shard of it) and its attention backend."""
    from radixserve.model.loader import load_model

    backend = make_attention_backend(settings.attention_backend, device)
    model, _ = load_model(settings.model_path, load_format=settings.load_format, dtype=dtype, device=device,
                          attn_backend=backend, seed=settings.random_seed, context_length=context_len,
                          decode_gemm_max_rows=settings.decode_gemm_max_rows, tp=tp,
                          quantization=settings.quantization)
    if settings.tp_all_reduce == "symm-mem":
        # Decode steps' messages: up to the largest CUDA-graph batch of [rows, hidden].
        rows = min(settings.cuda_graph_max_bs, settings.resolved_max_running_requests(device.type))
        tp.use_symmetric_memory(dtype, rows * model.config.hidden_size)
    return model, backend


def make_kv_memory(settings: ServerSettings, model, device: torch.device, dtype: torch.dtype, context_len: int,
                   tp: TensorParallel, table_cls: type = ReqToTokenPool
                   ) -> tuple[KVPool, ReqToTokenPool, Optional[MemoryPlan]]:
    """This rank's KV pool (its KV heads of every slot, in --kv-cache-dtype: an FP8 pool holds
    twice the tokens in the same bytes, with the model's per-layer scales), the req_to_token
    table, and on CUDA the memory plan that sized the pool (None when --max-total-tokens did).
    Every rank of a tensor-parallel engine gets the same number of slots: the fewest any rank has
    room for."""
    cfg: ModelConfig = model.config
    num_kv_heads = model.local_heads[1]
    kv_dtype = kv_cache_dtype(settings, dtype)
    max_running = settings.resolved_max_running_requests(device.type)
    spec = state_spec(model, getattr(torch, settings.mamba_ssm_dtype))
    if spec is not None and device.type == "cuda" and settings.max_running_requests is None:
        max_running = tp.min_int(min(max_running, state_rows_that_fit(settings, spec, device)))
    table = table_cls(max_running, context_len + 1, device)
    state = RecurrentStatePool(max_running, spec, device) if spec is not None else None
    per_token = KVPool.bytes_per_token(cfg.num_kv_layers, num_kv_heads, cfg.head_dim, kv_dtype)
    plan: Optional[MemoryPlan] = None
    if settings.max_total_tokens is not None:
        tokens = settings.max_total_tokens
    elif device.type == "cuda":
        # Blocks the caching allocator holds but nothing uses (the temporaries of loading, such as
        # the wider copies --quantization fp8 quantizes) are free memory: the plan hands them back
        # first, or they would count as in use and shrink the pool.
        plan = plan_kv_pool(settings, model, table, device, kv_dtype, context_len,
                            graph_max_bs=min(settings.cuda_graph_max_bs, max_running), state=state)
        tokens = plan.kv_pool_tokens
    else:
        tokens = CPU_KV_POOL_TOKENS
    snapshots = None
    if state is not None:
        # A planned pool's bytes are shared with the snapshots (`tokens` is both their budget); a
        # pool set by --max-total-tokens gets its snapshots beside it, in what the fraction leaves.
        room = None
        if plan is None and device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            room = int(total * settings.mem_fraction_static - (total - free)) - tokens * per_token
        slots, tokens = snapshot_split(settings, spec, device, tokens, per_token, planned=plan is not None,
                                       room_bytes=room)
        slots = tp.min_int(slots)
        snapshots = StateSnapshots(slots, state) if slots else None
    tokens = tp.min_int(tokens - tokens % settings.page_size)
    if plan is not None and tokens != plan.kv_pool_tokens:
        plan.kv_pool_bytes = plan.kv_pool_bytes // plan.kv_pool_tokens * tokens
        plan.kv_pool_tokens = tokens
    if plan is not None and snapshots is not None:
        plan.snapshot_pool_bytes, plan.snapshot_slots = snapshots.total_bytes, snapshots.num_slots
    kv_pool = KVPool(tokens, settings.page_size, cfg.num_kv_layers, num_kv_heads, cfg.head_dim, kv_dtype, device,
                     kv_scales=model.kv_cache_scales)
    kv_pool.state = state
    kv_pool.snapshots = snapshots
    return kv_pool, table, plan


def state_spec(model, ssm_dtype: torch.dtype = torch.float32) -> Optional[RecurrentStateSpec]:
    """What one request row of a hybrid model's state pool holds (this rank's heads; the recurrent
    states in `ssm_dtype`, --mamba-ssm-dtype); None for a model without linear-attention layers."""
    shape = getattr(model, "recurrent_state_shape", None)
    return RecurrentStateSpec(**shape, ssm_dtype=ssm_dtype) if shape is not None else None


def state_rows_that_fit(settings: ServerSettings, spec: RecurrentStateSpec, device: torch.device) -> int:
    """Request rows whose recurrent states fit in STATE_POOL_SHARE of what --mem-fraction-static
    leaves after what the device holds now (the weights)."""
    free, total = torch.cuda.mem_get_info(device)
    room = total * settings.mem_fraction_static - (total - free)
    if room < spec.bytes_per_row:
        raise ValueError(f"mem_fraction_static={settings.mem_fraction_static} leaves no room for one request's "
                         f"recurrent state ({spec.bytes_per_row / 2**20:.0f} MiB): raise the fraction or use more "
                         "--tp-size")
    rows = max(1, int(room * STATE_POOL_SHARE // spec.bytes_per_row))
    default = settings.resolved_max_running_requests(device.type)
    if rows < default:
        logger.info("recurrent states: %.0f MiB per request; %d requests run at once (%.0f%% of the memory after "
                    "the weights; --max-running-requests sets it)", spec.bytes_per_row / 2**20, rows,
                    100 * STATE_POOL_SHARE)
    return min(rows, default)


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
        return fit_beside_the_pool(settings, slots, snapshot, tokens, room_bytes), tokens
    left = tokens - -(-slots * snapshot // per_token)
    if left < settings.page_size:
        raise ValueError(f"--mamba-cache-size {slots} snapshots of {snapshot / 2**20:.0f} MiB leave no room for a KV "
                         f"pool in what --mem-fraction-static {settings.mem_fraction_static} leaves "
                         f"({tokens * per_token / 2**30:.1f} GiB): fewer snapshots or a higher fraction")
    return slots, left


def fit_beside_the_pool(settings: ServerSettings, slots: int, snapshot: int, tokens: int,
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


def host_tier_tokens(settings: ServerSettings, kv_pool: KVPool, tp: TensorParallel) -> int:
    """Slots of this rank's host tier (0: none): --hicache-size GB of this rank's KV bytes per
    token (so per rank), or --hicache-ratio times the device pool. Every rank of a
    tensor-parallel engine gets the same number, the fewest any rank computed: rank 0's tree numbers
    the host slots of every rank."""
    if not settings.hicache_enabled:
        return 0
    tokens = settings.hicache_tokens(kv_pool.allocator.total_tokens, HostKVPool.token_bytes(kv_pool))
    return tp.min_int(tokens)


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


def make_host_snapshots(settings: ServerSettings, kv_pool: KVPool, host_tokens: int,
                        tp: TensorParallel) -> Optional[HostStateSnapshots]:
    """This rank's host snapshot pool (its heads' share of each, rank 0's slot numbering: the same
    count on every rank), set as kv_pool.snapshots.host; None without one."""
    if kv_pool.snapshots is None:
        return None  # the same on every rank (the device pool's slots are agreed): no collective
    slots = tp.min_int(host_snapshot_slots(settings, kv_pool, host_tokens))
    if not slots:
        return None
    return HostStateSnapshots(slots, kv_pool.snapshots, pin=kv_pool.k_buffers[0].device.type == "cuda")
