"""An all-reduce through torch's symmetric memory, for a decode step's small messages.

Each rank registers one buffer that every other rank on the node maps over NVLink; the one-shot
all-reduce copies the input into it and each rank then sums all ranks' buffers directly (one kernel,
no NCCL protocol). Messages larger than the buffer (prefill) go to NCCL. NVLink multicast is not
used (it stays off on our machines). Opt-in (`--tp-all-reduce symm-mem`): NCCL is the default until
scripts/tp_allreduce_bench.py shows this faster on the machine in question.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


class SymmetricAllReduce:
    def __init__(self, device: torch.device, dtype: torch.dtype, max_numel: int):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9, a no-op after
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.dtype = dtype
        self.max_numel = max_numel
        self.buffer = symm_mem.empty(max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)  # a collective: every rank, same size
        ops = torch.ops.symm_mem
        # One kernel that stages the input itself where this torch has it; else a copy, then the op.
        self._copy_out_op = getattr(ops, "one_shot_all_reduce_copy_out", None)
        self._out_op = getattr(ops, "one_shot_all_reduce_out", None)
        self._op = ops.one_shot_all_reduce

    def __call__(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """x summed over the ranks (a new tensor), or None when x does not fit (the caller uses NCCL)."""
        n = x.numel()
        if n > self.max_numel or x.dtype != self.dtype or not x.is_contiguous():
            return None
        staged, out = self.buffer[:n], torch.empty_like(x)
        if self._copy_out_op is not None:
            self._copy_out_op(staged, x.view(-1), "sum", self.group_name, out.view(-1))
            return out
        staged.copy_(x.view(-1))
        if self._out_op is not None:
            self._out_op(staged, "sum", self.group_name, out.view(-1))
            return out
        return self._op(staged, "sum", self.group_name).view_as(x)
