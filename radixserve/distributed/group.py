"""The tensor-parallel process group of one engine: NCCL on CUDA, gloo on the CPU.

Every rank of a tensor-parallel engine joins one torch.distributed group of `size` processes
through a TCP store that rank 0 opens: on loopback for one node, on --dist-init-addr's port for an
engine over several nodes (whose other ranks connect to that host). A tp_size 1 engine creates no group
at all: its model is built on `SingleRank`, whose collectives are identities (no collective, no
branch on its step's path).

A collective cannot be taken back: when one rank gives a step up part-way (it could not allocate),
the others wait inside that step's collectives for good. `rejoin` is the way past it: every rank
leaves the group (NCCL's communicator is aborted, so its waiting kernels stop; gloo's waiting peers
see their connections close) and joins a new one of the same ranks over the same store.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger("radixserve")

# A collective that waits this long has a peer that is alive but stuck (a dead peer is found
# sooner: the engine watches its ranks' processes). Long enough for a rank that compiles Triton
# kernels or captures CUDA graphs while the others already wait on it.
COLLECTIVE_TIMEOUT_S = 300.0

# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); older releases lack the new one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class TensorParallel:
    """This process's rank in its engine's group of `size` ranks, and the collectives on it."""
    rank: int
    size: int
    device: torch.device
    # An all-reduce tried before NCCL (returns None when it does not take the message), or None.
    fast_all_reduce: Optional[Callable[[torch.Tensor], Optional[torch.Tensor]]] = field(default=None, repr=False)
    store: Optional[dist.Store] = field(default=None, repr=False)  # the rendezvous, kept for `rejoin`
    generation: int = 0  # how many times the group was left and joined again
    timeout_s: float = COLLECTIVE_TIMEOUT_S
    _symmetric: Optional[tuple[torch.dtype, int]] = field(default=None, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place or as a new tensor: use the result (row-parallel
        projections, the vocab-parallel embedding)."""
        if self.fast_all_reduce is not None:
            summed = self.fast_all_reduce(x)
            if summed is not None:
                return summed
        dist.all_reduce(x)
        return x

    def fast_path_may_take(self, numel: int) -> bool:
        """Whether an all-reduce of `numel` elements may go through symmetric memory (whose waiting
        kernels no communicator abort reaches: see `rejoin`)."""
        return self._symmetric is not None and numel <= self._symmetric[1]

    def use_symmetric_memory(self, dtype: torch.dtype, max_numel: int) -> None:
        """All-reduce messages of up to max_numel elements of `dtype` through symmetric memory (CUDA
        only; a collective: every rank calls it at the same point)."""
        from radixserve.distributed.symmetric import SymmetricAllReduce

        self.fast_all_reduce = SymmetricAllReduce(self.device, dtype, max_numel)
        self._symmetric = (dtype, max_numel)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, n] on each rank -> [rows, size * n], rank 0's columns first."""
        x = x.contiguous()
        out = torch.empty((self.size * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x)
        rows, n = x.shape
        return out.view(self.size, rows, n).permute(1, 0, 2).reshape(rows, self.size * n)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """x as rank 0 holds it, on every rank (in place)."""
        dist.broadcast(x, src=0)
        return x

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' values (every rank must agree on, e.g., the KV pool size)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def leave(self) -> None:
        """Leave the group (this process's default group)."""
        if dist.is_initialized():
            dist.destroy_process_group()

    def rejoin(self) -> None:
        """Leave the group at once, whatever its collectives wait for, and join a new one of the
        same ranks (blocks until every rank has joined; each calls this once, after its own queued
        work before the abandoned step is done). Symmetric memory is set up again on the new group.
        What was captured on the old one (CUDA graphs) must be captured again. A rank waiting in a
        symmetric-memory all-reduce is not freed by this (its kernel spins on the peers' signals,
        not on NCCL): the caller must know none is (`fast_path_may_take`)."""
        if self.store is None:
            raise RuntimeError("this group was not joined through init_tensor_parallel: it cannot be joined again")
        if dist.is_initialized():
            if dist.get_backend() == "nccl":
                # destroy_process_group would wait for the kernels still waiting on the abandoned step.
                dist.distributed_c10d._abort_process_group()
            else:
                dist.destroy_process_group()
        self.generation += 1
        self.fast_all_reduce = None
        _join(self.rank, self.size, self.device, dist.PrefixStore(f"rejoin-{self.generation}/", self.store),
              self.timeout_s)
        logger.info("tensor-parallel rank %d/%d joined the group again (generation %d)", self.rank, self.size,
                    self.generation)
        if self._symmetric is not None:
            self.use_symmetric_memory(*self._symmetric)


class SingleRank(TensorParallel):
    """The group of a tp_size 1 engine: one rank, no process group, every collective the identity
    (no copy, no launch). The parallel layers run on it unchanged, so a model has one way to be
    built whatever the tp size."""

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__(0, 1, torch.device(device))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def use_symmetric_memory(self, dtype: torch.dtype, max_numel: int) -> None:
        """Nothing to reduce on one rank: --tp-all-reduce changes nothing at tp_size 1."""

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def min_int(self, value: int) -> int:
        return value

    def leave(self) -> None:
        """No group was joined."""

    def rejoin(self) -> None:
        """No other rank can be waiting in a collective."""


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def open_store(port: int = 0, *, world_size: int, is_master: bool, host: str = "127.0.0.1",
               timeout_s: float = COLLECTIVE_TIMEOUT_S) -> dist.TCPStore:
    """The rendezvous store: rank 0 listens on `port` (0: the OS picks a free one; read it from
    .port), the others connect to host:port, waiting up to timeout_s for rank 0 to listen."""
    return dist.TCPStore(host, port, world_size, is_master,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def init_tensor_parallel(rank: int, size: int, device: torch.device, store: dist.TCPStore,
                         timeout_s: float = COLLECTIVE_TIMEOUT_S) -> TensorParallel:
    """Join the group (blocks until all `size` ranks have joined) as this process's default group."""
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a tensor-parallel group: shut its engine down first")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _join(rank, size, device, store, timeout_s)
    logger.debug("tensor-parallel rank %d/%d joined (%s)", rank, size, backend_for(device))
    return TensorParallel(rank, size, device, store=store, timeout_s=timeout_s)


def _join(rank: int, size: int, device: torch.device, store: dist.Store, timeout_s: float) -> None:
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def init_from_env(device: torch.device, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> TensorParallel:
    """Join the group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): benchmarks."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend_for(device), init_method="env://",
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return TensorParallel(dist.get_rank(), dist.get_world_size(), device)


def destroy(tp: Optional[TensorParallel]) -> None:
    """Leave `tp`'s group, if one was joined (None: the process failed before it joined)."""
    if tp is not None:
        tp.leave()
