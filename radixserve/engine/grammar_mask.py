"""The grammar mask of a step: one host fill, one copy, one kernel, for the constrained rows only.

The host buffer is allocated once (pinned on CUDA) with room for every request row: the row
indices of the step's constrained rows, then one bitmask row of ceil(vocab / 32) int32 words per
constrained row. xgrammar fills the rows in one batched call, the used prefix of the buffer goes
to the device in one non-blocking copy, and `apply_token_bitmask_` masks the logits in place from
the packed words. Unconstrained rows cost nothing; a step without constrained rows does not touch
any of this.

Reusing the pinned buffer is safe because the engine fills it only when no launched step is
unread: the step before has been collected (its copy out of the buffer, queued before that
step's sampled ids, is complete).
"""

from __future__ import annotations

from typing import Sequence

import torch

from radixserve.model.sampler import apply_token_bitmask_
from radixserve.scheduler.request import Req


def allow_token_(row: torch.Tensor, token: int) -> None:
    """Set token's bit in a packed int32 bitmask row (xgrammar's layout: bit j of word w allows
    token 32 * w + j), on the host."""
    word, bit = divmod(token, 32)
    row[word] = int(row[word]) | (1 << bit if bit < 31 else -(1 << 31))  # bit 31 is the int32 sign


class GrammarMask:
    def __init__(self, compilers, max_rows: int, device: torch.device):
        self.compilers = compilers
        self.device = device
        self.words = (compilers.vocab_size + 31) // 32
        # Row indices first (padded to 16 bytes so the bitmask view stays aligned), then the rows.
        self.head = -(-max_rows // 4) * 4
        self.max_rows = max_rows
        on_cuda = device.type == "cuda"
        self.host = torch.empty(self.head + max_rows * self.words, dtype=torch.int32, pin_memory=on_cuda)
        self.on_device = torch.empty_like(self.host, device=device) if on_cuda else self.host

    def warm_up(self) -> None:
        """Mask one row of zero logits with an all-allowed bitmask (compiles the kernel)."""
        logits = torch.zeros((1, self.compilers.vocab_size), dtype=torch.float32, device=self.device)
        self.on_device[:1] = 0
        self.on_device[self.head:self.head + self.words] = -1
        apply_token_bitmask_(logits, self.on_device[self.head:self.head + self.words].view(1, self.words),
                             self.on_device[:1])
        assert bool(torch.isfinite(logits).all()), "an all-allowed bitmask masked a token"

    @staticmethod
    def constrained_rows(sampling: Sequence[Req]) -> list[int]:
        """The sampling rows a grammar constrains (a request that finished meanwhile is left out: its
        token is dropped and its matcher may be terminated; so is one inside the reasoning its
        grammar waits behind: its row is all allowed)."""
        return [i for i, r in enumerate(sampling)
                if r.grammar is not None and r.finish_reason is None and r.grammar.constrains_next]

    def apply_(self, logits: torch.Tensor, sampling: Sequence[Req], rows: list[int]) -> torch.Tensor:
        """Mask, in place, the logits rows `rows` of the sampling requests by their grammars'
        next-token bitmasks. The matchers must have accepted every earlier token."""
        self.fill(sampling, rows)
        return self.apply_filled_(logits, len(rows))

    def fill(self, sampling: Sequence[Req], rows: list[int]) -> None:
        """The host's part: the rows' indices and bitmasks into the host buffer."""
        n = len(rows)
        assert 0 < n <= self.max_rows
        bitmask = self.host[self.head:self.head + n * self.words].view(n, self.words)
        grammars = [sampling[i].grammar for i in rows]
        self.compilers.fill_bitmask(grammars, bitmask)
        for k, grammar in enumerate(grammars):
            for token in grammar.also_allowed():  # a reasoning's own tokens: <think>, a newline after it
                allow_token_(bitmask[k], token)
        self.host[:n] = torch.tensor(rows, dtype=torch.int32)

    def apply_filled_(self, logits: torch.Tensor, n: int) -> torch.Tensor:
        """Queue the copy of the first n filled rows and the masking of the logits (no sync)."""
        used = self.head + n * self.words
        if self.on_device is not self.host:
            self.on_device[:used].copy_(self.host[:used], non_blocking=True)
        device_rows = self.on_device[:n]
        device_bitmask = self.on_device[self.head:used].view(n, self.words)
        return apply_token_bitmask_(logits, device_bitmask, device_rows)
