"""Triton attention kernels against a float32 reference on fresh random inputs.

Runs on a CUDA GPU; skipped elsewhere. With TRITON_INTERPRET=1 (and triton installed) it runs a
reduced set of shapes on the CPU through Triton's interpreter, which is slow but checks the
indexing.

Every check: relative error ||out - ref|| / ||ref|| within bf16 bounds, no NaN, and every output
element written (outputs and scratch are poisoned with NaN before each run).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from radixserve.attention.base import ForwardBatch, ForwardMode
from radixserve.cache.kv_pool import KVPool

from triton_device import DEVICE  # skips this module without a GPU or the Triton interpreter

pytestmark = pytest.mark.gpu

from radixserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from radixserve.kernels.decode_attention import decode_attention  # noqa: E402
from radixserve.kernels.extend_attention import extend_attention  # noqa: E402
from radixserve.kernels.extend_attention_config import ExtendAttentionConfig  # noqa: E402
from radixserve.kernels.extend_attention_plan import plan_extend  # noqa: E402
from radixserve.kernels.kv_store import store_kv  # noqa: E402

FULL = DEVICE == "cuda"
# Triton's interpreter cannot multiply bf16 (it holds them as integers): it checks fp16 instead.
LOW = torch.bfloat16 if FULL else torch.float16
BF16_TOL = 1e-2
FP32_TOL = 1e-5
HEADS = [(28, 4), (14, 2), (4, 2)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def check(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert not torch.isnan(out).any(), f"{int(torch.isnan(out).sum())} NaN (unwritten or broken) elements"
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.3e} >= {tol:.0e}"


class Cache:
    """K/V buffers with slots handed out in random pages (page 0 reserved), and req_to_token."""

    def __init__(self, num_kv_heads: int, head_dim: int, seq_lens: list[int], page_size: int,
                 dtype: torch.dtype, gen: random.Random):
        pages_needed = sum(math.ceil(s / page_size) for s in seq_lens) + 1
        num_pages = pages_needed + 7  # a few never-used pages in between
        self.num_slots = (num_pages + 1) * page_size
        self.k_buf = torch.randn(self.num_slots, num_kv_heads, head_dim, device=DEVICE).to(dtype)
        self.v_buf = torch.randn(self.num_slots, num_kv_heads, head_dim, device=DEVICE).to(dtype)
        pages = list(range(1, num_pages + 1))
        gen.shuffle(pages)
        max_ctx = max(seq_lens) + 3
        num_rows = len(seq_lens) + 5
        self.req_to_token = torch.zeros(num_rows, max_ctx, dtype=torch.int64)
        rows = list(range(num_rows))
        gen.shuffle(rows)
        self.rows = rows[:len(seq_lens)]
        for row, s in zip(self.rows, seq_lens):
            slots = []
            for p in range(math.ceil(s / page_size)):
                page = pages.pop()
                slots.extend(range(page * page_size, page * page_size + page_size))
            self.req_to_token[row, :s] = torch.tensor(slots[:s])
        self.req_to_token = self.req_to_token.to(DEVICE)
        self.req_pool_indices = torch.tensor(self.rows, dtype=torch.int64, device=DEVICE)


def reference(q: torch.Tensor, cache: Cache, prefix_lens: list[int], extend_lens: list[int]) -> torch.Tensor:
    """float32 attention of each request's new tokens over positions 0..prefix+j (from the cache)."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    group = num_q_heads // cache.k_buf.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for row, prefix, ext in zip(cache.rows, prefix_lens, extend_lens):
        s = prefix + ext
        slots = cache.req_to_token[row, :s]
        k = cache.k_buf[slots].float().repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = cache.v_buf[slots].float().repeat_interleave(group, dim=1)
        qs = q[start:start + ext].float()  # [E, Hq, D]
        scores = torch.einsum("ehd,shd->hes", qs, k) / math.sqrt(head_dim)
        q_pos = torch.arange(prefix, s, device=q.device)
        visible = torch.arange(s, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[start:start + ext] = torch.einsum("hes,shd->ehd", scores.softmax(-1), v)
        start += ext
    return out


# --------------------------------------------------------------------------- KV store

@pytest.mark.parametrize("num_tokens,num_kv_heads,head_dim", [(1, 4, 128), (37, 2, 64), (5000, 4, 128)]
                         if FULL else [(1, 4, 128), (37, 2, 64)])
def test_store_kv(num_tokens, num_kv_heads, head_dim):
    num_slots = num_tokens * 3 + 16
    k_buf = torch.full((num_slots, num_kv_heads, head_dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    v_buf = k_buf.clone()
    loc = torch.randperm(num_slots - 1, device=DEVICE)[:num_tokens] + 1
    # k/v as strided views of a fused qkv row, the way the model hands them over.
    qkv = torch.randn(num_tokens, (8 + 2 * num_kv_heads) * head_dim, device=DEVICE).to(torch.bfloat16)
    k = qkv[:, 8 * head_dim:(8 + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, (8 + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    store_kv(k, v, k_buf, v_buf, loc)
    assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], v)
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert torch.isnan(k_buf[untouched]).all() and torch.isnan(v_buf[untouched]).all()


# --------------------------------------------------------------------------- decode

def _decode_cases():
    cases = []
    gen = random.Random(1234)
    if FULL:
        for hq, hkv in HEADS:
            for d in (64, 128):
                cases.append((1, [1], hq, hkv, d, 1, None))
                cases.append((1, [5000], hq, hkv, d, 16, None))
                cases.append((3, [1, 17, 4097], hq, hkv, d, 1, None))
        cases.append((16, [gen.randint(1, 2000) for _ in range(16)], 14, 2, 64, 1, None))
        cases.append((64, [gen.randint(1, 5000) for _ in range(64)], 28, 4, 128, 1, None))
        cases.append((64, [gen.randint(1, 5000) for _ in range(64)], 4, 2, 128, 16, None))
        cases.append((33, [gen.randint(1, 300) for _ in range(33)], 28, 4, 128, 1, 1))
        cases.append((5, [gen.randint(1, 3000) for _ in range(5)], 28, 4, 128, 1, 7))
        cases.append((2, [4999, 64], 14, 2, 64, 16, 64))
    else:
        cases = [(1, [1], 4, 2, 64, 1, None), (3, [5, 70, 130], 4, 2, 64, 1, 3), (2, [40, 9], 14, 2, 64, 16, 2),
                 (3, [5, 70, 130], 4, 2, 64, 1, 1)]
    return cases


@pytest.mark.parametrize("batch,seq_lens,hq,hkv,head_dim,page_size,splits", _decode_cases())
def test_decode_attention(batch, seq_lens, hq, hkv, head_dim, page_size, splits):
    _run_decode(batch, seq_lens, hq, hkv, head_dim, page_size, splits, 128 if FULL else 16)


@pytest.mark.parametrize("block_n", [32, 64] if FULL else [32])
def test_decode_attention_block_n(block_n):
    _run_decode(5, [1, 63, 64, 65, 700], 28, 4, 128 if FULL else 64, 1, 3, block_n)


def _run_decode(batch, seq_lens, hq, hkv, head_dim, page_size, splits, block_n):
    gen = random.Random(batch * 1000 + hq + head_dim + page_size)
    torch.manual_seed(gen.randint(0, 1 << 30))
    cache = Cache(hkv, head_dim, seq_lens, page_size, LOW, gen)
    num_splits = splits or max(1, min(64, math.ceil(4 * 132 / (batch * hkv))))
    q = torch.randn(batch, hq, head_dim, device=DEVICE).to(LOW)
    seq = torch.tensor(seq_lens, dtype=torch.int64, device=DEVICE)
    out = torch.full((batch, hq, head_dim), float("nan"), dtype=LOW, device=DEVICE)
    mid_o = torch.full((batch, hq, num_splits, head_dim), float("nan"), device=DEVICE)
    mid_lse = torch.full((batch, hq, num_splits), float("nan"), device=DEVICE)
    decode_attention(q, cache.k_buf, cache.v_buf, cache.req_to_token, cache.req_pool_indices, seq, out,
                     mid_o, mid_lse, num_splits, block_n=block_n)
    ref = reference(q, cache, [s - 1 for s in seq_lens], [1] * batch)
    check(out, ref, BF16_TOL)


@pytest.mark.parametrize("num_splits", [4, 1])  # 1: stage 1 writes the output, no merge launch
def test_decode_attention_fp32_and_empty_row(num_splits):
    gen = random.Random(7)
    seq_lens = [300, 1, 77]
    cache = Cache(2, 64, seq_lens, 1, torch.float32, gen)
    q = torch.randn(3, 4, 64, device=DEVICE)
    out = torch.full((3, 4, 64), float("nan"), device=DEVICE)
    mid_o = torch.full((3, 4, num_splits, 64), float("nan"), device=DEVICE)
    mid_lse = torch.full((3, 4, num_splits), float("nan"), device=DEVICE)
    seq = torch.tensor(seq_lens, dtype=torch.int64, device=DEVICE)
    decode_attention(q, cache.k_buf, cache.v_buf, cache.req_to_token, cache.req_pool_indices, seq, out,
                     mid_o, mid_lse, num_splits)
    check(out, reference(q, cache, [s - 1 for s in seq_lens], [1] * 3), FP32_TOL)
    # A padded row with seq_len 0 (CUDA-graph bucket padding) yields zeros, never NaN.
    seq[1] = 0
    out.fill_(float("nan"))
    decode_attention(q, cache.k_buf, cache.v_buf, cache.req_to_token, cache.req_pool_indices, seq, out,
                     mid_o, mid_lse, num_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert not torch.isnan(out).any()


# --------------------------------------------------------------------------- extend

def _extend_cases():
    gen = random.Random(99)
    cases = []
    if FULL:
        for hq, hkv in HEADS:
            for d in (64, 128):
                cases.append(([0], [1], hq, hkv, d, 1))
                cases.append(([0], [600], hq, hkv, d, 1))
                cases.append(([1000], [1], hq, hkv, d, 16))
                cases.append(([37], [129], hq, hkv, d, 1))
        b = 8
        cases.append(([gen.randint(0, 3000) for _ in range(b)], [gen.randint(1, 600) for _ in range(b)], 28, 4, 128, 1))
        b = 64
        cases.append(([gen.randint(0, 500) for _ in range(b)], [gen.randint(1, 64) for _ in range(b)], 14, 2, 64, 16))
        cases.append(([0] * 4, [gen.randint(1, 600) for _ in range(4)], 4, 2, 128, 1))
        cases.append(([4500, 0, 64], [500, 5000, 64], 28, 4, 128, 16))
    else:
        cases = [([0], [1], 4, 2, 64, 1), ([0], [40], 4, 2, 64, 1), ([20, 0, 3], [9, 33, 1], 4, 2, 64, 16)]
    return cases


def _run_extend(prefix_lens, extend_lens, hq, hkv, head_dim, page_size, dtype, block_m, block_n):
    gen = random.Random(sum(prefix_lens) * 7 + sum(extend_lens) + hq + head_dim)
    torch.manual_seed(gen.randint(0, 1 << 30))
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    cache = Cache(hkv, head_dim, seq_lens, page_size, dtype, gen)
    total = sum(extend_lens)
    q = torch.randn(total, hq, head_dim, device=DEVICE).to(dtype)
    # The new tokens' K/V as the caller passes them: the same values the pool holds at their slots.
    loc = torch.cat([cache.req_to_token[row, p:p + e] for row, p, e in zip(cache.rows, prefix_lens, extend_lens)])
    k, v = cache.k_buf[loc].clone(), cache.v_buf[loc].clone()
    out = torch.full((total, hq, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    config = ExtendAttentionConfig(block_m, block_n, (8 if head_dim >= 128 else 4) if FULL else 4,
                                   3 if FULL and dtype != torch.float32 else 2)
    plan = plan_extend(extend_lens, prefix_lens, group=hq // hkv, block_m=block_m, block_n=block_n, device=DEVICE)
    to_dev = lambda xs: torch.tensor(xs, dtype=torch.int64, device=DEVICE)  # noqa: E731
    extend_attention(q, k, v, out, cache.k_buf, cache.v_buf, cache.req_to_token, cache.req_pool_indices,
                     to_dev(prefix_lens), to_dev(extend_lens), plan, config)
    return out, reference(q, cache, prefix_lens, extend_lens)


@pytest.mark.parametrize("prefix_lens,extend_lens,hq,hkv,head_dim,page_size", _extend_cases())
def test_extend_attention(prefix_lens, extend_lens, hq, hkv, head_dim, page_size):
    block_m, block_n = (128, 64) if FULL else (32, 16)
    out, ref = _run_extend(prefix_lens, extend_lens, hq, hkv, head_dim, page_size, LOW, block_m, block_n)
    check(out, ref, BF16_TOL)


@pytest.mark.parametrize("block_m,block_n", [(64, 64), (64, 32), (128, 128)] if FULL else [(16, 16)])
def test_extend_attention_tile_shapes(block_m, block_n):
    out, ref = _run_extend([300, 0, 77], [250, 129, 1], 28, 4, 128 if FULL else 64, 1, LOW, block_m, block_n)
    check(out, ref, BF16_TOL)


def test_extend_attention_fp32():
    out, ref = _run_extend([50, 0], [70, 33], 4, 2, 64, 1, torch.float32, 32, 16)
    check(out, ref, FP32_TOL)


# --------------------------------------------------------------------------- the backend

def _poison_allocator():
    """Fill freed memory with NaN so torch.empty in the backend hands back poisoned storage."""
    if DEVICE == "cuda":
        junk = torch.full((64 << 20,), float("nan"), dtype=torch.float32, device=DEVICE)
        del junk


def _make_batch(mode, cache_pool: KVPool, req_to_token, rows, prefix_lens, extend_lens, layer_id, gen):
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    loc = torch.cat([req_to_token[row, p:p + e] for row, p, e in zip(rows, prefix_lens, extend_lens)])
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)]).to(DEVICE)
    t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=DEVICE)  # noqa: E731
    total = sum(extend_lens)
    return ForwardBatch(
        mode=mode, input_ids=torch.zeros(total, dtype=torch.int64, device=DEVICE), positions=positions,
        out_cache_loc=loc, req_pool_indices=t(rows), seq_lens=t(seq_lens), extend_lens=t(extend_lens),
        prefix_lens=t(prefix_lens), seq_lens_cpu=seq_lens, extend_lens_cpu=list(extend_lens),
        prefix_lens_cpu=list(prefix_lens), req_to_token=req_to_token, kv_pool=cache_pool,
        logits_indices=t([total - 1]))


@pytest.mark.parametrize("kind", ["extend", "decode", "mixed"])
@pytest.mark.parametrize("d", [64, 256])  # 256: the hybrid Qwen models' gated attention (narrower tiles)
def test_backend_stores_then_attends(kind, d):
    """mixed: decoding requests first (one token each, attended by the decode kernel inside an
    extend pass), then prompts and chunks (the extend kernel), as a mixed scheduler step has them."""
    mode = ForwardMode.DECODE if kind == "decode" else ForwardMode.EXTEND
    gen = random.Random({"extend": 5, "decode": 6, "mixed": 7}[kind] + d)
    torch.manual_seed(gen.randint(0, 1 << 30))
    hq, hkv, layers = (14, 2, 2) if d == 64 else (6, 2, 2)
    b = 6 if FULL else 3
    prefix_lens = [gen.randint(0, 900 if FULL else 40) for _ in range(b)]
    extend_lens = [1] * b if kind == "decode" else [gen.randint(2, 300 if FULL else 20) for _ in range(b)]
    if kind == "mixed":
        extend_lens[:b // 2] = [1] * (b // 2)
    if kind != "extend":
        prefix_lens = [max(p, 1) for p in prefix_lens]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pool = KVPool(sum(seq_lens) + 64, 1, layers, hkv, d, LOW, DEVICE)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.normal_()
    req_to_token = torch.zeros(b + 2, max(seq_lens) + 1, dtype=torch.int64, device=DEVICE)
    slots = (torch.randperm(pool.num_slots - 1, device=DEVICE) + 1)[:sum(seq_lens)]
    rows = list(range(b + 2))
    gen.shuffle(rows)
    rows = rows[:b]
    start = 0
    for row, s in zip(rows, seq_lens):
        req_to_token[row, :s] = slots[start:start + s]
        start += s
    batch = _make_batch(mode, pool, req_to_token, rows, prefix_lens, extend_lens, 1, gen)
    backend = TritonAttentionBackend(num_sms=132)
    backend.init_forward(batch)
    total = sum(extend_lens)
    q = torch.randn(total, hq, d, device=DEVICE).to(LOW)
    k = torch.randn(total, hkv, d, device=DEVICE).to(LOW)
    v = torch.randn(total, hkv, d, device=DEVICE).to(LOW)
    _poison_allocator()
    out = backend.forward(q, k, v, 1, batch)
    assert out.shape == (total, hq * d)
    assert torch.equal(pool.k_buffers[1][batch.out_cache_loc], k)
    assert torch.equal(pool.v_buffers[1][batch.out_cache_loc], v)

    class _View:  # the reference reads the same pool through the same table
        pass

    view = _View()
    view.k_buf, view.v_buf, view.rows, view.req_to_token = pool.k_buffers[1], pool.v_buffers[1], rows, req_to_token
    ref = reference(q, view, prefix_lens, extend_lens)
    check(out.view(total, hq, d), ref, BF16_TOL)


@pytest.mark.skipif(not FULL, reason="CUDA graphs need a GPU")
def test_decode_cuda_graph_replays_new_contexts():
    """One capture serves other seq_lens and req_to_token contents (what a graph runner relies on)."""
    gen = random.Random(11)
    hq, hkv, d, bs = 28, 4, 128, 8
    max_ctx = 3000
    pool = KVPool(bs * max_ctx + 64, 1, 1, hkv, d, LOW, DEVICE)
    pool.k_buffers[0].normal_()
    pool.v_buffers[0].normal_()
    req_to_token = torch.zeros(bs, max_ctx, dtype=torch.int64, device=DEVICE)
    backend = TritonAttentionBackend()
    backend.reserve_decode_workspace(bs, hq, hkv, d, DEVICE)

    def fill(seq_lens):
        perm = torch.randperm(pool.num_slots - 1, device=DEVICE) + 1
        req_to_token.copy_(perm[:bs * max_ctx].view(bs, max_ctx))
        static["seq_lens"].copy_(torch.tensor(seq_lens, device=DEVICE))
        static["loc"].copy_(req_to_token[torch.arange(bs, device=DEVICE), static["seq_lens"] - 1])
        static["q"].normal_()
        static["k"].normal_()
        static["v"].normal_()

    static = {
        "seq_lens": torch.ones(bs, dtype=torch.int64, device=DEVICE),
        "loc": torch.zeros(bs, dtype=torch.int64, device=DEVICE),
        "q": torch.empty(bs, hq, d, dtype=LOW, device=DEVICE),
        "k": torch.empty(bs, hkv, d, dtype=LOW, device=DEVICE),
        "v": torch.empty(bs, hkv, d, dtype=LOW, device=DEVICE),
    }
    batch = ForwardBatch(
        mode=ForwardMode.DECODE, input_ids=torch.zeros(bs, dtype=torch.int64, device=DEVICE),
        positions=static["seq_lens"] - 1, out_cache_loc=static["loc"],
        req_pool_indices=torch.arange(bs, device=DEVICE), seq_lens=static["seq_lens"],
        extend_lens=torch.ones(bs, dtype=torch.int64, device=DEVICE),
        prefix_lens=torch.zeros(bs, dtype=torch.int64, device=DEVICE), seq_lens_cpu=[1] * bs,
        extend_lens_cpu=[1] * bs, prefix_lens_cpu=[0] * bs, req_to_token=req_to_token, kv_pool=pool,
        logits_indices=torch.arange(bs, device=DEVICE))
    fill([gen.randint(1, max_ctx) for _ in range(bs)])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.init_forward(batch)
        backend.forward(static["q"], static["k"], static["v"], 0, batch)  # warm-up: compiles
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.init_forward(batch)
        out = backend.forward(static["q"], static["k"], static["v"], 0, batch)
    for _ in range(3):
        seq_lens = [gen.randint(1, max_ctx) for _ in range(bs)]
        fill(seq_lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()

        class _View:
            pass

        view = _View()
        view.k_buf, view.v_buf, view.rows, view.req_to_token = pool.k_buffers[0], pool.v_buffers[0], list(range(bs)), req_to_token
        assert torch.equal(pool.k_buffers[0][static["loc"]], static["k"])
        ref = reference(static["q"], view, [s - 1 for s in seq_lens], [1] * bs)
        check(out.view(bs, hq, d), ref, BF16_TOL)
