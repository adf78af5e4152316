"""Which tiles the fused MoE's grouped GEMMs run (radixserve.kernels.fused_moe_config; CPU).

The kernels themselves are checked against the reference at small shapes under the interpreter
(tests/gpu/test_fused_moe.py) and at the models' shapes on CUDA (tests/gpu/test_fused_moe_gpu.py).
"""

from __future__ import annotations

import pytest

from radixserve.kernels.fused_moe_config import (SHARED_MEMORY_BUDGET, TUNED, FusedMoeConfig, block_k_fits_scale_blocks,
                                                 config_for, default_config, max_padded_rows, pipeline_stages)

# (experts, top_k, hidden, moe_intermediate): Qwen3-30B-A3B, Qwen2-57B-A14B.
MODEL_SHAPES = [(128, 8, 2048, 768), (64, 8, 3584, 2560)]


def test_tiles_grow_with_the_rows_each_expert_gets():
    e, k, h, inter = MODEL_SHAPES[0]
    decode = default_config(e, 2 * inter, h, 1, k)
    assert decode.block_m == 16 and decode.group_m == 1  # 8 rows over 128 experts: one row each
    prefill = default_config(e, 2 * inter, h, 8192, k)  # 512 rows an expert
    assert prefill.block_m == 64 and prefill.block_n == 128 and prefill.group_m > 1
    ms = [default_config(e, 2 * inter, h, t, k).block_m for t in (1, 16, 64, 256, 1024, 8192)]
    assert ms == sorted(ms)


@pytest.mark.parametrize("e,k,h,inter", MODEL_SHAPES)
def test_default_tiles_fit_the_model_shapes_and_shared_memory(e, k, h, inter):
    for t in (1, 7, 64, 512, 4096):
        for n, kk in ((2 * inter, h), (h, inter)):
            c = config_for(e, n, kk, t, k)
            assert kk % c.block_k == 0 and n % c.block_n == 0
            assert pipeline_stages(c, 2, 2) * (c.block_m * 2 + c.block_n * 2) * c.block_k <= SHARED_MEMORY_BUDGET


def test_fp8_block_scales_take_k_tiles_inside_one_block():
    c = default_config(128, 1536, 2048, 4096, 8, weight_bytes=1)
    assert block_k_fits_scale_blocks(c, 128)
    assert not block_k_fits_scale_blocks(FusedMoeConfig(block_k=128), 64)
    assert block_k_fits_scale_blocks(FusedMoeConfig(block_k=64), None)


def test_narrow_weights_take_one_tile():
    c = default_config(8, 32, 64, 3, 2)
    assert c.block_n == 32
    assert default_config(8, 64, 48, 3, 2).block_k == 32  # K = 48 ends in a partial (masked) tile


def test_padded_rows_bound_any_routing():
    assert max_padded_rows(8, 128, 16) == 8 + 8 * 15  # at most 8 experts get a row
    assert max_padded_rows(1024, 128, 64) == 1024 + 128 * 63
    assert max_padded_rows(0, 8, 16) == 0


def test_tuned_buckets_are_picked_by_tokens(monkeypatch):
    small, large = FusedMoeConfig(16, 64, 128), FusedMoeConfig(64, 128, 64, 8, 4, 3)
    monkeypatch.setitem(TUNED, (4, 64, 32), ((16, small), (4096, large)))
    assert config_for(4, 64, 32, 1, 2) is small and config_for(4, 64, 32, 16, 2) is small
    assert config_for(4, 64, 32, 17, 2) is large and config_for(4, 64, 32, 10 ** 6, 2) is large


@pytest.mark.parametrize("shape,buckets", list(TUNED.items()))
def test_tuned_entries_tile_their_shape(shape, buckets):
    _, n, k = shape
    assert [t for t, _ in buckets] == sorted(t for t, _ in buckets)
    for _, c in buckets:
        assert k % c.block_k == 0 and pipeline_stages(c, 2, 2) == c.num_stages


def test_configs_are_checked():
    with pytest.raises(ValueError, match="block_m"):
        FusedMoeConfig(block_m=24)
    with pytest.raises(ValueError, match="block_k"):
        FusedMoeConfig(block_k=8)
    with pytest.raises(ValueError, match="num_warps"):
        FusedMoeConfig(num_warps=3)
