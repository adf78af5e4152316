"""What every rank of an engine builds the same way: the attention backend, the model (or its
shard) and the KV memory sized for it (with a hybrid model's recurrent state pool beside it).

Every function takes the rank's `TensorParallel`; a tp_size 1 engine passes `SingleRank`, whose
collectives are identities, so nothing here asks how many ranks there are."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from radixserve.cache.factory import snapshot_split
from radixserve.cache.kv_pool import KVPool, ReqToTokenPool
from radixserve.cache.state_pool import RecurrentStatePool, RecurrentStateSpec
from radixserve.cache.state_snapshots import StateSnapshots
from radixserve.distributed import TensorParallel
from radixserve.engine.memory_plan import MemoryPlan, plan_kv_pool
from radixserve.model.config import ModelConfig
from radixserve.settings import CPU_KV_POOL_TOKENS, ServerSettings

logger = logging.getLogger("radixserve")

# --kv-cache-dtype values other than auto (which keeps the model's dtype).
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}
# A hybrid model without --max-running-requests runs at most as many requests as this share of the
# device memory left after the weights holds recurrent states for. Each row costs as much as a
# snapshot (151 MiB on Qwen3.5-27B), and a prefix-heavy workload gains more from snapshots than
# from rows: on the agent workload 236 rows beside 58 snapshots kept 0.53 of the prompt tokens in
# the scheduler simulator, 64 rows beside 236 snapshots 0.80 (docs/runs/2026-12-05-hybrid-snapshot-policy.md).
STATE_POOL_SHARE = 0.15


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
                     kv_scales=model.kv_cache_scales, state=state, snapshots=snapshots)
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
