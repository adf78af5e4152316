"""The grammar mask of a step: one host fill, one copy, one kernel, for the constrained rows only.

The host buffer is allocated once (pinned on CUDA) with room for every request row: the row
indices of the step's constrained rows, then one bitmask row of ceil(vocab / 32) int32 words per
constrained row. xgrammar fills the rows in one batched call, the used prefix of the buffer goes
to the device in one non-blocking copy, and `apply_token_bitmask_` masks the logits in place from
the packed words. Unconstrained rows cost nothing; a step without constrained rows does not touch
any of this.

There are two host buffers, used in turn. A step with a constrained row is filled once the step
before has been collected, and a step with only deferred rows (below) while the step before may
still be queued: either way the step that last used the buffer being filled (two mask fills ago)
has been collected, so its copy out of it, queued before that step's sampled ids, is complete.

A request whose grammar waits behind its reasoning (radixserve.grammar.reasoning_gate) has no row
while it reasons. Its next mask depends on whether its last token ended the reasoning, which
under overlap scheduling may still be on the device: such a row is *deferred* rather than
waited for. The host fills the mask the grammar would start with (its matcher has taken nothing
yet, plus the newline tokens that may follow `</think>`), and on the device the row becomes all
allowed unless the row's last sampled token is the end of the reasoning. So a batch whose only
grammars are inside their reasoning keeps overlapping its steps.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from radixserve.engine.sampled_tokens import LastSampledTokens
from radixserve.model.sampler import apply_token_bitmask_
from radixserve.scheduler.request import Req

# Placeholders of tokens still on the device -> those tokens (LastSampledTokens.resolve).
Resolve = Callable[[torch.Tensor], torch.Tensor]


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
        # Per buffer: the mask rows, and for deferred rows the placeholder of each one's unread
        # token, then the token that ends its reasoning. On the CPU one buffer is all (nothing is
        # queued) and is also the device's.
        self._hosts = [(torch.empty(self.head + max_rows * self.words, dtype=torch.int32, pin_memory=on_cuda),
                        torch.empty(2 * max_rows, dtype=torch.int32, pin_memory=on_cuda))
                       for _ in range(2 if on_cuda else 1)]
        self._turn = 0
        self.host, self.deferred_host = self._hosts[0]
        self.on_device = torch.empty_like(self.host, device=device) if on_cuda else self.host
        self.deferred_on_device = torch.empty_like(self.deferred_host, device=device) if on_cuda \
            else self.deferred_host
        self.deferred_rows = 0  # rows masked that way so far (what the tests see of it)

    def _next_buffer(self) -> None:
        """Fill the other host buffer this time (see the module docstring)."""
        self._turn = (self._turn + 1) % len(self._hosts)
        self.host, self.deferred_host = self._hosts[self._turn]

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
        """The sampling rows a grammar constrains now (a request that finished meanwhile is left
        out: its token is dropped and its matcher may be terminated; so is one inside the
        reasoning its grammar waits behind: its row is all allowed, or deferred)."""
        return [i for i, r in enumerate(sampling)
                if r.grammar is not None and r.finish_reason is None and r.grammar.constrains_next]

    @staticmethod
    def deferred_rows_of(sampling: Sequence[Req]) -> list[int]:
        """The sampling rows inside their reasoning whose last token is still on the device (a step
        in flight samples it: `pending` counts it beside this step's): it may have ended the
        reasoning, which only the device knows yet."""
        return [i for i, r in enumerate(sampling)
                if r.grammar is not None and r.finish_reason is None and not r.grammar.constrains_next
                and r.pending > 1]

    def apply_(self, logits: torch.Tensor, sampling: Sequence[Req], rows: list[int],
               deferred: Sequence[int] = (), resolve: Optional[Resolve] = None) -> torch.Tensor:
        """Mask, in place, the logits rows `rows` of the sampling requests by their grammars'
        next-token bitmasks, and the `deferred` rows by their grammar's first bitmask when their
        unread last token (`resolve` turns its placeholder into it, on the device) ended the
        reasoning. The matchers must have accepted every earlier token."""
        self._next_buffer()
        self.fill(sampling, list(rows) + list(deferred))
        if deferred:
            self.fill_deferred(sampling, deferred, len(rows))
        return self.apply_filled_(logits, len(rows) + len(deferred), len(deferred), resolve)

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

    def fill_deferred(self, sampling: Sequence[Req], deferred: Sequence[int], first: int) -> None:
        """Deferred rows, filled by `fill` at `first` on with their matchers' first bitmasks: add the
        tokens that may follow the end of the reasoning, and note each row's unread token and the
        token that would have ended its reasoning."""
        n = len(deferred)
        bitmask = self.host[self.head + first * self.words:self.head + (first + n) * self.words].view(n, self.words)
        for k, i in enumerate(deferred):
            for token in sampling[i].grammar.after_end_allowed():
                allow_token_(bitmask[k], token)
        self.deferred_host[:n] = torch.tensor([LastSampledTokens.placeholder(sampling[i].req_pool_idx)
                                               for i in deferred], dtype=torch.int32)
        self.deferred_host[n:2 * n] = torch.tensor([sampling[i].grammar.end_id for i in deferred],
                                                   dtype=torch.int32)
        self.deferred_rows += n

    def apply_filled_(self, logits: torch.Tensor, n: int, deferred: int = 0,
                      resolve: Optional[Resolve] = None) -> torch.Tensor:
        """Queue the copy of the first n filled rows and the masking of the logits (no sync); the
        last `deferred` rows all allowed on the device unless their last token ended the reasoning."""
        used = self.head + n * self.words
        if self.on_device is not self.host:
            self.on_device[:used].copy_(self.host[:used], non_blocking=True)
        device_rows = self.on_device[:n]
        device_bitmask = self.on_device[self.head:used].view(n, self.words)
        if deferred:
            if self.deferred_on_device is not self.deferred_host:
                self.deferred_on_device[:2 * deferred].copy_(self.deferred_host[:2 * deferred], non_blocking=True)
            info = self.deferred_on_device[:2 * deferred].to(torch.int64)
            ended = resolve(info[:deferred]) == info[deferred:]
            tail = device_bitmask[n - deferred:]
            tail.copy_(torch.where(ended[:, None], tail, torch.full_like(tail, -1)))
        return apply_token_bitmask_(logits, device_bitmask, device_rows)
