"""The attention-backend interface and the batch description every forward pass receives."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from radixserve.cache.kv_pool import KVPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # each request adds >= 1 new tokens on top of a cached prefix (prefill, chunks, mixed)
    DECODE = "decode"  # each request adds exactly one token


@dataclass
class ForwardBatch:
    """One forward pass over a ragged batch of requests.

    Tokens of all requests are concatenated: request i contributes `extend_lens[i]` new tokens
    at positions `prefix_lens[i] .. seq_lens[i]-1`, whose KV goes to `out_cache_loc`.
    Attention of a new token sees every earlier position of its request, read through
    `req_to_token[req_pool_indices[i], :seq_lens[i]]` (slots of the new tokens included).
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64 slots
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64, kv length after this pass
    extend_lens: torch.Tensor  # [B] int64
    prefix_lens: torch.Tensor  # [B] int64
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    req_to_token: torch.Tensor  # [max_requests, max_context] int64
    kv_pool: KVPool
    # Rows of the hidden states whose logits are computed (the last token of each sampling request).
    logits_indices: torch.Tensor  # [S] int64
    # Where the fp32 logits go ([S, vocab]); None: a new tensor. The decode CUDA graphs pass one
    # buffer shared by all of them, so no graph keeps logits of its own in the graph pool.
    logits_out: Optional[torch.Tensor] = None
    # Backend-private metadata, filled by AttentionBackend.init_forward.
    attn_meta: Optional[object] = field(default=None)
    # A hybrid model's states to keep on the way (extend batches only): (sequence, tokens of its new
    # ones, snapshot slot) triples laid end to end; the linear layers write the recurrent state after
    # that many of the sequence's new tokens into that snapshot slot (ScheduledBatch.state_captures).
    state_captures: list[int] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


class AttentionBackend(Protocol):
    def init_forward(self, batch: ForwardBatch) -> None:
        """Prepare per-batch metadata once, before the layers run."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: ForwardBatch, *, save_kv: bool = True) -> torch.Tensor:
        """Store k, v [T, Hkv, D] at batch.out_cache_loc (unless the caller already did:
        save_kv=False), then attend q [T, Hq, D]; returns [T, Hq*D]."""
