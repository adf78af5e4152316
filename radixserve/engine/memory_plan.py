"""How many KV slots a CUDA device gets: `--mem-fraction-static` of its memory holds the weights,
the KV pool and the measured working set of the largest step the settings allow.

The working set is measured, not guessed: before the pool exists, a throw-away pool just large
enough for it runs one eager step of the largest shape the scheduler can build (a full prefill
chunk, with prompt log probabilities for its last rows, beside `--max-running-requests - 1`
decoding rows, every row sampling through every filter, penalty and log-probability path), and
the largest decode CUDA graph is captured once on it (every graph shares one pool, so the
largest bounds them all). What the allocator had to reserve for each is the working set; the
pool gets what is left under the fraction. What stays outside the fraction (1 - fraction of the
device) covers memory torch does not see (the CUDA context, cuBLAS and NCCL workspaces) and the
allocator's fragmentation over a long run.

Mixture-of-experts models: the weights (every expert, stacked per layer) are in what torch holds
after loading; the fused MoE's buffers (the routing sorted by expert, padded to its tile for the
most padding any routing can need; the [tokens x top_k, moe_intermediate] and [tokens x top_k,
hidden] intermediates) depend only on the step's number of tokens, never on which experts the
router picks, so the profile step's peak bounds every step of that size, and the largest decode
graph bounds the smaller ones. (Without the fused MoE, on CUDA with the Triton kernels turned
off, the reference expert loop's temporaries follow the routing: up to a whole step's rows
through one expert.)
"""

from __future__ import annotations

import gc
import logging
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from radixserve.cache.kv_pool import KVPool, ReqToTokenPool
from radixserve.cache.state_pool import RecurrentStatePool
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.batch import ScheduledBatch
from radixserve.scheduler.request import Req
from radixserve.settings import ServerSettings

logger = logging.getLogger("radixserve")

GiB = 2 ** 30
# Prompt log probability rows the profile step computes: the most one step gathers
# (radixserve.scheduler.prefill.PROMPT_LOGPROB_ROWS_PER_STEP caps a request's piece at this).
PROFILE_PROMPT_LOGPROB_ROWS = 1024
# The heaviest sampling a row can ask for: every filter, penalty and log-probability path runs.
PROFILE_SAMPLING = dict(max_new_tokens=2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, min_new_tokens=2,
                        repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1,
                        logit_bias={1: 1.0}, return_logprob=True, top_logprobs_num=20, ignore_eos=True)


@dataclass
class MemoryPlan:
    """Where a device's memory goes (bytes), logged at start-up and shown by /server_info."""
    total_bytes: int
    fraction: float
    weights_bytes: int  # what torch held once the model was loaded
    other_bytes: int  # in use on the device but not by torch's allocator (CUDA context, libraries)
    activation_bytes: int  # the eager profile step's peak reservation
    graph_bytes: int  # the largest decode graph's pool, captured alone
    kv_pool_bytes: int
    kv_pool_tokens: int
    profile_prefill_tokens: int
    profile_decode_rows: int
    graph_bytes_captured: Optional[int] = None  # what the real capture took (set after it)
    # A hybrid model's per-request recurrent states (allocated before the plan, inside "in use").
    state_pool_bytes: int = 0
    state_pool_rows: int = 0
    # Its prefix cache's recurrent-state snapshots (--mamba-cache-size; allocated before the plan too).
    snapshot_pool_bytes: int = 0
    snapshot_slots: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        captured = "" if self.graph_bytes_captured is None else \
            f" (captured: {self.graph_bytes_captured / GiB:.2f})"
        return (f"device memory {self.total_bytes / GiB:.1f} GiB x {self.fraction:.2f}: weights "
                f"{self.weights_bytes / GiB:.2f} GiB, working set "
                f"{(self.activation_bytes + self.graph_bytes) / GiB:.2f} GiB (step peak "
                f"{self.activation_bytes / GiB:.2f} at {self.profile_prefill_tokens} prompt tokens + "
                f"{self.profile_decode_rows} decoding rows, decode graphs {self.graph_bytes / GiB:.2f}{captured}), "
                f"KV pool {self.kv_pool_bytes / GiB:.2f} GiB = {self.kv_pool_tokens} tokens; "
                + (f"recurrent states {self.state_pool_bytes / GiB:.2f} GiB = {self.state_pool_rows} requests; "
                   if self.state_pool_rows else "")
                + (f"state snapshots {self.snapshot_pool_bytes / GiB:.2f} GiB = {self.snapshot_slots} slots; "
                   if self.snapshot_slots else "")
                + f"outside torch {self.other_bytes / GiB:.2f} GiB")


def profile_prefill_tokens(settings: ServerSettings, context_len: int, device_type: str = "cuda") -> int:
    """The most prompt tokens one step computes: the chunk, or without chunking a whole prompt
    (one over --max-prefill-tokens runs alone)."""
    chunk = settings.resolved_chunked_prefill_size(device_type)
    if chunk > 0:
        return min(settings.max_prefill_tokens, chunk)
    return max(settings.max_prefill_tokens, context_len - 1)


class _ProfileSlots:
    """Hands out consecutive slots of the throw-away pool, page by page (page 0 is reserved)."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.next = page_size

    def take(self, n: int) -> list[int]:
        pages = -(-n // self.page_size)
        slots = list(range(self.next, self.next + pages * self.page_size))
        self.next += pages * self.page_size
        return slots


def _profile_batch(req_to_token: ReqToTokenPool, page_size: int, prefill: int, decode_rows: int,
                   vocab: int) -> tuple[ScheduledBatch, int]:
    """The largest step: one prompt piece of `prefill` tokens and `decode_rows` one-token rows,
    each row of the table pointing at its own slots. Returns it and the slots it needs."""
    slots = _ProfileSlots(page_size)
    batch = ScheduledBatch()
    params = SamplingParams(**PROFILE_SAMPLING)
    prompt_params = SamplingParams(**PROFILE_SAMPLING,
                                   logprob_start_len=max(1, prefill - PROFILE_PROMPT_LOGPROB_ROWS))
    for i in range(decode_rows + 1):
        n = prefill if i == 0 else 2
        ids = [(7 * i + j) % vocab for j in range(n)]
        req = Req(rid=f"memory-profile-{i}", origin_input_ids=ids, sampling_params=prompt_params if i == 0 else params,
                  arrival_time=0.0, arrival_seq=i)
        req.req_pool_idx = i
        req.slots = slots.take(n)
        req.kv_len = n
        req_to_token.table[i, :len(req.slots)] = torch.tensor(req.slots, dtype=torch.int64)
        if i == 0:
            batch.add(req, 0, n, True)
        else:
            batch.add(req, 1, 1, True)
    batch.num_new_tokens = prefill
    return batch, slots.next


def _reserved(device: torch.device) -> int:
    torch.cuda.synchronize(device)
    return torch.cuda.memory_reserved(device)


def _release(device: torch.device) -> None:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def profile_step(settings: ServerSettings, model, req_to_token: ReqToTokenPool, device: torch.device,
                 kv_dtype: torch.dtype, context_len: int, state: Optional[RecurrentStatePool] = None):
    """The largest step's batch and an eager runner over a throw-away pool just large enough for it
    (`runner.forward(batch)` runs it on any device). `state`: a hybrid model's recurrent state
    pool, which the profile step writes (its rows start from zeros when real requests come)."""
    from radixserve.engine.model_runner import ModelRunner

    cfg = model.config
    prefill = min(profile_prefill_tokens(settings, context_len, device.type), context_len - 1)
    batch, slots_needed = _profile_batch(req_to_token, settings.page_size, prefill, req_to_token.max_requests - 1,
                                         cfg.vocab_size)
    pool = KVPool(slots_needed, settings.page_size, cfg.num_kv_layers, model.local_heads[1], cfg.head_dim,
                  kv_dtype, device, kv_scales=model.kv_cache_scales, state=state)
    return ModelRunner(model, pool, req_to_token, device, settings.random_seed, disable_cuda_graph=True), batch


def measure_working_set(settings: ServerSettings, model, req_to_token: ReqToTokenPool, device: torch.device,
                        kv_dtype: torch.dtype, context_len: int, graph_max_bs: int,
                        state: Optional[RecurrentStatePool] = None) -> tuple[int, int, int, int]:
    """(step peak bytes, largest decode graph's bytes, profile prefill tokens, decoding rows),
    measured on a throw-away KV pool. Every rank of a tensor-parallel engine runs it at the same
    point (the profile step's collectives pair up)."""
    from radixserve.engine.cuda_graph import DecodeCudaGraphs, supports_cuda_graphs

    runner, batch = profile_step(settings, model, req_to_token, device, kv_dtype, context_len, state)
    pool = runner.kv_pool
    prefill, decode_rows = batch.num_new_tokens, len(batch.reqs) - 1
    _release(device)
    before = _reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner.forward(batch)
    torch.cuda.synchronize(device)
    step_bytes = torch.cuda.max_memory_reserved(device) - before
    graph_bytes = 0
    if graph_max_bs > 0 and not settings.disable_cuda_graph and supports_cuda_graphs(model, device):
        _release(device)
        graphs = DecodeCudaGraphs(model, pool, req_to_token, device, graph_max_bs, runner.sampled, largest_only=True)
        graphs.capture()
        graph_bytes = graphs.pool_bytes
        del graphs
    req_to_token.table.zero_()
    del runner, pool, batch
    _release(device)
    return step_bytes, graph_bytes, prefill, decode_rows


def plan_kv_pool(settings: ServerSettings, model, req_to_token: ReqToTokenPool, device: torch.device,
                 kv_dtype: torch.dtype, context_len: int, graph_max_bs: int,
                 state: Optional[RecurrentStatePool] = None) -> MemoryPlan:
    """The KV pool's size on a CUDA device: what --mem-fraction-static leaves once the weights, a
    hybrid model's recurrent state pool (`state`, already allocated) and the measured working
    set are taken out."""
    cfg = model.config
    _release(device)
    weights = torch.cuda.memory_allocated(device)
    step_bytes, graph_bytes, prefill, rows = measure_working_set(settings, model, req_to_token, device, kv_dtype,
                                                                 context_len, graph_max_bs, state)
    free, total = torch.cuda.mem_get_info(device)
    used = total - free  # weights, the table, workspaces, the CUDA context: everything there now
    other = max(0, used - torch.cuda.memory_reserved(device))
    per_token = KVPool.bytes_per_token(cfg.num_kv_layers, model.local_heads[1], cfg.head_dim, kv_dtype)
    budget = total * settings.mem_fraction_static - used - step_bytes - graph_bytes
    tokens = int(budget // per_token) if budget > 0 else 0
    tokens -= tokens % settings.page_size
    if tokens < settings.page_size:
        raise ValueError(
            f"mem_fraction_static={settings.mem_fraction_static} leaves no room for a KV pool: of "
            f"{total / GiB:.1f} GiB, {used / GiB:.1f} GiB are in use and the largest step needs "
            f"{(step_bytes + graph_bytes) / GiB:.1f} GiB; raise the fraction or lower --chunked-prefill-size, "
            f"--max-running-requests or --cuda-graph-max-bs")
    return MemoryPlan(total_bytes=total, fraction=settings.mem_fraction_static, weights_bytes=weights,
                      other_bytes=other, activation_bytes=step_bytes, graph_bytes=graph_bytes,
                      kv_pool_bytes=tokens * per_token, kv_pool_tokens=tokens, profile_prefill_tokens=prefill,
                      profile_decode_rows=rows, state_pool_bytes=state.total_bytes if state is not None else 0,
                      state_pool_rows=state.num_rows if state is not None else 0)
