"""Logit processing before sampling: min_new_tokens, logit_bias and the repetition, frequency and
presence penalties, batched on the logits' device.

Only rows whose SamplingParams ask for one of these are touched, and a batch where no row asks
pays nothing (`process_logits` returns the logits it was given). The host sends each asking row's
seen token ids once per step (the prompt for repetition_penalty, the output for every penalty) as
one flat list; the device turns them into a [rows, vocab] count tensor with one scatter-add, so no
Python loop ever runs over the vocabulary. A token still on the device (overlap scheduling) is
sent as its placeholder and resolved there by `resolve`.

Order, as vLLM applies them: min_new_tokens and logit_bias, then repetition_penalty (Hugging
Face's: a seen token's logit is divided by the penalty when positive, multiplied when negative),
then frequency_penalty and presence_penalty (OpenAI's: logit - count * frequency - (count > 0) *
presence, over output tokens). Temperature and the top-k/top-p/min-p filters come after, in the
sampler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from radixserve.sampling_params import SamplingParams


@dataclass
class ProcessingRow:
    """One sampling row as logit processing sees it."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    # Output tokens before this step; a token still on the device is its placeholder (negative).
    output_ids: Sequence[int]

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)


Resolve = Callable[[torch.Tensor], torch.Tensor]


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _apply_sparse(logits: torch.Tensor, rows: Sequence[ProcessingRow], active: list[int],
                  eos_token_ids: Sequence[int]) -> None:
    """min_new_tokens (-inf on EOS and stop_token_ids) and logit_bias, in one indexed add."""
    vocab = logits.shape[-1]
    row_idx: list[int] = []
    token_idx: list[int] = []
    values: list[float] = []
    for i in active:
        p = rows[i].params
        if rows[i].num_generated < p.min_new_tokens:
            banned = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos_token_ids)
            for token in banned:
                if token < vocab:
                    row_idx.append(i)
                    token_idx.append(token)
                    values.append(float("-inf"))
        for token, bias in p.logit_bias.items():
            row_idx.append(i)
            token_idx.append(token)
            values.append(bias)
    if row_idx:
        index = _to_device([row_idx, token_idx], torch.int64, logits.device)
        logits.index_put_((index[0], index[1]), _to_device(values, torch.float32, logits.device), accumulate=True)


def _token_counts(rows: Sequence[Sequence[int]], vocab: int, device: torch.device,
                  resolve: Optional[Resolve]) -> torch.Tensor:
    """[len(rows), vocab] float32: how often each id occurs in each row (placeholders resolved)."""
    flat: list[int] = []
    owner: list[int] = []
    for r, ids in enumerate(rows):
        flat.extend(ids)
        owner.extend([r] * len(ids))
    counts = torch.zeros((len(rows), vocab), dtype=torch.float32, device=device)
    if not flat:
        return counts
    packed = _to_device([flat, owner], torch.int64, device)
    ids = packed[0]
    if resolve is not None and min(flat) < 0:
        ids = resolve(ids)
    counts.index_put_((packed[1], ids), torch.ones(len(flat), dtype=torch.float32, device=device), accumulate=True)
    return counts


# Penalised rows processed at once: each slice holds a few [rows, vocab] float32 temporaries, so
# a large batch's working memory stays that of PENALTY_SLICE_ROWS rows (radixserve.engine.memory_plan).
PENALTY_SLICE_ROWS = 256


def _apply_penalties(logits: torch.Tensor, rows: Sequence[ProcessingRow], penalized: list[int],
                     resolve: Optional[Resolve]) -> None:
    for start in range(0, len(penalized), PENALTY_SLICE_ROWS):
        _apply_penalties_slice(logits, rows, penalized[start:start + PENALTY_SLICE_ROWS], resolve)


def _apply_penalties_slice(logits: torch.Tensor, rows: Sequence[ProcessingRow], penalized: list[int],
                           resolve: Optional[Resolve]) -> None:
    vocab, device = logits.shape[-1], logits.device
    params = [rows[i].params for i in penalized]
    index = _to_device(penalized, torch.int64, device)
    sub = logits.index_select(0, index)
    output_counts = _token_counts([rows[i].output_ids for i in penalized], vocab, device, resolve)
    factors = _to_device([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
                         torch.float32, device)
    repetition, frequency, presence = (f[:, None] for f in factors.unbind(dim=1))
    if any(p.repetition_penalty != 1.0 for p in params):
        prompts = [rows[i].prompt_ids if p.repetition_penalty != 1.0 else () for i, p in zip(penalized, params)]
        seen = (output_counts > 0) | (_token_counts(prompts, vocab, device, None) > 0)
        scaled = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen, scaled, sub)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        sub = sub - frequency * output_counts - presence * (output_counts > 0).float()
    logits.index_copy_(0, index, sub)


def process_logits(logits: torch.Tensor, rows: Sequence[ProcessingRow], eos_token_ids: Sequence[int],
                   resolve: Optional[Resolve] = None) -> torch.Tensor:
    """The logits [S, V] the sampler should draw from: `logits` itself when no row processes
    them, else a float32 copy with every row's processing applied (the input is left intact, so
    log probabilities can still be taken from the model's own logits)."""
    active = [i for i, r in enumerate(rows) if r.params.processes_logits]
    if not active:
        return logits
    out = logits.to(torch.float32, copy=True)
    _apply_sparse(out, rows, active, eos_token_ids)
    penalized = [i for i in active if rows[i].params.has_penalties]
    if penalized:
        _apply_penalties(out, rows, penalized, resolve)
    return out
