"""The last token each request row sampled, kept on the device for steps built before the host
has read it (overlap scheduling).

Such a token is always the last input of a decoding request. The host writes it into the step's
input ids as `placeholder(row)`, -(row + 1), and `resolve` swaps every placeholder for the token
held here, on the device, inside the eager step or the captured CUDA graph alike. Stream order
makes this safe: the step that reads a token is queued after the step that wrote it.
"""

from __future__ import annotations

import torch


class LastSampledTokens:
    def __init__(self, num_rows: int, device: torch.device):
        self.ids = torch.zeros(num_rows, dtype=torch.int64, device=device)

    @staticmethod
    def placeholder(row: int) -> int:
        """The input id standing for the token that request row `row` sampled last."""
        return -(row + 1)

    def record(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        """Remember the ids just sampled by these request rows (device tensors, no sync)."""
        self.ids.index_copy_(0, rows, ids)

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids with every placeholder replaced by its row's last sampled id (no sync)."""
        rows = (-input_ids - 1).clamp_min_(0)
        return torch.where(input_ids < 0, self.ids[rows], input_ids)
