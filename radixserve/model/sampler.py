"""Token sampling on the logits' device: greedy, temperature, top-k, top-p, min-p, per-request seeds.

The whole batch is filtered with tensor operations (no per-request Python loop unless a request
brings its own seed); the chosen ids come back to the host in one copy.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from radixserve.engine.io_struct import SamplingParams


def _filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p, row by row."""
    device = logits.device
    temps = torch.tensor([max(p.temperature, 1e-6) for p in params], device=device, dtype=torch.float32)
    probs = torch.softmax(logits.float() / temps[:, None], dim=-1)
    vocab = probs.shape[-1]
    top_ks = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_ps = torch.tensor([p.top_p for p in params], device=device, dtype=torch.float32)
    min_ps = torch.tensor([p.min_p for p in params], device=device, dtype=torch.float32)
    if bool((top_ks < vocab).any()) or bool((top_ps < 1.0).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        cum_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = (ranks >= top_ks[:, None]) | (cum_before > top_ps[:, None])
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    if bool((min_ps > 0).any()):
        floor = probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[Optional[torch.Generator]], default_generator: Optional[torch.Generator] = None) -> list[int]:
    """One token id per row of logits [S, V]."""
    greedy = torch.tensor([p.is_greedy for p in params])
    if bool(greedy.all()):
        return logits.argmax(dim=-1).tolist()
    choice = logits.argmax(dim=-1)
    rows = torch.nonzero(~greedy).flatten().tolist()
    probs = _filter_logits(logits[rows], [params[i] for i in rows])
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, batched and branch-free.
    noise = torch.empty_like(probs)
    unseeded = [j for j, i in enumerate(rows) if generators[i] is None]
    if unseeded:
        noise[unseeded] = torch.empty((len(unseeded), probs.shape[-1]), device=probs.device).exponential_(
            generator=default_generator)
    for j, i in enumerate(rows):
        if generators[i] is not None:
            noise[j] = torch.empty(probs.shape[-1], device=probs.device).exponential_(generator=generators[i])
    choice[rows] = (probs / noise).argmax(dim=-1)
    return choice.tolist()
