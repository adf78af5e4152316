"""Which part of a Megatron-style sharded layer a rank holds.

Query heads, MLP rows and the vocabulary split evenly; KV heads split when there are at least as
many as ranks, else each KV head is replicated on the `tp / num_kv_heads` ranks whose query heads
read it (Qwen2-7B has 4 KV heads: at TP 8 each rank holds one, shared by two ranks).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadShard:
    """A rank's attention heads: [q_start, q_start + num_q) of the query heads, [kv_start,
    kv_start + num_kv) of the KV heads."""
    num_q: int
    q_start: int
    num_kv: int
    kv_start: int


def check_divisible(num_heads: int, num_kv_heads: int, intermediate_size: int, tp_size: int) -> None:
    """ValueError naming the model dimension that `tp_size` cannot split."""
    if num_heads % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide the model's {num_heads} attention heads")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(f"tp_size={tp_size} and the model's {num_kv_heads} KV heads: one must divide the other "
                         "(KV heads are split across ranks, or replicated when there are fewer than ranks)")
    if intermediate_size % tp_size:
        raise ValueError(f"tp_size={tp_size} does not divide the model's intermediate_size {intermediate_size}")


def head_shard(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> HeadShard:
    check_divisible(num_heads, num_kv_heads, 0, tp_size)
    num_q = num_heads // tp_size
    if num_kv_heads >= tp_size:
        num_kv = num_kv_heads // tp_size
        return HeadShard(num_q, rank * num_q, num_kv, rank * num_kv)
    # Fewer KV heads than ranks: the rank's query heads all belong to one KV head's group.
    return HeadShard(num_q, rank * num_q, 1, rank * num_kv_heads // tp_size)


def vocab_shard(vocab_size: int, tp_size: int, rank: int) -> tuple[int, int, int]:
    """(first token id, rows held, of which real tokens): every rank holds ceil(vocab / tp) rows;
    the last rank's rows past the vocabulary are padding (zero weights, logits cut off)."""
    rows = -(-vocab_size // tp_size)
    start = rank * rows
    return start, rows, max(0, min(rows, vocab_size - start))


def even_shard(size: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(start, length) of a rank's part of a dimension that tp_size divides."""
    part = size // tp_size
    return rank * part, part
