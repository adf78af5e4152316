"""Turns a scheduled batch into one forward pass and samples the next tokens."""

from __future__ import annotations

from typing import Optional

import torch

from radixserve.attention.base import ForwardBatch, ForwardMode
from radixserve.cache.kv_pool import KVPool, ReqToTokenPool
from radixserve.model.sampler import sample
from radixserve.scheduler.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_pool: KVPool, req_to_token: ReqToTokenPool,
                 device: torch.device, random_seed: int = 0):
        self.model = model
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.device = device
        self.default_generator = torch.Generator(device=device)
        self.default_generator.manual_seed(random_seed)

    def build_forward_batch(self, sb: ScheduledBatch) -> ForwardBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        out_cache_loc: list[int] = []
        logits_indices: list[int] = []
        seq_lens: list[int] = []
        offset = 0
        for req, prefix, n, samples in zip(sb.reqs, sb.prefix_lens, sb.extend_lens, sb.sample):
            end = prefix + n
            input_ids.extend(req.fill_ids[prefix:end])
            positions.extend(range(prefix, end))
            out_cache_loc.extend(req.slots[prefix:end])
            offset += n
            if samples:
                logits_indices.append(offset - 1)
            seq_lens.append(end)

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

        mode = ForwardMode.DECODE if sb.is_decode_only else ForwardMode.EXTEND
        return ForwardBatch(
            mode=mode, input_ids=tensor(input_ids), positions=tensor(positions),
            out_cache_loc=tensor(out_cache_loc),
            req_pool_indices=tensor([r.req_pool_idx for r in sb.reqs]),
            seq_lens=tensor(seq_lens), extend_lens=tensor(sb.extend_lens), prefix_lens=tensor(sb.prefix_lens),
            seq_lens_cpu=seq_lens, extend_lens_cpu=list(sb.extend_lens), prefix_lens_cpu=list(sb.prefix_lens),
            req_to_token=self.req_to_token.table, kv_pool=self.kv_pool, logits_indices=tensor(logits_indices))

    @torch.inference_mode()
    def forward(self, sb: ScheduledBatch) -> list[int]:
        """Run the batch; returns one sampled token per request that samples, in batch order."""
        fb = self.build_forward_batch(sb)
        logits = self.model(fb)
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
