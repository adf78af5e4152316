"""Token sampling on the logits' device: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Which filters run is decided on the host from the SamplingParams list (never from device values,
which would stall the host until the GPU catches up). The per-row parameters travel to the device
in one copy, the whole batch is filtered with tensor operations (no per-request Python loop unless
a request brings its own seed), and the chosen ids come back to the host in one copy.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from radixserve.sampling_params import SamplingParams

# Rows filtered and drawn at once: the filters hold several [rows, vocab] float32 (and int64)
# temporaries, so a large batch is drawn in slices and its working memory stays that of
# SAMPLE_SLICE_ROWS rows (about 1.3 GB at a 152k vocabulary; radixserve.engine.memory_plan).
SAMPLE_SLICE_ROWS = 256
# Smallest exponential noise value: keeps p / E finite (E == 0 would turn a filtered-out 0 into NaN).
_MIN_NOISE = 1e-20


@dataclass
class FilterPlan:
    """What the host knows about a batch of sampling rows before anything runs on the device."""

    top_k: bool
    top_p: bool
    min_p: bool

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab: int) -> "FilterPlan":
        return cls(top_k=any(0 < p.top_k < vocab for p in params),
                   top_p=any(p.top_p < 1.0 for p in params),
                   min_p=any(p.min_p > 0.0 for p in params))


def _row_params(params: Sequence[SamplingParams], vocab: int, device: torch.device) -> torch.Tensor:
    """[S, 4] float32 on the device: temperature, top_k (vocab when off), top_p, min_p. One copy."""
    if not params:
        return torch.empty((0, 4), dtype=torch.float32, device=device)
    # top_p >= 1 keeps everything: 2.0 stays above any rounded cumulative sum. One flat list
    # through array('f'): torch.tensor over ~1,000 rows of tuples takes about twice as long.
    flat = array("f")
    flat.fromlist([value for p in params for value in (max(p.temperature, 1e-6),
                                                       float(p.top_k if 0 < p.top_k < vocab else vocab),
                                                       p.top_p if p.top_p < 1.0 else 2.0, p.min_p)])
    host = torch.frombuffer(flat, dtype=torch.float32).view(len(params), 4)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def filter_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p, row by row (rows sum to 1).

    top-k keeps the k most likely tokens; top-p keeps the most likely tokens up to and including
    the first one at which the cumulative probability reaches top_p; min-p drops tokens less likely
    than min_p times the most likely one. Each filter acts on the temperature-scaled distribution,
    in that order, and the survivors are renormalised.
    """
    vocab = logits.shape[-1]
    plan = FilterPlan.of(params, vocab)
    values = _row_params(params, vocab, logits.device)
    temps, top_ks, top_ps, min_ps = values.unbind(dim=1)
    probs = torch.softmax(logits.float() / temps[:, None], dim=-1)
    if plan.top_k or plan.top_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
        if plan.top_k:
            ranks = torch.arange(vocab, device=logits.device, dtype=torch.float32)[None, :]
            drop |= ranks >= top_ks[:, None]
        if plan.top_p:
            cum_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop |= cum_before >= top_ps[:, None]
            drop[:, 0] = False  # the most likely token always survives
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    if plan.min_p:
        floor = probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


# Kept for callers of the earlier name.
_filter_logits = filter_probs


def sample_tensor(logits: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[Optional[torch.Generator]],
                  default_generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token id per row of logits [S, V], as an int64 tensor on the logits' device (no host sync)."""
    greedy = [p.is_greedy for p in params]
    choice = logits.argmax(dim=-1)
    if all(greedy):
        return choice
    rows = [i for i, g in enumerate(greedy) if not g]
    every_row = len(rows) == len(params)
    sub = logits if every_row else logits[torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)]
    if len(rows) <= SAMPLE_SLICE_ROWS:
        drawn = _draw(sub, [params[i] for i in rows], [generators[i] for i in rows], default_generator)
    else:
        drawn = torch.cat([_draw(sub[start:start + SAMPLE_SLICE_ROWS],
                                 [params[i] for i in rows[start:start + SAMPLE_SLICE_ROWS]],
                                 [generators[i] for i in rows[start:start + SAMPLE_SLICE_ROWS]], default_generator)
                           for start in range(0, len(rows), SAMPLE_SLICE_ROWS)])
    if every_row:
        return drawn
    return choice.index_copy_(0, torch.tensor(rows, dtype=torch.int64).to(choice.device, non_blocking=True), drawn)


def _draw(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[Optional[torch.Generator]],
          default_generator: Optional[torch.Generator]) -> torch.Tensor:
    """One draw per row of logits [S, V] (every row samples)."""
    probs = filter_probs(logits, params)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, batched and branch-free.
    vocab = probs.shape[-1]
    noise = torch.empty_like(probs)
    unseeded = [j for j, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        noise.exponential_(generator=default_generator)
    else:
        if unseeded:
            idx = torch.tensor(unseeded, dtype=torch.int64).to(probs.device, non_blocking=True)
            noise[idx] = torch.empty((len(unseeded), vocab), device=probs.device).exponential_(
                generator=default_generator)
        for j, generator in enumerate(generators):
            if generator is not None:
                # A seeded request draws from its own stream only: its tokens do not depend on
                # what else shares the batch.
                noise[j] = torch.empty(vocab, device=probs.device).exponential_(generator=generator)
    return (probs / noise.clamp_min_(_MIN_NOISE)).argmax(dim=-1)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[Optional[torch.Generator]], default_generator: Optional[torch.Generator] = None) -> list[int]:
    """One token id per row of logits [S, V]; one device-to-host copy."""
    return sample_tensor(logits, params, generators, default_generator).tolist()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Set to -inf, in place, every logit of row rows[i] that bitmask row i forbids; other rows are
    untouched. bitmask: int32 [len(rows), >= ceil(V / 32)] on the logits' device, bit j of word w
    allowing token 32 * w + j (xgrammar's layout). On CUDA one Triton kernel reads the packed words;
    elsewhere the rows are unpacked with tensor operations."""
    if logits.device.type == "cuda":
        from radixserve.kernels.token_bitmask import apply_token_bitmask_rows_

        return apply_token_bitmask_rows_(logits, bitmask, rows)
    vocab, n = logits.shape[-1], bitmask.shape[0]
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    forbidden = ((bitmask[:, :, None] >> bits) & 1).reshape(n, -1)[:, :vocab] == 0
    rows = rows.long()
    if torch.equal(rows, torch.arange(n, device=rows.device)):  # the first n rows: mask their view
        logits[:n].masked_fill_(forbidden, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(forbidden, float("-inf"))
    return logits
