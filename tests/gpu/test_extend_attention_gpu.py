"""The extend attention kernel (GQA-packed rows, split prefixes) against a float32 reference.

On CUDA: every shape the scheduler hands the backend, for the models we serve: GQA ratios 1, 4, 6
(Qwen3.5's 24 over 4), 7 (Qwen2-7B's 28 over 4) and 8; head dims 64, 128 and 256; bf16 and FP8
pools; page sizes 1 and 16; no prefix, a short one (not a multiple of a tile), a long one (split
over programs by the default config), ragged batches; the table's configs, forced splits, and the
variants scripts/extend_attention_sweep.py compares. Under TRITON_INTERPRET=1 a tiny subset (fp16,
head dims 16 and 32) runs on the CPU: tests/test_triton_interpreter.py.

Every check: relative error within bf16 bounds, no NaN, every output row written (poisoned first).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from triton_device import DEVICE  # skips this module without a GPU or the Triton interpreter

pytestmark = pytest.mark.gpu

from radixserve.attention.base import ForwardMode  # noqa: E402
from radixserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from radixserve.cache.kv_pool import FP8_KV_DTYPE, KVPool  # noqa: E402
from radixserve.kernels.extend_attention import extend_attention  # noqa: E402
from radixserve.kernels.extend_attention_config import ExtendAttentionConfig, config_for  # noqa: E402
from radixserve.kernels.extend_attention_plan import plan_extend  # noqa: E402
from test_triton_attention import BF16_TOL, FP32_TOL, Cache, _make_batch, check, reference  # noqa: E402

FULL = DEVICE == "cuda"
LOW = torch.bfloat16 if FULL else torch.float16  # the interpreter cannot multiply bf16
K_SCALE, V_SCALE = 0.5, 2.0  # powers of two: an e4m3 value times a scale is exact in LOW
# (query heads, KV heads): GQA 1, 4, 6, 7, 8 on CUDA; 1, 2, 7 under the interpreter.
GQA = [(4, 4), (16, 4), (24, 4), (28, 4), (32, 4)] if FULL else [(2, 2), (4, 2), (14, 2)]
HEAD_DIMS = [64, 128, 256] if FULL else [16, 32]
TINY = ExtendAttentionConfig(32, 16, 4, 2, min_split_len=16)  # interpreter tiles


def default_config(head_dim: int, dtype: torch.dtype = LOW) -> ExtendAttentionConfig:
    return config_for(head_dim, dtype) if FULL else TINY


def run_kernel(prefix_lens, extend_lens, hq, hkv, head_dim, page_size, config, *, dtype=LOW, fp8=False,
               num_sms=132, seed=0):
    gen = random.Random(hash((tuple(prefix_lens), tuple(extend_lens), hq, hkv, head_dim, page_size, seed)))
    torch.manual_seed(gen.randint(0, 1 << 30))
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    cache = Cache(hkv, head_dim, seq_lens, page_size, dtype, gen)
    k_buf, v_buf, scales = cache.k_buf, cache.v_buf, (1.0, 1.0)
    if fp8:
        # The pool holds K / k_scale and V / v_scale in e4m3; the reference reads what it holds.
        k_buf = (cache.k_buf.float() * 3 / K_SCALE).to(FP8_KV_DTYPE)
        v_buf = (cache.v_buf.float() * 3 / V_SCALE).to(FP8_KV_DTYPE)
        cache.k_buf = (k_buf.float() * K_SCALE).to(dtype)
        cache.v_buf = (v_buf.float() * V_SCALE).to(dtype)
        scales = (K_SCALE, V_SCALE)
    total = sum(extend_lens)
    q = torch.randn(total, hq, head_dim, device=DEVICE).to(dtype)
    # The new tokens' K/V as the caller passes them: the values the pool holds at their slots.
    loc = torch.cat([cache.req_to_token[row, p:p + e] for row, p, e in zip(cache.rows, prefix_lens, extend_lens)])
    k, v = cache.k_buf[loc].clone(), cache.v_buf[loc].clone()
    out = torch.full((total, hq, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    plan = plan_extend(extend_lens, prefix_lens, group=hq // hkv, block_m=config.block_m, block_n=config.block_n,
                       device=DEVICE, num_kv_heads=hkv, num_sms=num_sms,
                       split_programs_per_sm=config.split_programs_per_sm, min_split_len=config.min_split_len)
    to_dev = lambda xs: torch.tensor(xs, dtype=torch.int64, device=DEVICE)  # noqa: E731
    extend_attention(q, k, v, out, k_buf, v_buf, cache.req_to_token, cache.req_pool_indices, to_dev(prefix_lens),
                     to_dev(extend_lens), plan, config, k_scale=scales[0], v_scale=scales[1])
    return out, reference(q, cache, prefix_lens, extend_lens), plan


def _shape_cases():
    gen = random.Random(2024)
    if FULL:
        shapes = [([0], [600], 1), ([37], [129], 1), ([3000], [200], 1),
                  ([0, 500, 1234, 7], [300, 1, 64, 77], 16)]
    else:
        shapes = [([0], [5], 1), ([20, 0, 3], [9, 33, 1], 16), ([70], [9], 1)]
    cases = [(p, e, hq, hkv, d, ps) for hq, hkv in GQA for d in HEAD_DIMS for p, e, ps in shapes]
    b = 12 if FULL else 4
    cases.append(([gen.randint(0, 2000 if FULL else 60) for _ in range(b)],
                  [gen.randint(1, 300 if FULL else 20) for _ in range(b)], *GQA[-2], HEAD_DIMS[-1], 1))
    return cases


@pytest.mark.parametrize("prefix_lens,extend_lens,hq,hkv,head_dim,page_size", _shape_cases())
def test_extend_attention_shapes(prefix_lens, extend_lens, hq, hkv, head_dim, page_size):
    """The table's config and its split rule: a long prefix in a one-request batch splits where the
    head dimension's tuned entry splits at all (the sweep turned splitting off for 128 and 256)."""
    config = default_config(head_dim)
    out, ref, plan = run_kernel(prefix_lens, extend_lens, hq, hkv, head_dim, page_size, config,
                                num_sms=132 if FULL else 4)
    check(out, ref, BF16_TOL)
    if max(prefix_lens) >= (3000 if FULL else 70) and len(prefix_lens) == 1:
        assert (plan.num_merges > 0) == (config.split_programs_per_sm > 0)


@pytest.mark.parametrize("hq,hkv,head_dim", [GQA[3 if FULL else 2] + (HEAD_DIMS[1],), GQA[2 if FULL else 1]
                                              + (HEAD_DIMS[-1],), GQA[0] + (HEAD_DIMS[0],)])
@pytest.mark.parametrize("prefix_lens,extend_lens", [([1100], [70]), ([0, 45, 300], [20, 64, 3])] if FULL
                         else [([45], [20]), ([20, 0, 3], [9, 33, 1])])
def test_extend_attention_fp8_pool(prefix_lens, extend_lens, hq, hkv, head_dim):
    out, ref, _ = run_kernel(prefix_lens, extend_lens, hq, hkv, head_dim, 1, default_config(head_dim), fp8=True,
                             num_sms=132 if FULL else 4)
    check(out, ref, BF16_TOL)


@pytest.mark.parametrize("split_programs_per_sm", [64, 0])
def test_extend_attention_forced_and_no_split(split_programs_per_sm):
    """64 per SM: every tile with a prefix of more than a few tiles is split (small pieces, many
    merges); 0: never, whatever the batch."""
    d = HEAD_DIMS[1]
    cfg = default_config(d)
    cfg = replace(cfg, split_programs_per_sm=split_programs_per_sm, min_split_len=cfg.block_n)
    prefix_lens, extend_lens = ([2500, 130, 0, 64], [100, 333, 50, 1]) if FULL else ([70, 33, 0], [9, 20, 5])
    hq, hkv = GQA[-2]
    out, ref, plan = run_kernel(prefix_lens, extend_lens, hq, hkv, d, 1, cfg, num_sms=132 if FULL else 4)
    check(out, ref, BF16_TOL)
    assert (plan.num_merges > 0) == (split_programs_per_sm > 0)


def _variants():
    if not FULL:
        return [replace(TINY, prefetch_slots=True), replace(TINY, tma_new=True), ExtendAttentionConfig(16, 16, 4, 2,
                                                                                                       min_split_len=16)]
    return [ExtendAttentionConfig(bm, bn, w, s, prefetch_slots=pf, tma_new=tma)
            for bm, bn, w, s, pf, tma in [(64, 64, 4, 3, False, False), (128, 128, 8, 2, False, False),
                                          (128, 64, 8, 4, True, False), (128, 64, 8, 3, False, True),
                                          (256, 64, 16, 2, False, False), (128, 32, 4, 4, False, False)]]


@pytest.mark.parametrize("config", _variants(), ids=lambda c: c.label().replace(" ", "-"))
def test_extend_attention_sweep_variants(config):
    """The variants the sweep times give the reference's answer (Qwen2-7B's heads, ragged, split)."""
    hq, hkv = GQA[-2]
    d = HEAD_DIMS[1]
    prefix_lens, extend_lens = ([1500, 0, 77], [250, 129, 1]) if FULL else ([40, 0, 7], [12, 9, 1])
    out, ref, _ = run_kernel(prefix_lens, extend_lens, hq, hkv, d, 1, config, num_sms=132 if FULL else 4)
    check(out, ref, BF16_TOL)


def test_extend_attention_fp32():
    out, ref, _ = run_kernel([50, 0], [70, 33], 4, 2, 64 if FULL else 16, 1, config_for(64, torch.float32),
                             dtype=torch.float32, num_sms=4)
    check(out, ref, FP32_TOL)


# Model shapes through the backend: (query heads, KV heads, head dim) of Qwen2-0.5B, Qwen2-7B,
# Qwen3.5-27B's gated attention; a mixed step (decoding requests first) with a long chunk.
MODEL_HEADS = [(14, 2, 64), (28, 4, 128), (24, 4, 256)] if FULL else [(14, 2, 16)]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("hq,hkv,d", MODEL_HEADS)
def test_backend_model_shapes(hq, hkv, d, fp8):
    gen = random.Random(hq * 10 + d + fp8)
    torch.manual_seed(gen.randint(0, 1 << 30))
    prefix_lens = [300, 17, 4000, 0, 64] if FULL else [30, 17, 40, 0]
    extend_lens = [1, 1, 512, 200, 130] if FULL else [1, 1, 20, 9]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    b = len(seq_lens)
    dtype = FP8_KV_DTYPE if fp8 else LOW
    pool = KVPool(sum(seq_lens) + 64, 1, 1, hkv, d, dtype, DEVICE,
                  **({"kv_scales": [(K_SCALE, V_SCALE)]} if fp8 else {}))
    for buf in pool.k_buffers + pool.v_buffers:
        buf.copy_((torch.randn(buf.shape, device=DEVICE) * (3 if fp8 else 1)).to(dtype))
    req_to_token = torch.zeros(b + 1, max(seq_lens) + 1, dtype=torch.int64, device=DEVICE)
    slots = (torch.randperm(pool.num_slots - 1, device=DEVICE) + 1)[:sum(seq_lens)]
    rows = list(range(b + 1))
    gen.shuffle(rows)
    rows = rows[:b]
    start = 0
    for row, s in zip(rows, seq_lens):
        req_to_token[row, :s] = slots[start:start + s]
        start += s
    batch = _make_batch(ForwardMode.EXTEND, pool, req_to_token, rows, prefix_lens, extend_lens, 0, gen)
    backend = TritonAttentionBackend(num_sms=132, extend_config=None if FULL else TINY)
    backend.init_forward(batch)
    total = sum(extend_lens)
    q = torch.randn(total, hq, d, device=DEVICE).to(LOW)
    if fp8:  # values the pool stores exactly (the interpreter's e4m3 rounding differs from torch's)
        k = (torch.randn(total, hkv, d, device=DEVICE) * 3).to(FP8_KV_DTYPE).float().mul(K_SCALE).to(LOW)
        v = (torch.randn(total, hkv, d, device=DEVICE) * 3).to(FP8_KV_DTYPE).float().mul(V_SCALE).to(LOW)
    else:
        k = torch.randn(total, hkv, d, device=DEVICE).to(LOW)
        v = torch.randn(total, hkv, d, device=DEVICE).to(LOW)
    out = backend.forward(q, k, v, 0, batch)
    if FULL:  # the 4000-token prefix is split where the head dimension's tuned entry splits
        assert (batch.attn_meta.plan.num_merges > 0) == (default_config(d).split_programs_per_sm > 0)

    class _View:  # the reference reads the pool (dequantized) through the same table
        pass

    view = _View()
    kb, vb = pool.k_buffers[0], pool.v_buffers[0]
    view.k_buf = (kb.float() * K_SCALE).to(LOW) if fp8 else kb
    view.v_buf = (vb.float() * V_SCALE).to(LOW) if fp8 else vb
    view.rows, view.req_to_token = rows, req_to_token
    check(out.view(total, hq, d), reference(q, view, prefix_lens, extend_lens), BF16_TOL)
