"""Turns a scheduled batch into one forward pass and samples the next tokens.

Per step the host builds every index the batch needs in one int64 buffer and sends it to the
device in one copy; decode-only batches of up to `cuda_graph_max_bs` requests replay a captured
CUDA graph (see `radixserve.engine.cuda_graph`); sampling runs on the device and the chosen ids
come back in one small copy, the step's only host sync.

`launch` queues all of that and returns a `StepFuture` without waiting, so the host can build
the next step while the device runs this one (overlap scheduling). Each step's sampled ids also
go to `sampled` (`LastSampledTokens`), from which a later step reads a token the host has not
seen yet. `launch` is `launch_forward` then `launch_sampling`: between the two the engine may
read the previous step's tokens (a grammar's mask needs them) while the device runs the forward
pass.
"""

from __future__ import annotations

import logging
import time
from array import array
from dataclasses import dataclass
from functools import reduce
from operator import or_
from typing import Optional, Sequence

import torch

from radixserve.attention.base import ForwardBatch, ForwardMode
from radixserve.cache.kv_pool import KVPool, ReqToTokenPool, int64_tensor
from radixserve.engine.cuda_graph import DecodeCudaGraphs, supports_cuda_graphs
from radixserve.engine.grammar_mask import GrammarMask
from radixserve.engine.prompt_logprobs import PromptLogprobPlan, plan_prompt_logprobs
from radixserve.engine.sampled_tokens import LastSampledTokens
from radixserve.model.logit_processing import ProcessingRow, process_logits
from radixserve.model.logprobs import LogprobTensors, gather_logprobs, token_logprobs
from radixserve.model.sampler import sample_tensor
from radixserve.sampling_params import (CONSTRAINED, PROCESSES_LOGITS, RETURNS_LOGPROBS, SAMPLES, SEEDED,
                                        TokenLogprob)
from radixserve.scheduler.request import Req
from radixserve.scheduler.batch import ScheduledBatch

logger = logging.getLogger("radixserve")


def _token_at(req: Req, pos: int) -> int:
    """req.fill_ids[pos] without building the concatenated list; a token still on the device is
    its row's placeholder (see LastSampledTokens)."""
    n = len(req.origin_input_ids)
    if pos < n:
        return req.origin_input_ids[pos]
    if pos - n < len(req.output_ids):
        return req.output_ids[pos - n]
    assert pos == n + len(req.output_ids) and req.pending > 0, "only the first pending token can be an input"
    return LastSampledTokens.placeholder(req.req_pool_idx)


def _tokens(req: Req, start: int, end: int) -> list[int]:
    """req.fill_ids[start:end] without building the whole concatenated list (pending as above)."""
    origin, n = req.origin_input_ids, len(req.origin_input_ids)
    if end <= n:
        return origin[start:end]
    known = n + len(req.output_ids)
    if end > known:  # the last input is the token the previous step is still sampling
        return _tokens(req, start, end - 1) + [_token_at(req, end - 1)]
    if start >= n:
        return req.output_ids[start - n:end - n]
    return origin[start:] + req.output_ids[:end - n]


def _outputs_before_step(req: Req) -> list[int]:
    """req's output tokens before the step being launched: the host's, then a placeholder for the
    one a step still in flight is sampling (schedule() already counted this step's in `pending`)."""
    on_device = req.pending - 1
    if on_device <= 0:
        return req.output_ids
    return req.output_ids + [LastSampledTokens.placeholder(req.req_pool_idx)] * on_device


@dataclass
class StepFuture:
    """The sampled ids of a launched step (and the log probabilities asked for), on their way to
    the host."""
    host_ids: Optional[torch.Tensor]  # pinned on CUDA; None when the step samples nothing
    event: Optional["torch.cuda.Event"]
    host_logprobs: Optional[LogprobTensors] = None
    # Prompt log probabilities gathered by this step, and which request each belongs to.
    host_prompt_logprobs: Optional[LogprobTensors] = None
    prompt_plan: Optional[PromptLogprobPlan] = None
    # Seconds result() waited for the device: the part of the step's device time the host's work
    # did not cover (about 0 when the host is the bottleneck).
    wait_s: float = 0.0

    def result(self) -> list[int]:
        if self.host_ids is None:
            return []
        if self.event is not None:
            start = time.perf_counter()
            self.event.synchronize()
            self.wait_s = time.perf_counter() - start
        return self.host_ids.tolist()

    def logprobs(self) -> Optional[list[Optional[TokenLogprob]]]:
        """Per sampling row, in batch order: its token's log probabilities, None where the request
        did not ask; None when no row asked. Call after result()."""
        if self.host_logprobs is None or self.host_ids is None:
            return None
        return self.host_logprobs.per_row(len(self.host_ids))

    def prompt_logprobs(self) -> Optional[list[list[TokenLogprob]]]:
        """Per request of the batch, in order: the prompt log probabilities this step gathered for
        it (often none); None when no request gathered any. Call after result()."""
        if self.host_prompt_logprobs is None or self.prompt_plan is None:
            return None
        if self.event is not None:
            self.event.synchronize()
        return self.prompt_plan.split(self.host_prompt_logprobs.per_row(len(self.prompt_plan.targets)))


@dataclass
class LaunchedForward:
    """A step whose forward pass is queued and whose sampling is not yet."""
    batch: ScheduledBatch
    logits: torch.Tensor  # the sampling rows' logits in batch order, then the prompt log probability rows
    sampling: list[Req]
    pool_rows: list[int]  # each sampling request's req_to_token row (taken now: a finished request drops it)
    prompt: Optional[PromptLogprobPlan]
    flags: int  # the sampling requests' sampling_flags OR-ed (radixserve.sampling_params)

    @property
    def may_constrain(self) -> bool:
        """Whether a sampling request may have a grammar (else no row is masked)."""
        return bool(self.flags & CONSTRAINED)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_pool: KVPool, req_to_token: ReqToTokenPool,
                 device: torch.device, random_seed: int = 0, *, cuda_graph_max_bs: int = 1024,
                 disable_cuda_graph: bool = False, sampled: Optional[LastSampledTokens] = None):
        self.model = model
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.device = torch.device(device)
        self.default_generator = torch.Generator(device=self.device)
        self.default_generator.manual_seed(random_seed)
        # A tensor-parallel rank passes its own (radixserve.engine.tensor_parallel).
        self.sampled = sampled if sampled is not None else LastSampledTokens(req_to_token.max_requests, self.device)
        self.graphs: Optional[DecodeCudaGraphs] = None
        if not disable_cuda_graph and supports_cuda_graphs(model, self.device):
            self.graphs = DecodeCudaGraphs(model, kv_pool, req_to_token, self.device, cuda_graph_max_bs,
                                           self.sampled)
            self.graphs.capture()
        self.num_graph_steps = 0
        self.num_eager_steps = 0
        # Masked by min_new_tokens until a request has that many tokens (set by the engine).
        self.eos_token_ids: list[int] = []
        # Set by the engine when it can serve grammars (GrammarCompilers); the mask buffer is made
        # at the first constrained step.
        self.grammars = None
        self._grammar_mask: Optional[GrammarMask] = None

    # ------------------------------------------------------------------ batch building
    @staticmethod
    def decode_columns(sb: ScheduledBatch) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """input_ids, positions, out_cache_loc, req_pool_indices, seq_lens of a decode-only batch."""
        reqs = sb.reqs
        positions = list(sb.kv_lens_before)
        # Each input is its request's newest token, found without _token_at's per-request call in
        # the two usual cases: still being sampled by the step in flight (overlap scheduling), it
        # sits just past the host's tokens and is read on the device (its row's placeholder);
        # else it is the host's last output token.
        known = [len(r.origin_input_ids) + len(r.output_ids) for r in reqs]
        placeholder = LastSampledTokens.placeholder
        input_ids = [placeholder(r.req_pool_idx) if p == k and r.pending
                     else r.output_ids[-1] if p == k - 1 and r.output_ids
                     else _token_at(r, p)
                     for r, p, k in zip(reqs, positions, known)]
        out_cache_loc = [r.slots[p] for r, p in zip(reqs, positions)]
        req_pool_indices = [r.req_pool_idx for r in reqs]
        seq_lens = [p + 1 for p in positions]
        return input_ids, positions, out_cache_loc, req_pool_indices, seq_lens

    def _to_device(self, values: Sequence[int]) -> torch.Tensor:
        host = int64_tensor(values)
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host

    def build_forward_batch(self, sb: ScheduledBatch, extra_logit_rows: Optional[list[int]] = None) -> ForwardBatch:
        """extra_logit_rows: token rows whose logits are computed after the sampling rows (prompt
        log probabilities; extend batches only)."""
        decode, parts, resolve = self.batch_parts(sb, extra_logit_rows)
        return self.batch_from_parts(decode, parts, resolve)

    def batch_parts(self, sb: ScheduledBatch, extra_logit_rows: Optional[list[int]] = None
                    ) -> tuple[bool, tuple[list[int], ...], bool]:
        """(decode-only, the step's index lists in `batch_from_parts`' order, whether an input id is
        a placeholder to resolve on the device). extra_logit_rows: as in `build_forward_batch`."""
        decode = sb.is_decode_only
        if decode:
            input_ids, positions, out_cache_loc, req_pool_indices, seq_lens = self.decode_columns(sb)
            logits_indices = list(range(len(sb.reqs)))
        else:
            seq_lens = [p + n for p, n in zip(sb.kv_lens_before, sb.extend_lens)]
            input_ids, positions, out_cache_loc, logits_indices = [], [], [], []
            offset = 0
            for req, prefix, n, samples in zip(sb.reqs, sb.kv_lens_before, sb.extend_lens, sb.sample):
                end = prefix + n
                input_ids.extend(_tokens(req, prefix, end))
                positions.extend(range(prefix, end))
                out_cache_loc.extend(req.slots[prefix:end])
                offset += n
                if samples:
                    logits_indices.append(offset - 1)
            req_pool_indices = [r.req_pool_idx for r in sb.reqs]
            if extra_logit_rows:
                logits_indices = logits_indices + extra_logit_rows
        captures = [value for capture in sb.state_captures for value in capture]
        parts = (input_ids, positions, out_cache_loc, req_pool_indices, seq_lens, list(sb.extend_lens),
                 list(sb.kv_lens_before), logits_indices, captures)
        return decode, parts, any(r.pending for r in sb.reqs)

    def batch_from_parts(self, decode: bool, parts: tuple[list[int], ...], resolve: bool) -> ForwardBatch:
        # One host-to-device copy for every index of the step; the tensors are views of it. Each
        # view starts on a 16-byte boundary: Triton compiles a kernel variant per pointer
        # alignment, and views at odd offsets would make new variants (seconds of compile in the
        # middle of serving) appear whenever a batch's lengths change parity.
        flat = array("q")  # filled part by part with fromlist: faster than torch.tensor over one long list
        starts = []
        for part in parts:
            starts.append(len(flat))
            flat.fromlist(part)
            if len(flat) % 2:
                flat.append(0)
        packed = self._to_device(flat)
        views = [packed[start:start + len(part)] for start, part in zip(starts, parts)]
        ids_t, pos_t, loc_t, rows_t, seq_t, ext_t, pre_t, logit_t = views[:8]
        if resolve:
            ids_t = self.sampled.resolve(ids_t)
        seq_lens, extend_lens, prefix_lens = parts[4], parts[5], parts[6]
        return ForwardBatch(
            mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND, input_ids=ids_t, positions=pos_t,
            out_cache_loc=loc_t, req_pool_indices=rows_t, seq_lens=seq_t, extend_lens=ext_t, prefix_lens=pre_t,
            seq_lens_cpu=seq_lens, extend_lens_cpu=extend_lens, prefix_lens_cpu=prefix_lens,
            req_to_token=self.req_to_token.table, kv_pool=self.kv_pool, logits_indices=logit_t,
            state_captures=list(parts[8]) if len(parts) > 8 else [])

    # ------------------------------------------------------------------ the step
    def run_model(self, sb: ScheduledBatch, prompt: Optional[PromptLogprobPlan] = None) -> torch.Tensor:
        """Logits of the sampling rows, in batch order (a graph's output view for decode), then
        those of the prompt log probability rows. The engine's one graph-or-eager choice: a
        decode-only batch a captured graph covers replays it (`parts`: its five columns), anything
        else runs eagerly (`parts`: `batch_parts`); every rank runs what is chosen here."""
        if sb.is_decode_only and self.graphs is not None and self.graphs.can_run(len(sb.reqs)):
            graph, decode, parts, resolve = True, True, self.decode_columns(sb), False
        else:
            graph = False
            decode, parts, resolve = self.batch_parts(sb, prompt.token_rows if prompt is not None else None)
        self.announce(sb, graph, decode, parts, resolve)
        return self.run_parts(graph, decode, parts, resolve)

    def announce(self, sb: ScheduledBatch, graph: bool, decode: bool, parts: Sequence[list[int]],
                 resolve: bool) -> None:
        """Hand the chosen step to the other ranks before running it: rank 0 of a tensor-parallel
        engine sends it (`TensorParallelRunner`); an engine of one rank has no one to tell."""

    def send_copies(self) -> None:
        """Hand host-tier copies issued in a step that launched nothing to the other ranks (see
        `TensorParallelRunner`); an engine of one rank has no one to tell."""

    def abandon_step(self) -> None:
        """After a step given up part-way (the engine took it back): what the other ranks need to
        go on (`TensorParallelRunner`); an engine of one rank has nothing half done elsewhere."""

    def recapture_graphs(self) -> None:
        """Capture the decode graphs again: after a tensor-parallel group was left and joined
        anew, the collectives the old graphs captured belong to a group that is gone."""
        if self.graphs is None:
            return
        max_bs = self.graphs.max_bs
        self.graphs = None  # the old graphs and their pool go back to the device first
        torch.cuda.empty_cache()
        self.graphs = DecodeCudaGraphs(self.model, self.kv_pool, self.req_to_token, self.device, max_bs, self.sampled)
        self.graphs.capture()

    def run_parts(self, graph: bool, decode: bool, parts: Sequence[list[int]], resolve: bool) -> torch.Tensor:
        """Run a step as `run_model` chose it (on rank 0, or as rank 0 sent it)."""
        if graph:
            self.num_graph_steps += 1
            return self.graphs.replay(*parts)
        self.num_eager_steps += 1
        return self.model(self.batch_from_parts(decode, tuple(parts), resolve))

    @torch.inference_mode()
    def launch(self, sb: ScheduledBatch) -> StepFuture:
        """Queue the batch's forward pass and sampling; the ids come back through the future."""
        return self.launch_sampling(self.launch_forward(sb))

    @torch.inference_mode()
    def launch_forward(self, sb: ScheduledBatch) -> LaunchedForward:
        """Queue the batch's forward pass (no sync)."""
        prompt = plan_prompt_logprobs(sb)
        sampling = list(sb.reqs) if all(sb.sample) else [r for r, s in zip(sb.reqs, sb.sample) if s]
        flags = reduce(or_, [r.sampling_flags for r in sampling], 0)
        return LaunchedForward(sb, self.run_model(sb, prompt), sampling, [r.req_pool_idx for r in sampling], prompt,
                               flags)

    @torch.inference_mode()
    def launch_sampling(self, fwd: LaunchedForward) -> StepFuture:
        """Queue the sampling of a launched forward pass: grammar masks (from the matchers as they
        are now), logit processing, the draw, log probabilities, and the copies to the host."""
        sampling, logits = fwd.sampling, fwd.logits
        prompt_logprobs = None
        if fwd.prompt is not None:
            n = len(sampling)
            targets = self._to_device(fwd.prompt.targets)
            prompt_logprobs = gather_logprobs(logits[n:], targets, fwd.prompt.top_nums)
            logits = logits[:n]
        if not sampling:
            return self._future(None, None, prompt_logprobs, fwd.prompt) if prompt_logprobs is not None \
                else StepFuture(None, None)
        # Each per-request pass below runs only when the batch's flags say some request needs it.
        flags = fwd.flags
        params = [r.sampling_params for r in sampling]
        processed = self.process_logits(logits, sampling) if flags & PROCESSES_LOGITS else logits
        if fwd.may_constrain:
            processed = self._constrain(processed, logits, sampling)
        if flags & SAMPLES:
            generators = [self._generator(r) for r in sampling] if flags & SEEDED else [None] * len(sampling)
            ids = sample_tensor(processed, params, generators, self.default_generator)
        else:
            ids = processed.argmax(dim=-1)  # every row greedy: what sample_tensor draws then
        # Of the model's own logits (the graph's output view is still intact: nothing replays
        # before these kernels run, in stream order; masking works on a copy when it is needed).
        logprobs = token_logprobs(logits, ids, params) if flags & RETURNS_LOGPROBS else None
        self.sampled.record(self._to_device(fwd.pool_rows), ids)
        return self._future(ids, logprobs, prompt_logprobs, fwd.prompt)

    def _future(self, ids: Optional[torch.Tensor], logprobs: Optional[LogprobTensors],
                prompt_logprobs: Optional[LogprobTensors], plan: Optional[PromptLogprobPlan]) -> StepFuture:
        """Copy what the step produced to the host (pinned, behind one event on CUDA)."""
        cuda = self.device.type == "cuda"

        def host(tensors: Optional[LogprobTensors]) -> Optional[LogprobTensors]:
            return tensors.to_host(cuda) if tensors is not None else None

        if not cuda:
            return StepFuture(ids.cpu() if ids is not None else None, None, host(logprobs), host(prompt_logprobs), plan)
        host_ids = None
        if ids is not None:
            host_ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            host_ids.copy_(ids, non_blocking=True)
        future = StepFuture(host_ids, None, host(logprobs), host(prompt_logprobs), plan)
        future.event = torch.cuda.Event()
        future.event.record()
        return future

    def process_logits(self, logits: torch.Tensor, sampling: list[Req]) -> torch.Tensor:
        """min_new_tokens, logit_bias and penalties (the logits unchanged when no request asks)."""
        if not any(r.sampling_params.processes_logits for r in sampling):
            return logits
        rows = [ProcessingRow(r.sampling_params, r.origin_input_ids, _outputs_before_step(r)) for r in sampling]
        return process_logits(logits, rows, self.eos_token_ids, self.sampled.resolve)

    def _constrain(self, processed: torch.Tensor, raw: torch.Tensor, sampling: list[Req]) -> torch.Tensor:
        """The logits with the tokens each grammar-constrained row may not take masked out (in
        place; on a copy when they are the model's own logits and log probabilities read them).
        The matchers must have accepted every earlier token: the engine collects the step before
        a constrained step before it launches the constrained step's sampling."""
        if self.grammars is None:
            return processed
        rows = GrammarMask.constrained_rows(sampling)
        deferred = GrammarMask.deferred_rows_of(sampling)  # inside a reasoning that may just have ended
        if not rows and not deferred:
            return processed
        if processed is raw and any(r.sampling_params.return_logprob for r in sampling):
            processed = raw.clone()
        return self._mask().apply_(processed, sampling, rows, deferred, self.sampled.resolve)

    def _mask(self) -> GrammarMask:
        if self._grammar_mask is None:
            self._grammar_mask = GrammarMask(self.grammars, self.req_to_token.max_requests, self.device)
        return self._grammar_mask

    def warm_grammar_mask(self) -> None:
        """Allocate the mask buffers and compile the masking kernel now: the first constrained step
        would otherwise wait for both (a Triton compile takes a second or more)."""
        if self.grammars is not None:
            self._mask().warm_up()

    def forward(self, sb: ScheduledBatch) -> list[int]:
        """Run the batch and wait; one sampled token per request that samples, in batch order."""
        return self.launch(sb).result()

    def _generator(self, req) -> Optional[torch.Generator]:
        seed = req.sampling_params.seed
        if seed is None or req.sampling_params.is_greedy:
            return None
        if req.generator is None:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(seed)
        return req.generator
