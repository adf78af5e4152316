"""The engine: model, KV memory, radix cache and scheduler, driven one step at a time.

`EngineCore.step()` is the whole loop body: schedule a batch, launch it, and turn the sampled
tokens of the step before into `RequestOutput`s. With overlap scheduling (the default) the host
builds and launches step N+1 while the device still runs step N (`StepInFlight`), and only then
waits for step N's tokens, so scheduling, result processing and launches hide behind the device's
work. A step that sampled for a grammar-constrained request is the exception: the next mask
needs its token, so it is collected before the next step is built (see `radixserve.grammar`).
A constrained request waits outside the scheduler until its grammar is compiled
(`GrammarWaitlist`). The offline `Engine` and the server's engine process both drive it.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

import torch

from radixserve.cache.disk_tier import StorageTier
from radixserve.cache.factory import build_prefix_cache, make_host_tier, make_storage_tier
from radixserve.cache.stores.page_files import model_identity
from radixserve.cache.namespace import is_cache_namespace
from radixserve.cache.prefix_cache import OwnedPrefixCache
from radixserve.chat_formats import SystemTurns, reasoning_format
from radixserve.distributed import TensorParallel
from radixserve.engine.cpu_affinity import bind_near_gpu
from radixserve.engine.grammar_wait import GrammarWaitlist
from radixserve.engine.messages import GenerateRequest, RequestOutput
from radixserve.engine.model_stack import load_rank_model, make_kv_memory
from radixserve.engine.tensor_parallel import start_ranks
from radixserve.grammar.spec import grammar_spec
from radixserve.model.config import ModelConfig
from radixserve.process.tokenizer import load_tokenizer
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.request import Req
from radixserve.scheduler.batch import ScheduledBatch, StepInFlight
from radixserve.scheduler.prefill import QueueRoom
from radixserve.scheduler.scheduler import Scheduler
from radixserve.settings import ServerSettings

logger = logging.getLogger("radixserve")

# How long a step with nothing to run but grammars compiling waits for one of them.
GRAMMAR_WAIT_S = 0.005

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# How long a loop whose requests all wait on copies waits before stepping again (`copy_wait_s`).
COPY_WAIT_S = 0.001


@dataclass
class StepInfo:
    """What the last step did, for batch log lines and metrics."""
    batch: Optional[ScheduledBatch]
    seconds: float
    started: float = 0.0  # time.perf_counter() at the step's start
    # Of `seconds`, the time spent waiting for the device's sampled tokens; the rest was the host's.
    waited: float = 0.0


class EngineCore:
    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.device = torch.device(settings.resolved_device())
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device=cuda was asked for, but no CUDA GPU is visible")
        if not settings.disable_cpu_affinity:  # before pinned buffers and threads exist
            bind_near_gpu(self.device)
        self.dtype = DTYPES.get(settings.dtype) or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        if not settings.model_path:
            raise ValueError("model_path is required (the entry points resolve the default model)")
        self.model_path = settings.model_path
        self.model_config = ModelConfig.from_dir(self.model_path)
        self.tokenizer = load_tokenizer(settings.tokenizer_path or self.model_path)
        self.context_len = settings.context_length or self.model_config.max_position_embeddings

        # This rank's group: alone at tp_size 1 (no process group, identity collectives), else the
        # other ranks' processes. Nothing below asks which.
        self.ranks = start_ranks(settings, self.model_config, self.device)
        self.device = self.ranks.device
        try:
            self._build(settings, self.ranks.tp)
        except BaseException:
            self.shutdown()  # a tensor-parallel engine that failed to start stops its other ranks
            raise

    def _build(self, settings: ServerSettings, tp: TensorParallel) -> None:
        """The model (this rank's shard), KV memory, radix cache, scheduler and model runner."""
        self.model, self.attn_backend = load_rank_model(settings, self.device, self.dtype, self.context_len, tp)
        cfg = self.model_config
        self.kv_pool, self.req_to_token, self.memory_plan = make_kv_memory(
            settings, self.model, self.device, self.dtype, self.context_len, tp, table_cls=self.ranks.table_cls)
        max_running = self.req_to_token.max_requests
        self.cache = self._make_cache(tp)
        self.storage = self._make_storage()
        # A hybrid's cache keeps a state where the client marks a branch point; a prompt that comes
        # unmarked (rendered by the client) marks the end of its ChatML system turn from its tokens.
        self.system_turns = SystemTurns.of(self.tokenizer) \
            if self.cache.states is not None and self.tokenizer is not None else None
        eos = list(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.scheduler = Scheduler(settings, self.cache, self.req_to_token, context_len=self.context_len,
                                   eos_token_ids=eos, decode_text=self._decode_tail if self.tokenizer else None,
                                   device_type=self.device.type)
        self.runner = self.ranks.make_runner(
            self.model, self.kv_pool, self.req_to_token, settings.random_seed, copier=self.cache.copier,
            state_copier=self.kv_pool.snapshots if self.cache.keeps_prefixes else None,
            storage=self.storage.store if self.storage is not None else None,
            cuda_graph_max_bs=min(settings.cuda_graph_max_bs, max_running),
            disable_cuda_graph=settings.disable_cuda_graph)
        self.runner.eos_token_ids = sorted(set(eos))
        if self.memory_plan is not None:
            if self.runner.graphs is not None:
                self.memory_plan.graph_bytes_captured = self.runner.graphs.pool_bytes
            logger.info("memory: %s", self.memory_plan.describe())
        # The reasoning format a grammar waits behind (grammar_after_reasoning): its tags' ids.
        self.reasoning = reasoning_format(settings.reasoning_parser, self.tokenizer) \
            if settings.reasoning_parser is not None and self.tokenizer is not None else None
        self.grammar_wait = GrammarWaitlist(self.tokenizer, cfg.vocab_size, eos,
                                            compile_timeout_s=settings.grammar_compile_timeout_s,
                                            cache_mb=settings.grammar_cache_mb, reasoning=self.reasoning)
        if self.tokenizer is not None:
            # Reading a 150k vocabulary into xgrammar takes a second: at start-up, not in a step.
            try:
                self.runner.grammars = self.grammar_wait.compilers
            except Exception as e:  # noqa: BLE001: serve without grammars rather than not at all
                logger.warning("constrained decoding is off: xgrammar cannot read this tokenizer (%s)", e)
                self.grammar_wait.disable(f"constrained decoding is off on this server: {e}")
        self.last_step = StepInfo(None, 0.0)
        # The last step launched nothing and no request came since (`copy_wait_s`).
        self.stepped_idle = False
        self.overlap = not settings.disable_overlap_schedule
        self.in_flight: Optional[StepInFlight] = None  # the launched step whose tokens are unread
        if self.device.type == "cuda" and not settings.skip_warmup:
            self.warmup()
        logger.info("engine ready: model=%s device=%s dtype=%s weights=%s kv_cache=%s kv_pool=%d tokens page_size=%d "
                    "max_running=%d tp_size=%d", self.model_path, self.device, self.dtype,
                    "fp8" if self.model.fp8 is not None else "unquantized", self.kv_pool.k_buffers[0].dtype,
                    self.pool_size, settings.page_size, max_running, tp.size)

    def _make_cache(self, tp: TensorParallel) -> OwnedPrefixCache:
        """The prefix cache (cache/factory.py picks it) and what it says about itself at start-up."""
        s, arch = self.settings, self.model_config.architecture
        recurrent = self.model_config.has_recurrent_state
        host = make_host_tier(s, self.kv_pool, tp.min_int)
        cache = build_prefix_cache(s, self.kv_pool, host, recurrent=recurrent)
        snapshots = self.kv_pool.snapshots
        if recurrent and snapshots is None and not s.disable_radix_cache:
            logger.warning("prefix caching is off for %s: --mamba-cache-size 0 keeps no recurrent-state snapshot, "
                           "so every request computes its whole prompt (cached_tokens 0)", arch)
        if snapshots is not None and cache.keeps_prefixes:
            logger.info("prefix cache: %d recurrent-state snapshots of %.1f MiB on each of %d rank(s)",
                        snapshots.num_slots, snapshots.bytes_per_slot / 2**20, tp.size)
        if host is not None and cache.keeps_prefixes:
            tokens = host.pool.allocator.total_tokens
            logger.info("host tier: %d tokens (%.1f GB) on each of %d rank(s), %s", tokens,
                        tokens * host.pool.bytes_per_token / 1e9, tp.size, s.hicache_write_policy)
            if host.snapshots is not None:
                logger.info("host tier: %d recurrent-state snapshots (%.1f GB) on each of %d rank(s)",
                            host.snapshots.num_slots, host.snapshots.total_bytes / 1e9, tp.size)
            elif snapshots is not None:
                logger.warning("the host tier keeps no recurrent-state snapshot (--mamba-host-cache-size 0): "
                               "prefixes evicted to it resume no request of %s", arch)
        return cache

    def _make_storage(self) -> Optional[StorageTier]:
        """The storage tier (--storage-dir), told what computing a token costs on this model: on this
        rank's shard under tensor parallelism (its parameters, its query heads), as a read costs this
        rank's shard of the KV (the ranks compute, and read, side by side)."""
        cfg = self.model_config
        params = sum(p.numel() for name, p in self.model.named_parameters() if "embed_tokens" not in name)
        return make_storage_tier(self.settings, self.cache, self.kv_pool, model=model_identity(self.model_path),
                                 flops_per_token=2.0 * params, hidden=cfg.hidden_size,
                                 attention_flops_per_pair=4.0 * cfg.num_kv_layers * cfg.q_size / self.ranks.size,
                                 inbox=self.ranks.storage_inbox, context_len=self.context_len)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any (a tp_size 1 engine holds nothing to stop),
        and finish the storage tier's writes."""
        if getattr(self, "storage", None) is not None:
            self.storage.close(self.cache, self.kv_pool)
            runner = getattr(self, "runner", None)
            if runner is not None and hasattr(runner, "send_copies"):
                runner.send_copies()  # the other ranks write their shards of those pages before they stop
        self.ranks.close()

    @property
    def pool_size(self) -> int:
        return self.kv_pool.allocator.total_tokens

    def _decode_tail(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # ------------------------------------------------------------------ requests
    def make_req(self, request: GenerateRequest) -> Req:
        """Validate a request and turn it into engine state; ValueError names what is wrong."""
        ids = request.input_ids
        params = request.sampling_params
        params.validate()
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad_bias = next((t for t in params.logit_bias if t >= vocab), None)
        if bad_bias is not None:
            raise ValueError(f"logit_bias names token id {bad_bias}, outside the vocabulary [0, {vocab})")
        bad = next((t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if params.logprob_start_len >= len(ids):
            raise ValueError(f"logprob_start_len={params.logprob_start_len} is not a position of the prompt's "
                             f"{len(ids)} tokens")
        if len(ids) >= self.context_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context length is {self.context_len}")
        if len(ids) + params.max_new_tokens > self.context_len:
            raise ValueError(f"max_new_tokens={params.max_new_tokens} plus the prompt's {len(ids)} tokens "
                             f"exceeds the context length {self.context_len}")
        if len(ids) + params.max_new_tokens > self.pool_size:
            raise ValueError(f"the prompt ({len(ids)} tokens) plus max_new_tokens={params.max_new_tokens} "
                             f"does not fit in the KV pool of {self.pool_size} tokens")
        if grammar_spec(params) is not None and self.tokenizer is None:
            raise ValueError("constrained decoding (json_schema, regex, ebnf) needs the model's tokenizer")
        if params.grammar_after_reasoning and self.reasoning is None:
            raise ValueError("grammar_after_reasoning needs a reasoning parser (--reasoning-parser)")
        if request.rid in self.scheduler.reqs or request.rid in self.grammar_wait:
            raise ValueError(f"request id {request.rid!r} is already in use")
        if not is_cache_namespace(request.cache_namespace):
            raise ValueError(f"cache_namespace {request.cache_namespace!r} is not a namespace digest")
        return Req(rid=request.rid, origin_input_ids=list(ids), sampling_params=params,
                   arrival_time=request.arrival_time or time.monotonic(), arrival_seq=-1, log=request.log,
                   stream=request.stream, cache_namespace=request.cache_namespace,
                   branch_hints=self._branch_hints(request, ids))

    def _branch_hints(self, request: GenerateRequest, ids: list[int]) -> tuple[int, ...]:
        """Where the client marked that requests branch (the chat API: its system turn's end), else
        where the prompt's ChatML system turn ends; only for a cache that keeps states there."""
        hints = tuple(p for p in request.branch_hints if 0 < p < len(ids))
        if hints or self.system_turns is None:
            return hints
        end = self.system_turns.end_of(ids)
        return (end,) if end is not None else ()

    def add_request(self, request: GenerateRequest) -> None:
        self.submit(self.make_req(request))

    def submit(self, req: Req) -> None:
        """Queue a request made by `make_req`: to the scheduler, or to wait for its grammar."""
        self.stepped_idle = False  # a new request may run at once
        if grammar_spec(req.sampling_params) is not None:
            if not self.grammar_wait.add(req):
                return  # scheduled once its grammar is compiled (see _admit_compiled)
        self.scheduler.add_request(req)

    def abort(self, rid: str) -> Optional[RequestOutput]:
        req = self.scheduler.abort(rid) or self.grammar_wait.abort(rid)
        return request_output(req) if req is not None else None

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.in_flight is not None or len(self.grammar_wait) > 0

    @property
    def copy_wait_s(self) -> float:
        """How long the loop waits, the GIL let go, before the next step: COPY_WAIT_S when requests
        wait yet the last step launched nothing, none is in flight and no request came since (they
        wait for copies: a host-tier load, a storage read; or for room), else 0. A loop spinning in
        Python holds the GIL the storage tier's events thread needs to hand over a finished read, and
        a core its I/O process could use: on two cores, when the reads ran in this process, it cut
        them to about a third."""
        return COPY_WAIT_S if self.stepped_idle and self.in_flight is None and self.has_work else 0.0

    def _admit_compiled(self) -> list[RequestOutput]:
        """Move requests whose grammar finished compiling into the scheduler; outputs for those
        whose grammar failed."""
        if not len(self.grammar_wait):
            return []
        if not self.scheduler.has_work and self.in_flight is None:
            self.grammar_wait.wait(GRAMMAR_WAIT_S)  # nothing else to do: no busy loop
        ready, failed = self.grammar_wait.take_ready()
        for req in ready:
            self.scheduler.add_request(req)
        return [request_output(r) for r in failed]

    @staticmethod
    def _masks_rows(batch: ScheduledBatch) -> bool:
        """Whether a batch samples for a grammar-constrained request still running whose mask needs
        its last token on the host: one inside the reasoning its grammar waits behind does not (its
        row is decided on the device: radixserve.engine.grammar_mask, deferred rows)."""
        return any(s and r.grammar is not None and r.finish_reason is None and r.grammar.constrains_next
                   for r, s in zip(batch.reqs, batch.sample))

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one batch, then collect the step before it (or this one, without
        overlap); outputs for every request that got a token."""
        start = time.perf_counter()
        outputs = self._admit_compiled()
        previous, self.in_flight = self.in_flight, None
        collected = [previous]
        batch = self.scheduler.schedule(previous)  # collects `previous` early if it must retract
        if batch is not None:
            try:
                forward = self.runner.launch_forward(batch)
                if previous is not None and forward.may_constrain and self._masks_rows(batch):
                    # The grammar masks of this step need the previous step's tokens: they are read,
                    # and the matchers advanced, while the device runs this step's forward pass (see
                    # docs/structured_outputs.md for what it costs).
                    outputs += self._collect(previous)
                    previous = None
                self.in_flight = StepInFlight(batch, self.runner.launch_sampling(forward))
            except torch.OutOfMemoryError as e:
                outputs += self._recover_from_alloc_failure(batch, previous, e)
                previous = None
        else:
            self.runner.send_copies()  # loads started while every request waits: every rank starts them now
        outputs += self._collect(previous)
        if not self.overlap:
            collected.append(self.in_flight)
            outputs += self.sync()
        waited = sum(s.tokens.wait_s for s in collected if s is not None)
        self.last_step = StepInfo(batch, time.perf_counter() - start, start, waited)
        self.stepped_idle = batch is None
        return outputs

    def _recover_from_alloc_failure(self, batch: ScheduledBatch, previous: Optional[StepInFlight],
                                    error: torch.OutOfMemoryError) -> list[RequestOutput]:
        """A step the device could not allocate for: take it back (its requests keep their places
        and their computed KV), collect the step before it, make later steps smaller, and hand the
        allocator's cached blocks back so the next step starts unfragmented. The engine goes on;
        under tensor parallelism every rank gives the step up with it (`abandon_step`)."""
        # The failed step may have moved some layers' recurrent states on: positions can be taken
        # back, those states cannot, so nothing more is kept of them (a cache of KV alone keeps none).
        if self.cache.states is not None:
            self.cache.states.discard_states([r.req_pool_idx for r in batch.reqs])
        self.scheduler.take_back(batch)  # before `previous` is collected: nothing half computed is cached
        outputs = self._collect(previous)
        change, failed = self.scheduler.shrink_steps(batch)
        if self.model_config.has_recurrent_state:
            # Its requests start over, from the deepest state snapshot the cache holds of them.
            self.scheduler.restart(batch.reqs)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.runner.abandon_step()
        logger.warning("a step of %d requests (%d new tokens) could not allocate device memory (%s); %s",
                       len(batch.reqs), batch.num_new_tokens, str(error).split("\n")[0][:200], change)
        return outputs + [request_output(r) for r in failed]

    def sync(self) -> list[RequestOutput]:
        """Wait for the step in flight, if any, and process its tokens."""
        step, self.in_flight = self.in_flight, None
        return self._collect(step)

    def _collect(self, step: Optional[StepInFlight]) -> list[RequestOutput]:
        """Outputs for the requests the step updated that are due one: a finished request, a first
        token, and a streamed request's --stream-interval tokens (request_output sends every
        token since the last output)."""
        if step is None:
            return []
        interval = self.settings.stream_interval
        return [request_output(r) for r in self.scheduler.collect(step)
                if r.finish_reason is not None or r.sent_len == 0
                or (r.stream and len(r.output_ids) - r.sent_len >= interval)]

    def warmup(self) -> float:
        """Serve a few throw-away requests, then forget them: compiles every Triton kernel variant
        and loads every sampling kernel the first real requests would otherwise wait for (a
        compile takes seconds; at a steady request rate every request arriving meanwhile would see
        it in its TTFT). Shapes: one long prompt alone, then a few tokens after it alone (a long
        prefix hit in a batch too small to fill the GPU: the extend kernel splits the prefix, and
        the merge kernel runs), a batch of shorter prompts sharing a prefix (prefix hits, mixed
        prefill + decode steps), greedy and filtered sampling. Returns the seconds it took."""
        start = time.perf_counter()
        vocab = self.model_config.vocab_size
        rng = torch.Generator().manual_seed(0)
        longest = max(2, min(1100, self.context_len - 8, self.pool_size // 4))
        short = max(2, min(300, longest // 2))

        def ids(n: int) -> list[int]:
            return torch.randint(0, vocab, (n,), generator=rng).tolist()

        shared = ids(short // 2)
        first = ids(longest)
        prompts = [first, first + ids(min(16, max(1, self.context_len - 8 - longest)))] \
            + [shared + ids(short - len(shared)) for _ in range(32)]
        greedy = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
        filtered = SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05,
                                  ignore_eos=True)
        for i, prompt in enumerate(prompts):
            need = len(prompt) + greedy.max_new_tokens
            if self.pool_size - need * (i + 1) < 0:
                break
            self.add_request(GenerateRequest(rid=f"warmup-{i}", input_ids=prompt,
                                             sampling_params=greedy if i % 2 else filtered))
            if i < 2:  # the long prompt runs alone, then its continuation
                while self.has_work:
                    self.step()
        while self.has_work:
            self.step()
        self.runner.warm_grammar_mask()
        self.cache.flush()
        self.cache.waiting.drain_touched()
        self.cache.reset_counters()
        self.scheduler.reset_stats()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)  # the peaks in stats() are serving's
        seconds = time.perf_counter() - start
        logger.info("warm-up: %d requests in %.2f s", len(prompts), seconds)
        return seconds

    def flush_cache(self) -> bool:
        if self.scheduler.has_work:
            return False
        self.sync()  # only finished requests' dropped tokens can be in flight here
        return self.cache.flush()

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def queue_room(self) -> QueueRoom:
        """Room the running batch has for new requests now (what `--max-queued-requests` does not count)."""
        return self.scheduler.queue_room()

    def stats(self) -> dict[str, Any]:
        c, s = self.cache.counters, self.scheduler.stats
        free = self.kv_pool.allocator.free_tokens
        held = self.scheduler.held_by_running()
        used_by_tokens = sum(r.kv_len - r.locked_len for r in self.scheduler.running)
        return {
            "pool_tokens": self.pool_size,
            "free_tokens": free,
            "evictable_tokens": self.cache.memory.evictable,
            "protected_tokens": self.cache.memory.protected,
            "held_by_running_tokens": held,
            # Slots a running request reserved (whole pages) but holds no token in.
            "fragmentation": (held - used_by_tokens) / held if held else 0.0,
            "token_usage": 1.0 - (free + self.cache.memory.evictable) / self.pool_size,
            "tree_nodes": self.cache.num_nodes,
            "running_requests": len(self.scheduler.running),
            "queued_requests": len(self.scheduler.waiting),
            "prompt_tokens": c.prompt_tokens,
            "cached_prompt_tokens": c.cached_prompt_tokens,
            "inserted_tokens": c.inserted_tokens,
            "evicted_tokens": c.evicted_tokens,
            "hit_rate": c.hit_rate,
            **self._tier_stats(),
            **self.cache.snapshot_stats(),
            "retractions": s.num_retractions,
            "alloc_failures": s.alloc_failures,
            "in_batch_deferrals": s.in_batch_deferrals,
            "continued_turns": s.continued_turns,
            "prefix_holds": s.prefix_holds,
            "new_token_ratio": self.scheduler.new_token_ratio,
            **self._device_memory_stats(),
        }

    def _device_memory_stats(self) -> dict[str, Any]:
        """What torch's allocator holds on the device now and at most since the warm-up (reserved
        beyond allocated is fragmentation); empty on the CPU."""
        if self.device.type != "cuda":
            return {}
        return {"device_allocated_bytes": torch.cuda.memory_allocated(self.device),
                "device_reserved_bytes": torch.cuda.memory_reserved(self.device),
                "device_peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
                "device_peak_reserved_bytes": torch.cuda.max_memory_reserved(self.device)}

    def _tier_stats(self) -> dict[str, Any]:
        """The hit rate per tier and the host tier's pool and traffic (zeros without one, so every
        stats dict has the same keys)."""
        c = self.cache.counters
        return {
            "device_hit_rate": c.device_hit_rate,
            "host_hit_rate": c.host_hit_rate,
            "host_cached_prompt_tokens": c.host_cached_prompt_tokens,
            **self.cache.tier_stats(),
        }


def request_output(req: Req) -> RequestOutput:
    """What is new for the caller in req since its last output (and marks it sent). Made for
    every request with news every step: no log probabilities are the shared empty tuple, not a
    new list each."""
    params = req.sampling_params
    new = req.output_ids[req.sent_len:]
    new_logprobs = req.output_logprobs[req.sent_len:] if params.return_logprob else ()
    first = req.sent_len == 0 and bool(new)
    req.sent_len = len(req.output_ids)
    input_logprobs = req.input_logprobs if first and params.wants_prompt_logprobs else ()
    return RequestOutput(
        rid=req.rid, new_token_ids=new, new_logprobs=new_logprobs, input_logprobs=input_logprobs,
        finished=req.finish_reason is not None,
        finish_reason=req.finish_reason, prompt_tokens=len(req.origin_input_ids),
        cached_tokens=max(req.cached_tokens, 0), completion_tokens=len(req.output_ids),
        ttft=(req.first_token_time - req.arrival_time) if first and req.first_token_time else None,
        queue_time=(req.admitted_time - req.arrival_time) if first and req.admitted_time else None)


def new_request_id() -> str:
    return uuid.uuid4().hex
