"""The extend attention kernel's host side (CPU): its work list and its config table.

The kernel itself is checked against a reference on the GPU (tests/gpu/test_extend_attention_gpu.py,
a subset of it on the CPU through Triton's interpreter: tests/test_triton_interpreter.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.kernels.extend_attention_config import (SHARED_MEMORY_BUDGET, TUNED, ExtendAttentionConfig,
                                                        config_for, shared_memory_bytes)
from radixserve.kernels.extend_attention_plan import ITEM_FIELDS, PAD, plan_extend, split_bounds, tile_rows


def check_plan(plan, extend_lens, prefix_lens, group, block_m, block_n, first_request=0):
    """Every row of every request from first_request on is attended once over its whole context:
    its tile's items partition [0, prefix) at block_n boundaries and exactly one of them (the
    last) goes on over the new tokens; split items' partial slots are the merge's."""
    by_tile: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for r, m0, lo, hi, part in plan.host_items:
        by_tile.setdefault((r, m0), []).append((lo, hi, part))
    expected = {(r, m0) for r, (e, p) in enumerate(zip(extend_lens, prefix_lens)) if r >= first_request
                for m0 in range(0, e * group, block_m)}
    assert set(by_tile) == expected
    merges = {}
    mg = plan.merges
    for i in range(plan.num_merges):
        merges[(int(mg["req"][i]), int(mg["m0"][i]))] = (int(mg["first_part"][i]), int(mg["num_parts"][i]))
    seen_parts = []
    for (r, m0), pieces in by_tile.items():
        prefix = prefix_lens[r]
        pieces.sort()
        assert pieces[0][0] == 0 and pieces[-1][1] == prefix
        for (lo, hi, _), (lo2, _, _) in zip(pieces, pieces[1:]):
            assert hi == lo2 and hi % block_n == 0 and hi < prefix
        assert all(lo % block_n == 0 for lo, _, _ in pieces)
        if len(pieces) == 1:
            assert pieces[0][2] == -1 and (r, m0) not in merges
        else:
            first, count = merges[(r, m0)]
            assert [p for _, _, p in pieces] == list(range(first, first + count))
            seen_parts += [p for _, _, p in pieces]
    assert sorted(seen_parts) == list(range(plan.num_parts))
    # Costliest first: the prefix range plus, for the item that reaches the prefix's end, the
    # causal part up to the tile's last token.
    causal = {(r, m0): c for r, e in enumerate(extend_lens) for m0, c in tile_rows(e, group, block_m)}
    works = [hi - lo + (causal[(r, m0)] if hi == prefix_lens[r] else 0) for r, m0, lo, hi, _ in plan.host_items]
    assert works == sorted(works, reverse=True)
    # The device columns hold the same items.
    for i, name in enumerate(ITEM_FIELDS):
        assert plan.items[name].tolist() == [it[i] for it in plan.host_items]
        assert plan.items[name].storage_offset() % PAD == 0


@pytest.mark.parametrize("group", [1, 2, 6, 7, 8])
@pytest.mark.parametrize("split", [0, 4, 64])
def test_plan_covers_every_row_once(group, split):
    gen = random.Random(group * 100 + split)
    for trial in range(6):
        b = gen.randint(1, 6)
        extend_lens = [gen.choice([1, 2, 17, 64, 129, gen.randint(1, 400)]) for _ in range(b)]
        prefix_lens = [gen.choice([0, 1, 63, 64, 65, 1000, gen.randint(0, 5000)]) for _ in range(b)]
        block_m, block_n = gen.choice([(64, 32), (128, 64), (32, 16)])
        first = gen.randint(0, b - 1) if trial % 3 == 2 else 0
        plan = plan_extend(extend_lens, prefix_lens, group=group, block_m=block_m, block_n=block_n, device="cpu",
                           num_kv_heads=gen.choice([1, 4]), num_sms=132, split_programs_per_sm=split,
                           min_split_len=max(block_n, 128), first_request=first)
        check_plan(plan, extend_lens, prefix_lens, group, block_m, block_n, first)
        assert plan.q_starts.tolist() == [sum(extend_lens[:i]) for i in range(b)]


def test_a_long_prefix_in_a_small_batch_is_split_and_a_big_batch_is_not():
    # Qwen2-7B: 28 query heads over 4 KV heads. One 1024-token chunk after a 7168-token prefix
    # makes 56 tiles of 128 rows, 224 programs: under 4 per SM, so its prefix is split.
    chunk = plan_extend([1024], [7168], group=7, block_m=128, block_n=64, device="cpu", num_kv_heads=4,
                        num_sms=132, split_programs_per_sm=4, min_split_len=512)
    check_plan(chunk, [1024], [7168], 7, 128, 64)
    assert chunk.num_merges == 56 and chunk.num_items * 4 >= 4 * 132
    # Split pieces are about equal in work (the causal part counted with the last).
    causal = dict(tile_rows(1024, 7, 128))
    per_tile: dict[int, list[int]] = {}
    for r, m0, lo, hi, _ in chunk.host_items:
        per_tile.setdefault(m0, []).append(hi - lo + (causal[m0] if hi == 7168 else 0))
    for m0, works in per_tile.items():
        assert len(works) >= 2 and max(works) - min(works) <= 2 * 64, works
    # 8192 new tokens without a prefix: 1792 programs fill the GPU without splitting.
    prompt = plan_extend([8192], [0], group=7, block_m=128, block_n=64, device="cpu", num_kv_heads=4,
                         num_sms=132, split_programs_per_sm=4, min_split_len=512)
    assert prompt.num_merges == 0 and prompt.num_items == 8192 * 7 // 128
    # Splitting off: one item per tile.
    unsplit = plan_extend([1024], [7168], group=7, block_m=128, block_n=64, device="cpu", num_kv_heads=4,
                          num_sms=132, split_programs_per_sm=0)
    assert unsplit.num_items == 56 and unsplit.num_parts == 0


def test_split_bounds():
    assert split_bounds(0, 100, 4, 64) == []  # nothing to split
    assert split_bounds(64, 10, 2, 64) == []  # the last split keeps [0, 64) with the causal part
    assert split_bounds(1024, 0, 4, 64) == [256, 512, 768]
    assert split_bounds(1000, 24, 4, 64) == [256, 512, 768]
    assert all(b < 129 for b in split_bounds(129, 1000, 8, 64))


def test_packed_rows_cover_the_group():
    # 7 heads x 5 tokens = 35 rows: one 32-row tile and a 3-row tile whose last token is 4.
    assert tile_rows(5, 7, 32) == [(0, 5), (32, 5)]
    assert tile_rows(16, 7, 128) == [(0, 16)]
    assert tile_rows(40, 1, 16) == [(0, 16), (16, 32), (32, 40)]


def test_config_table_fits_shared_memory():
    for head_dim, cfg in TUNED.items():
        assert shared_memory_bytes(cfg, head_dim, 2) <= SHARED_MEMORY_BUDGET, (head_dim, cfg)
        assert config_for(head_dim, torch.bfloat16) == cfg
    small = config_for(64, torch.float32)
    assert small.block_m == TUNED[64].block_m // 2 and small.num_stages == 2
    assert shared_memory_bytes(config_for(256, torch.float32), 256, 4) <= SHARED_MEMORY_BUDGET
    # A deeper pipeline than fits loses stages instead of failing to compile.
    deep = config_for(256, torch.bfloat16)
    assert deep.num_stages >= 2
    with pytest.raises(ValueError):
        ExtendAttentionConfig(96, 64)
    with pytest.raises(ValueError):
        ExtendAttentionConfig(128, 64, warp_specialize=True)
    with pytest.raises(ValueError):
        ExtendAttentionConfig(128, 64, min_split_len=100)
