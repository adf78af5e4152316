"""Turns a scheduled batch into one forward pass and samples the next tokens.

Per step the host builds every index the batch needs in one int64 buffer and sends it to the
device in one copy; decode-only batches of up to `cuda_graph_max_bs` requests replay a captured
CUDA graph (see `radixserve.engine.cuda_graph`); sampling runs on the device and the chosen ids
come back in one small copy, the step's only host sync.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from radixserve.attention.base import ForwardBatch, ForwardMode
from radixserve.cache.kv_pool import KVPool, ReqToTokenPool
from radixserve.engine.cuda_graph import DecodeCudaGraphs, supports_cuda_graphs
from radixserve.model.sampler import sample
from radixserve.scheduler.request import Req
from radixserve.scheduler.scheduler import ScheduledBatch

logger = logging.getLogger("radixserve")


def _token_at(req: Req, pos: int) -> int:
    """req.fill_ids[pos] without building the concatenated list."""
    n = len(req.origin_input_ids)
    return req.origin_input_ids[pos] if pos < n else req.output_ids[pos - n]


def _tokens(req: Req, start: int, end: int) -> list[int]:
    """req.fill_ids[start:end] without building the whole concatenated list."""
    origin, n = req.origin_input_ids, len(req.origin_input_ids)
    if end <= n:
        return origin[start:end]
    if start >= n:
        return req.output_ids[start - n:end - n]
    return origin[start:] + req.output_ids[:end - n]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_pool: KVPool, req_to_token: ReqToTokenPool,
                 device: torch.device, random_seed: int = 0, *, cuda_graph_max_bs: int = 256,
                 disable_cuda_graph: bool = False):
        self.model = model
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.device = torch.device(device)
        self.default_generator = torch.Generator(device=self.device)
        self.default_generator.manual_seed(random_seed)
        self.graphs: Optional[DecodeCudaGraphs] = None
        if not disable_cuda_graph and supports_cuda_graphs(model, self.device):
            self.graphs = DecodeCudaGraphs(model, kv_pool, req_to_token, self.device, cuda_graph_max_bs)
            self.graphs.capture()
        self.num_graph_steps = 0
        self.num_eager_steps = 0

    # ------------------------------------------------------------------ batch building
    @staticmethod
    def decode_columns(sb: ScheduledBatch) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """input_ids, positions, out_cache_loc, req_pool_indices, seq_lens of a decode-only batch."""
        reqs = sb.reqs
        positions = list(sb.prefix_lens)
        input_ids = [_token_at(r, p) for r, p in zip(reqs, positions)]
        out_cache_loc = [r.slots[p] for r, p in zip(reqs, positions)]
        req_pool_indices = [r.req_pool_idx for r in reqs]
        seq_lens = [p + 1 for p in positions]
        return input_ids, positions, out_cache_loc, req_pool_indices, seq_lens

    def _to_device(self, values: list[int]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.int64)
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host

    def build_forward_batch(self, sb: ScheduledBatch) -> ForwardBatch:
        decode = sb.is_decode_only
        seq_lens = [p + n for p, n in zip(sb.prefix_lens, sb.extend_lens)]
        if decode:
            input_ids, positions, out_cache_loc, req_pool_indices, seq_lens = self.decode_columns(sb)
            logits_indices = list(range(len(sb.reqs)))
        else:
            input_ids, positions, out_cache_loc, logits_indices = [], [], [], []
            offset = 0
            for req, prefix, n, samples in zip(sb.reqs, sb.prefix_lens, sb.extend_lens, sb.sample):
                end = prefix + n
                input_ids.extend(_tokens(req, prefix, end))
                positions.extend(range(prefix, end))
                out_cache_loc.extend(req.slots[prefix:end])
                offset += n
                if samples:
                    logits_indices.append(offset - 1)
            req_pool_indices = [r.req_pool_idx for r in sb.reqs]
        # One host-to-device copy for every index of the step; the tensors are views of it.
        parts = (input_ids, positions, out_cache_loc, req_pool_indices, seq_lens, sb.extend_lens, sb.prefix_lens,
                 logits_indices)
        packed = self._to_device([v for part in parts for v in part])
        views, start = [], 0
        for part in parts:
            views.append(packed[start:start + len(part)])
            start += len(part)
        ids_t, pos_t, loc_t, rows_t, seq_t, ext_t, pre_t, logit_t = views
        return ForwardBatch(
            mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND, input_ids=ids_t, positions=pos_t,
            out_cache_loc=loc_t, req_pool_indices=rows_t, seq_lens=seq_t, extend_lens=ext_t, prefix_lens=pre_t,
            seq_lens_cpu=seq_lens, extend_lens_cpu=list(sb.extend_lens), prefix_lens_cpu=list(sb.prefix_lens),
            req_to_token=self.req_to_token.table, kv_pool=self.kv_pool, logits_indices=logit_t)

    # ------------------------------------------------------------------ the step
    def run_model(self, sb: ScheduledBatch) -> torch.Tensor:
        """Logits of the sampling rows, in batch order (a graph's output view for decode)."""
        if sb.is_decode_only and self.graphs is not None and self.graphs.can_run(len(sb.reqs)):
            self.num_graph_steps += 1
            return self.graphs.replay(*self.decode_columns(sb))
        self.num_eager_steps += 1
        return self.model(self.build_forward_batch(sb))

    @torch.inference_mode()
    def forward(self, sb: ScheduledBatch) -> list[int]:
        """Run the batch; returns one sampled token per request that samples, in batch order."""
        logits = self.run_model(sb)
        sampling = [r for r, s in zip(sb.reqs, sb.sample) if s]
        if not sampling:
            return []
        return sample(logits, [r.sampling_params for r in sampling], [self._generator(r) for r in sampling],
                      self.default_generator)

    def _generator(self, req) -> Optional[torch.Generator]:
        seed = req.sampling_params.seed
        if seed is None or req.sampling_params.is_greedy:
            return None
        if req.generator is None:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(seed)
        return req.generator
