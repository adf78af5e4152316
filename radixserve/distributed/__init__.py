"""Tensor parallelism's plumbing: the rank's process group, the collectives the model calls, and
how a model's heads, rows and vocabulary split across ranks. Nothing here knows a model."""

from radixserve.distributed.group import COLLECTIVE_TIMEOUT_S, SingleRank, TensorParallel, destroy, init_tensor_parallel
from radixserve.distributed.sharding import HeadShard, check_divisible, head_shard, vocab_shard

__all__ = ["COLLECTIVE_TIMEOUT_S", "HeadShard", "SingleRank", "TensorParallel", "check_divisible", "destroy", "head_shard",
           "init_tensor_parallel", "vocab_shard"]
