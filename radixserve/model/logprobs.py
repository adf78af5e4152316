"""Log probabilities of sampled tokens, batched on the logits' device.

They are of the model's own distribution: log_softmax of the raw logits, before logit_bias,
penalties, temperature and the top-k/top-p/min-p filters (vLLM's default; OpenAI's API documents
them as the model's). The rows that asked go through one log_softmax, one gather and one top-k at
the largest k any of them asked for; the rest of the batch pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from radixserve.sampling_params import SamplingParams, TokenLogprob

# Rows whose float32 log_softmax is taken at once: 256 rows of a 152k vocabulary are 0.16 GB, so
# a step's working memory does not grow with the batch (radixserve.engine.memory_plan).
SLICE_ROWS = 256


@dataclass
class LogprobTensors:
    """The log probabilities of one step's asking rows, on the device or copied to the host."""

    rows: list[int]  # positions in the step's sampling rows
    top_nums: list[int]  # how many top entries each asked for
    chosen: torch.Tensor  # [R] float32
    top_values: torch.Tensor  # [R, K] float32
    top_ids: torch.Tensor  # [R, K] int64

    def to_host(self, pin: bool) -> "LogprobTensors":
        def copy(t: torch.Tensor) -> torch.Tensor:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            return host.copy_(t, non_blocking=pin)
        return LogprobTensors(self.rows, self.top_nums, copy(self.chosen), copy(self.top_values),
                              copy(self.top_ids))

    def per_row(self, num_rows: int) -> list[Optional[TokenLogprob]]:
        """One entry per sampling row (None for rows that did not ask); call on host tensors."""
        out: list[Optional[TokenLogprob]] = [None] * num_rows
        chosen = self.chosen.tolist()
        values, ids = self.top_values.tolist(), self.top_ids.tolist()
        for j, (row, k) in enumerate(zip(self.rows, self.top_nums)):
            out[row] = TokenLogprob(chosen[j], ids[j][:k], values[j][:k])
        return out


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                   params: Sequence[SamplingParams]) -> Optional[LogprobTensors]:
    """Log probabilities of `token_ids` (one per row of logits [S, V]) for the rows whose params
    ask for them; None when none does. No host sync."""
    rows = [i for i, p in enumerate(params) if p.return_logprob]
    if not rows:
        return None
    top_nums = [params[i].top_logprobs_num for i in rows]
    if len(rows) == len(params):
        sub, ids = logits, token_ids
    else:
        index = torch.tensor(rows, dtype=torch.int64)
        if logits.device.type == "cuda":
            index = index.pin_memory()
        index = index.to(logits.device, non_blocking=True)
        sub, ids = logits.index_select(0, index), token_ids.index_select(0, index)
    return gather_logprobs(sub, ids, top_nums, rows)


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_nums: list[int],
                    rows: Optional[list[int]] = None) -> LogprobTensors:
    """Log probabilities of token_ids[i] under row i of logits [R, V], and the top_nums[i] most
    likely ids with theirs (one top-k at the largest). rows: the positions reported (default
    0..R-1). Many rows (a prompt's) go through in slices, so the float32 log_softmax never holds
    more than SLICE_ROWS of them. No host sync."""
    k = min(max(top_nums, default=0), logits.shape[-1])
    chosen, top_values, top_ids = [], [], []
    for begin in range(0, logits.shape[0], SLICE_ROWS):
        logprobs = torch.log_softmax(logits[begin:begin + SLICE_ROWS].float(), dim=-1)
        chosen.append(logprobs.gather(1, token_ids[begin:begin + SLICE_ROWS].view(-1, 1)).view(-1))
        if k:
            values, ids = logprobs.topk(k, dim=-1)
            top_values.append(values)
            top_ids.append(ids)
    if k:
        values_t, ids_t = _cat(top_values), _cat(top_ids)
    else:
        values_t = logits.new_empty((len(top_nums), 0), dtype=torch.float32)
        ids_t = torch.empty((len(top_nums), 0), dtype=torch.int64, device=logits.device)
    return LogprobTensors(list(range(len(top_nums))) if rows is None else rows, top_nums, _cat(chosen), values_t,
                          ids_t)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
