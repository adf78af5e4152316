"""The per-request recurrent state of a hybrid model's linear-attention layers.

A Gated DeltaNet layer keeps no KV per token: each running request has, per such layer, the last
`kernel - 1` inputs of its short convolution (its conv window) and one fixed-size recurrent
state. This pool holds them for every request row of `req_to_token`, indexed by the row itself:
a request's state lives exactly as long as its row (taken at admission, given back when it
leaves), and nothing is allocated per step. A prompt's first piece starts from zeros (the layer
does not read the row) unless its cached prefix gave the row a snapshot's state; its later chunks
and every decode step continue it in place.

One extra row past the request rows, `scratch_row`, takes the writes of padded rows of a decode
CUDA-graph bucket (they point at request row 0, whose state belongs to a real request).

A row's state is overwritten by the row's next request: what the prefix cache keeps of it lives in
its own pool of snapshots (radixserve.cache.state_snapshots), copied out and back in by the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch


@dataclass(frozen=True)
class RecurrentStateSpec:
    """What one request row holds, per linear-attention layer (this rank's heads and channels)."""
    num_layers: int
    conv_shape: tuple[int, int]  # (kernel - 1, channels)
    ssm_shape: tuple[int, int, int]  # (v_heads, k_head_dim, v_head_dim)
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype = torch.float32

    @property
    def bytes_per_row(self) -> int:
        def size(shape: tuple[int, ...], dtype: torch.dtype) -> int:
            return prod(shape) * torch.tensor([], dtype=dtype).element_size()
        return self.num_layers * (size(self.conv_shape, self.conv_dtype) + size(self.ssm_shape, self.ssm_dtype))


class RecurrentStatePool:
    """conv[layer] [rows + 1, kernel - 1, channels] and ssm[layer] [rows + 1, v_heads, k_head_dim,
    v_head_dim] for the linear-attention layers in order (layer = the layer's index among them)."""

    def __init__(self, num_rows: int, spec: RecurrentStateSpec, device: torch.device | str):
        self.spec = spec
        self.num_rows = num_rows
        self.scratch_row = num_rows
        self.conv = [torch.zeros((num_rows + 1, *spec.conv_shape), dtype=spec.conv_dtype, device=device)
                     for _ in range(spec.num_layers)]
        self.ssm = [torch.zeros((num_rows + 1, *spec.ssm_shape), dtype=spec.ssm_dtype, device=device)
                    for _ in range(spec.num_layers)]

    @property
    def total_bytes(self) -> int:
        return (self.num_rows + 1) * self.spec.bytes_per_row
