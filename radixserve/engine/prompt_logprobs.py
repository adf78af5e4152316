"""Prompt log probabilities of a step: which token rows get logits for them, and how the results
go back to their requests.

The logits of position q score prompt token q + 1. A prefill step computes the positions of its
prompt pieces, so the rows a request needs are those of its piece from `Req.prompt_logprobs_from`
on (the cache lookup stops there, so they are always computed); over chunked prefill each chunk
contributes its own rows, in order. The model computes lm_head for these rows after the sampling
rows (`ForwardBatch.logits_indices`); steps where no request asks plan nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from radixserve.sampling_params import TokenLogprob
from radixserve.scheduler.batch import ScheduledBatch


@dataclass
class PromptLogprobPlan:
    token_rows: list[int]  # rows of the step's flattened tokens whose logits are needed
    targets: list[int]  # the prompt token each row's logits score
    top_nums: list[int]  # how many most likely entries each row reports
    counts: list[int]  # per request of the batch, in order, how many of the rows are its

    def split(self, entries: list[Optional[TokenLogprob]]) -> list[list[TokenLogprob]]:
        """One list per request of the batch: its entries, in position order."""
        out, start = [], 0
        for n in self.counts:
            out.append(entries[start:start + n])
            start += n
        return out


def plan_prompt_logprobs(sb: ScheduledBatch) -> Optional[PromptLogprobPlan]:
    """The rows of this step's prompt log probabilities; None when no request needs any here."""
    if sb.is_decode_only or not any(r.sampling_params.wants_prompt_logprobs for r in sb.reqs):
        return None
    plan = PromptLogprobPlan([], [], [], [])
    offset = 0
    for req, prefix, n in zip(sb.reqs, sb.kv_lens_before, sb.extend_lens):
        positions = req.prompt_logprob_positions(prefix, prefix + n)
        plan.token_rows.extend(offset + q - prefix for q in positions)
        plan.targets.extend(req.origin_input_ids[q + 1] for q in positions)
        plan.top_nums.extend([req.sampling_params.top_logprobs_num] * len(positions))
        plan.counts.append(len(positions))
        offset += n
    return plan if plan.token_rows else None
