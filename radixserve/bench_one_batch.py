"""One static batch on the GPU, each time printed beside its floor.

    python -m radixserve.bench_one_batch --model-path benchmarks/configs/qwen2-7b --load-format dummy

Measures, in the same run: the device's copy bandwidth (bytes read + written) and its bf16
matmul rate (8192^3 on random data); then, for the model's shape,
  * decode attention alone (one layer: KV store + split-K decode) at each batch size and context,
    against the floor of reading that layer's live KV once;
  * the full model decode step (eager, and replayed from a CUDA graph), against
    (weight bytes + live KV bytes) / bandwidth; with --compare-cublas, again with every projection
    on cuBLAS instead of the decode-row GEMM (radixserve.kernels.decode_linear);
  * prefill of `--prefill-batch` x `--prefill-len` tokens (model, and attention alone), against
    FLOPs / matmul rate.
With --quantization fp8 the model's projections hold e4m3 weights (the floors count one byte per
projection weight, two for norms, biases and lm_head), and with --kv-cache-dtype fp8_e4m3 the KV
pool holds one byte per value (the floors count that).
A hybrid model (Qwen3.5 / 3.6, Qwen3-Next) runs over a KV pool of its full-attention layers and
a recurrent state pool (a conv window and a state per linear-attention layer and request row,
random like the KV; `--mamba-ssm-dtype` as the server takes it); its decode floor adds each
running request's states, read and written once per step, and its prefill floor the FLOPs of the
linear layers' chunked form (radixserve.bench.model_cost). The attention-only rows time its
full-attention layers' kernels.
With `--tp-size N`, run under `torchrun --nproc-per-node N`: each GPU holds its shard of the model
and times the tensor-parallel decode step (fixed-count CUDA-event timing, the slowest rank's time)
against the TP floor: its weight and KV bytes over the copy bandwidth, plus its all-reduce and
all-gather bytes over `--nvlink-gb-s` (--quantization fp8 and --kv-cache-dtype fp8_e4m3 apply to
the shards and their floors alike).
Times are medians of CUDA-event timings after warm-up, with the L2 cache flushed before each
run (triton.testing.do_bench). K/V, weights and inputs are random, never zeros; slots are a
random permutation of the pool, so every request's KV is scattered.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import dataclasses
from typing import Callable, Optional

import torch

from radixserve.attention.base import ForwardBatch, ForwardMode
from radixserve.bench.model_cost import ModelCost
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.state_pool import RecurrentStatePool, RecurrentStateSpec
from radixserve.model.config import ModelConfig
from radixserve.settings import DECODE_GEMM_MAX_ROWS


def _bench(fn: Callable[[], object], rep_ms: int = 200, warmup_ms: int = 50) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def measure_copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    n = int(gib * (1 << 30)) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src), rep_ms=300)
    nbytes = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / (ms * 1e-3)


def measure_matmul_rate(device: torch.device, n: int = 8192) -> tuple[float, float]:
    """FLOP/s of an n^3 bf16 matmul on random data: (burst, sustained).

    burst: the mean of 10 back-to-back products after 3 warm-ups (a short run, as the
    reference figures were taken); sustained: the median over about a second of products, after
    a second of warm-up (what a long prefill sees once the power limit bites).
    """
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    out = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    torch.cuda.synchronize()
    for _ in range(3):
        torch.matmul(a, b, out=out)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        torch.matmul(a, b, out=out)
    end.record()
    end.synchronize()
    burst_ms = start.elapsed_time(end) / 10
    _bench(lambda: torch.matmul(a, b, out=out), rep_ms=1000, warmup_ms=1000)
    sustained_ms = _bench(lambda: torch.matmul(a, b, out=out), rep_ms=1000)
    del a, b, out
    torch.cuda.empty_cache()
    return 2 * n ** 3 / (burst_ms * 1e-3), 2 * n ** 3 / (sustained_ms * 1e-3)


def state_pool_spec(cost: ModelCost, ssm_dtype: torch.dtype,
                    conv_dtype: torch.dtype = torch.bfloat16) -> Optional[RecurrentStateSpec]:
    """What one request row of a hybrid's state pool holds on this GPU (the shapes the model asks
    for, from the cost model's local dims; checked against the model once it is built), or None.
    The conv windows are in the model's dtype."""
    h = cost.cfg.hybrid
    if h is None or not h.num_linear_layers:
        return None
    num_v = cost.linear_dims[0]
    return RecurrentStateSpec(h.num_linear_layers, (h.conv_kernel - 1, cost.linear_conv_channels),
                              (num_v, h.linear_k_head_dim, h.linear_v_head_dim), conv_dtype, ssm_dtype)


class Workload:
    """A KV pool filled with random values, and a req_to_token table of randomly scattered slots;
    for a hybrid model (`state`), a recurrent state pool of random states beside it, one row per
    request row."""

    def __init__(self, cfg: ModelConfig, max_rows: int, max_tokens_per_row: int, row_stride: int,
                 total_tokens: int, device: torch.device, seed: int, dtype: torch.dtype = torch.bfloat16,
                 state: Optional[RecurrentStateSpec] = None):
        self.cfg = cfg
        self.device = device
        self.pool = KVPool(total_tokens, 1, cfg.num_kv_layers, cfg.num_key_value_heads, cfg.head_dim,
                           dtype, device, state=RecurrentStatePool(max_rows, state, device) if state else None)
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        if state is not None:
            for buf in self.pool.state.conv + self.pool.state.ssm:
                buf.normal_(generator=gen)
        for buf in self.pool.k_buffers + self.pool.v_buffers:
            if buf.dtype == torch.float8_e4m3fn:  # normal_ has no FP8 kernel: draw in bf16, then round
                for start in range(0, buf.shape[0], 1 << 20):
                    part = buf[start:start + (1 << 20)]
                    part.copy_(torch.randn(part.shape, device=device, generator=gen, dtype=torch.bfloat16))
            else:
                buf.normal_(generator=gen)
        perm = torch.randperm(self.pool.num_slots - 1, device=device, generator=gen) + 1
        self.max_tokens_per_row = max_tokens_per_row
        # Row i, position j -> perm[i * row_stride + j] (wrapping): the first row_stride positions
        # of different rows never share a slot; longer rows (prefill) may alias other rows' slots,
        # which is harmless for timing as long as one batch does not use both.
        n = perm.numel()
        assert max(row_stride, max_tokens_per_row) <= n, "the pool is smaller than one request"
        index = (torch.arange(max_rows, device=device)[:, None] * row_stride
                 + torch.arange(max_tokens_per_row, device=device)[None, :]) % n
        self.req_to_token = perm[index].contiguous()
        self.gen = gen

    def decode_batch(self, bs: int, ctx: int) -> ForwardBatch:
        """bs requests with ctx-1 cached tokens each, decoding the token at position ctx-1."""
        dev = self.device
        rows = torch.arange(bs, device=dev)
        seq_lens = torch.full((bs,), ctx, dtype=torch.int64, device=dev)
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.randint(0, self.cfg.vocab_size, (bs,), device=dev, generator=self.gen),
            positions=seq_lens - 1, out_cache_loc=self.req_to_token[rows, ctx - 1].clone(),
            req_pool_indices=rows, seq_lens=seq_lens,
            extend_lens=torch.ones(bs, dtype=torch.int64, device=dev),
            prefix_lens=seq_lens - 1, seq_lens_cpu=[ctx] * bs, extend_lens_cpu=[1] * bs,
            prefix_lens_cpu=[ctx - 1] * bs, req_to_token=self.req_to_token, kv_pool=self.pool,
            logits_indices=torch.arange(bs, device=dev))

    def set_decode_context(self, batch: ForwardBatch, ctx: int) -> None:
        """Rewrite a decode batch's device tensors in place for another context (graph replay)."""
        bs = batch.seq_lens.shape[0]
        rows = torch.arange(bs, device=self.device)
        batch.seq_lens.fill_(ctx)
        batch.positions.fill_(ctx - 1)
        batch.prefix_lens.fill_(ctx - 1)
        batch.out_cache_loc.copy_(self.req_to_token[rows, ctx - 1])
        batch.seq_lens_cpu[:] = [ctx] * bs
        batch.prefix_lens_cpu[:] = [ctx - 1] * bs

    def extend_batch(self, bs: int, prefix: int, extend: int) -> ForwardBatch:
        dev = self.device
        rows = torch.arange(bs, device=dev)
        seq = prefix + extend
        positions = torch.arange(prefix, seq, device=dev).repeat(bs)
        loc = self.req_to_token[:bs, prefix:seq].reshape(-1).clone()
        t = lambda v: torch.full((bs,), v, dtype=torch.int64, device=dev)  # noqa: E731
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.randint(0, self.cfg.vocab_size, (bs * extend,), device=dev, generator=self.gen),
            positions=positions, out_cache_loc=loc, req_pool_indices=rows, seq_lens=t(seq), extend_lens=t(extend),
            prefix_lens=t(prefix), seq_lens_cpu=[seq] * bs, extend_lens_cpu=[extend] * bs,
            prefix_lens_cpu=[prefix] * bs, req_to_token=self.req_to_token, kv_pool=self.pool,
            logits_indices=(torch.arange(bs, device=dev) + 1) * extend - 1)


def _graph(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def kernel_breakdown(fn: Callable[[], object], steps: int = 20) -> tuple[float, list[tuple[str, float, float]]]:
    """Run `fn` (e.g. a graph replay) `steps` times under the profiler: (GPU kernel time per step
    in us, [(kernel, launches per step, us per step)] largest first). The step's time minus its
    kernel time is what launches and gaps between kernels cost."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.self_device_time_total > 0 and e.count:
            rows.append((e.key, e.count / steps, e.self_device_time_total / steps))
    rows.sort(key=lambda r: -r[2])
    return sum(r[2] for r in rows), rows


def host_profile(fn: Callable[[], object], label: str, steps: int = 5, top: int = 25) -> None:
    """Where the host's time goes in `fn` (an eager step): cProfile over `steps` calls, the
    functions with the most time of their own. Eager steps are host-bound on small models."""
    import cProfile
    import io
    import pstats

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    print(f"#   host profile of {label}, {steps} calls (cProfile inflates Python time):", flush=True)
    for line in text.getvalue().splitlines():
        if line.strip():
            print(f"#     {line}", flush=True)


def _print_breakdown(label: str, step_ms: float, kernel_us: float, rows: list[tuple[str, float, float]],
                     top: int = 12) -> None:
    launches = sum(r[1] for r in rows)
    print(f"#   {label}: kernels {kernel_us / 1e3:.4f} ms of a {step_ms:.4f} ms step ({launches:.0f} launches; "
          f"launch gaps {max(0.0, step_ms - kernel_us / 1e3):.4f} ms)", flush=True)
    for name, per_step, us in rows[:top]:
        print(f"#     {us:8.1f} us  {per_step:5.0f} x  {name[:90]}", flush=True)


class Report:
    def __init__(self, json_path: Optional[str]):
        self.rows: list[dict] = []
        self.meta: dict = {}
        self.json_path = json_path

    def add(self, kind: str, label: str, ms: Optional[float], floor_ms: Optional[float], **extra) -> None:
        ratio = (ms / floor_ms) if (ms and floor_ms) else None
        row = {"kind": kind, "label": label, "ms": ms, "floor_ms": floor_ms, "ratio": ratio, **extra}
        self.rows.append(row)
        extras = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in extra.items())
        ms_s = f"{ms:9.4f} ms" if ms is not None else "     n/a   "
        fl_s = f"{floor_ms:9.4f} ms" if floor_ms is not None else "     n/a   "
        r_s = f"{ratio:6.2f}x" if ratio is not None else "    n/a"
        print(f"{kind:<18} {label:<34} {ms_s}  floor {fl_s}  ratio {r_s}  {extras}", flush=True)

    def note(self, text: str) -> None:
        self.meta.setdefault("notes", []).append(text)
        print(f"# {text}", flush=True)

    def save(self) -> None:
        if self.json_path:
            with open(self.json_path, "w") as f:
                json.dump({"meta": self.meta, "rows": self.rows}, f, indent=1)


def _commit() -> str:
    """RADIXSERVE_COMMIT when set (a copy of the tree run elsewhere, e.g. a `git archive` of
    HEAD, may sit inside another checkout whose HEAD is not what runs), else git's HEAD."""
    if os.environ.get("RADIXSERVE_COMMIT"):
        return os.environ["RADIXSERVE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except Exception:  # no git on the machine, or no repository
        return "unknown"


def bench_decode_attention(args, work: Workload, cost: ModelCost, rep: Report, bw: float) -> None:
    from radixserve.attention.triton_backend import TritonAttentionBackend

    cfg = work.cfg
    backend = TritonAttentionBackend()
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    backend.reserve_decode_workspace(max(args.batch_sizes), hq, hkv, d, work.device)
    per_tok = cost.kv_bytes_per_token_layer()
    for bs in args.batch_sizes:
        batch = work.decode_batch(bs, max(args.contexts))
        q = torch.randn(bs, hq, d, dtype=torch.bfloat16, device=work.device)
        k = torch.randn(bs, hkv, d, dtype=torch.bfloat16, device=work.device)
        v = torch.randn(bs, hkv, d, dtype=torch.bfloat16, device=work.device)

        def step():
            backend.init_forward(batch)
            return backend.forward(q, k, v, 0, batch)

        graph, _ = _graph(step)
        for ctx in args.contexts:
            work.set_decode_context(batch, ctx)
            floor = bs * ctx * per_tok / bw * 1e3
            eager = _bench(step)
            replay = _bench(graph.replay)
            rep.add("decode-attn", f"bs={bs} ctx={ctx}", replay, floor, eager_ms=eager,
                    splits=backend.num_splits(bs, hkv, work.device),
                    gbps=bs * ctx * per_tok / (replay * 1e-3) / 1e9)
        del graph


def sweep_decode_attention(args, work: Workload, cost: ModelCost, rep: Report, bw: float) -> None:
    from radixserve.attention.triton_backend import TritonAttentionBackend

    cfg = work.cfg
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    per_tok = cost.kv_bytes_per_token_layer()
    variants = [dict(decode_block_n=64, decode_num_warps=4, decode_num_stages=3),
                dict(decode_block_n=64, decode_num_warps=4, decode_num_stages=4),
                dict(decode_block_n=32, decode_num_warps=4, decode_num_stages=3),
                dict(decode_block_n=32, decode_num_warps=4, decode_num_stages=4),
                dict(decode_block_n=128, decode_num_warps=4, decode_num_stages=2),
                dict(decode_block_n=128, decode_num_warps=4, decode_num_stages=3),
                dict(decode_block_n=64, decode_num_warps=4, decode_num_stages=3, decode_programs_per_sm=8)]
    shapes = [(bs, ctx) for bs in (16, 64, 256) if bs in args.batch_sizes for ctx in (4096,)]
    for variant in variants:
        backend = TritonAttentionBackend(**variant)
        name = ",".join(f"{k.replace('decode_', '')}={v}" for k, v in variant.items())
        for bs, ctx in shapes:
            batch = work.decode_batch(bs, ctx)
            q = torch.randn(bs, hq, d, dtype=torch.bfloat16, device=work.device)
            k = torch.randn(bs, hkv, d, dtype=torch.bfloat16, device=work.device)
            v = torch.randn(bs, hkv, d, dtype=torch.bfloat16, device=work.device)

            def step():
                backend.init_forward(batch)
                return backend.forward(q, k, v, 0, batch)

            graph, _ = _graph(step)
            ms = _bench(graph.replay)
            rep.add("sweep-decode", f"{name} bs={bs} ctx={ctx}", ms, bs * ctx * per_tok / bw * 1e3)
            del graph


def bench_extend_attention(args, work: Workload, cost: ModelCost, rep: Report, flops: float,
                           variants: list[dict]) -> None:
    from radixserve.attention.triton_backend import TritonAttentionBackend

    cfg = work.cfg
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    length = args.prefill_len
    shapes = [(args.prefill_batch, 0, length), (1, max(0, length - 1024), 1024), (16, 1024, 128)]
    for variant in variants:
        backend = TritonAttentionBackend(**variant)
        name = variant["extend_config"].label().replace(" ", ",") if variant else "default"
        for bs, prefix, ext in shapes:
            if prefix + ext > work.max_tokens_per_row or bs > work.req_to_token.shape[0]:
                continue
            batch = work.extend_batch(bs, prefix, ext)
            t = bs * ext
            q = torch.randn(t, hq, d, dtype=torch.bfloat16, device=work.device)
            k = torch.randn(t, hkv, d, dtype=torch.bfloat16, device=work.device)
            v = torch.randn(t, hkv, d, dtype=torch.bfloat16, device=work.device)
            backend.init_forward(batch)
            ms = _bench(lambda: backend.forward(q, k, v, 0, batch))
            fl = bs * cost.attention_flops_layer(prefix, ext)
            rep.add("extend-attn", f"{name} bs={bs} prefix={prefix} ext={ext}", ms, fl / flops * 1e3,
                    tflops=fl / (ms * 1e-3) / 1e12)


def _load_bf16_model(args, work: Workload, rep: Report, decode_gemm_max_rows: int, tp=None):
    """The model (this rank's shard with `tp`) in bfloat16 on the GPU (its projections in FP8 with
    --quantization fp8), or None (noted in the report) if it cannot be built."""
    from radixserve.attention.triton_backend import TritonAttentionBackend
    from radixserve.model.loader import load_model

    backend = TritonAttentionBackend()
    try:
        model, _ = load_model(args.model_path, load_format=args.load_format, dtype=torch.bfloat16,
                              device=work.device, attn_backend=backend, seed=args.seed,
                              decode_gemm_max_rows=decode_gemm_max_rows, tp=tp, quantization=args.quantization)
    except Exception as e:
        rep.note(f"load_model failed ({e!r}): attention-only results")
        return None
    heads, kv_heads = model.local_heads
    backend.reserve_decode_workspace(max(args.batch_sizes), heads, kv_heads, work.cfg.head_dim, work.device)
    from radixserve.engine.model_stack import state_spec

    costed = work.pool.state.spec if work.pool.state is not None else None
    wanted = state_spec(model, costed.ssm_dtype if costed is not None else torch.float32)
    if wanted != costed:  # the floors would count other bytes than the model moves
        raise RuntimeError(f"the model's recurrent state {wanted} is not the one costed ({costed})")
    return model


def bench_model(args, work: Workload, cost: ModelCost, rep: Report, bw: float, flops: float) -> None:
    model = _load_bf16_model(args, work, rep, args.decode_gemm_max_rows)
    if model is None:
        return
    rep.meta["decode_weight_bytes"] = cost.decode_weight_bytes
    rep.meta["kv_bytes_per_token"] = cost.kv_bytes_per_token
    rep.meta["state_bytes_per_request"] = cost.state_bytes_per_request

    # Prefill first (it needs no graph); one request per row, from position 0.
    bs, length = args.prefill_batch, args.prefill_len
    if length <= work.max_tokens_per_row:
        batch = work.extend_batch(bs, 0, length)
        model(batch)  # compile + warm up
        torch.cuda.synchronize()
        ms = _bench(lambda: model(batch), rep_ms=1500, warmup_ms=200)
        fl = cost.prefill_flops(bs, length)
        rep.add("prefill", f"bs={bs} len={length}", ms, fl / flops * 1e3,
                tok_s=bs * length / (ms * 1e-3), mfu=fl / (ms * 1e-3) / flops)
        if args.profile:
            host_profile(lambda: model(batch), f"the prefill bs={bs} len={length}")
        del batch
    bench_decode_steps(args, work, cost, rep, bw, model, "decode-step")
    del model
    torch.cuda.empty_cache()
    if args.compare_cublas:
        # The layers fix their kernels when built: the cuBLAS side is a second model.
        model = _load_bf16_model(args, work, rep, 0)
        if model is not None:
            bench_decode_steps(args, work, cost, rep, bw, model, "decode-step-cublas")
            del model
            torch.cuda.empty_cache()


def bench_decode_steps(args, work: Workload, cost: ModelCost, rep: Report, bw: float, model, kind: str,
                       timer: Callable[..., float] = _bench) -> None:
    """The model's decode step at each batch size and context: eager and replayed from a graph."""
    link_bw = args.nvlink_gb_s * 1e9
    for dbs in args.batch_sizes:
        batch = work.decode_batch(dbs, max(args.contexts))
        graph = None
        if not args.disable_cuda_graph:
            try:
                graph, _ = _graph(lambda: model(batch))
            except Exception as e:
                rep.note(f"CUDA graph capture failed at bs={dbs}: {e!r}")
                graph = None
        for ctx in args.contexts:
            work.set_decode_context(batch, ctx)
            floor = cost.decode_floor_ms(dbs, ctx, bw, link_bw)
            eager = timer(lambda: model(batch), rep_ms=300)
            replay = timer(graph.replay, rep_ms=300) if graph is not None else None
            best = replay if replay is not None else eager
            extra = {}
            if args.profile:
                kernel_us, rows = kernel_breakdown(graph.replay if graph is not None else (lambda: model(batch)))
                extra = dict(kernel_ms=kernel_us / 1e3, launches=sum(r[1] for r in rows))
            rep.add(kind, f"bs={dbs} ctx={ctx}", best, floor, eager_ms=eager,
                    tok_s=dbs / (best * 1e-3), graph=graph is not None, **extra)
            if args.profile:
                _print_breakdown(f"bs={dbs} ctx={ctx}", best, kernel_us, rows)
        del graph, batch
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m radixserve.bench_one_batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="directory with the model's config.json")
    p.add_argument("--load-format", default="dummy", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 1536, 4096])
    p.add_argument("--prefill-batch", type=int, default=1)
    p.add_argument("--prefill-len", type=int, default=8192)
    p.add_argument("--skip-model", action="store_true", help="attention kernels only")
    p.add_argument("--skip-attention", action="store_true", help="model steps only")
    p.add_argument("--sweep", nargs="*", choices=["decode", "extend"], default=None,
                   help="also time kernel tuning variants (of decode, extend, or both when none is named)")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--decode-gemm-max-rows", type=int, default=DECODE_GEMM_MAX_ROWS,
                   help="projections of at most this many rows run our Triton GEMM (default: %(default)s)")
    p.add_argument("--compare-cublas", action="store_true",
                   help="also time every decode step with cuBLAS for all projections (a second model is loaded "
                        "after the first is freed)")
    p.add_argument("--profile", action="store_true",
                   help="also profile each model decode step (its kernels, their GPU time, the launch gaps) "
                        "and the host time of the eager prefill (cProfile)")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: the projections in e4m3 (quantized as they load; dummy weights are drawn, then "
                        "quantized); the decode floors count one byte per projection weight")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"],
                   help="fp8_e4m3: an FP8 KV pool (scales 1.0); the floors count one byte per KV value")
    p.add_argument("--mamba-ssm-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="a hybrid model's recurrent states (the server's flag); the floors count its bytes")
    p.add_argument("--tp-size", type=int, default=1,
                   help="tensor-parallel ranks: run under torchrun --nproc-per-node N; times the decode step only")
    p.add_argument("--nvlink-gb-s", type=float, default=450.0,
                   help="NVLink bandwidth per GPU and direction for the TP floor (default: %(default)s, an H200's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write every row here")
    args = p.parse_args(argv)
    if args.tp_size > 1:
        return main_tensor_parallel(args)

    if not torch.cuda.is_available():
        print("bench_one_batch needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(args.seed)
    rep = Report(args.json)
    props = torch.cuda.get_device_properties(device)
    rep.meta.update(device=props.name, sms=props.multi_processor_count, commit=_commit(),
                    date=datetime.date.today().isoformat(), torch=torch.__version__, args=vars(args))
    import triton

    rep.meta["triton"] = triton.__version__
    print(f"# {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}, "
          f"commit {rep.meta['commit']}", flush=True)

    bw = measure_copy_bandwidth(device)
    burst, sustained = measure_matmul_rate(device)
    # The floors use the higher (burst) rate: a ratio to it is never flattering.
    flops = max(burst, sustained)
    rep.meta.update(copy_bandwidth=bw, matmul_flops=flops, matmul_flops_burst=burst, matmul_flops_sustained=sustained)
    rep.add("ceiling", "copy bandwidth (read+write)", None, None, tb_s=bw / 1e12)
    rep.add("ceiling", "bf16 matmul 8192^3, burst", None, None, tflop_s=burst / 1e12)
    rep.add("ceiling", "bf16 matmul 8192^3, sustained", None, None, tflop_s=sustained / 1e12)

    cfg = ModelConfig.from_dir(args.model_path)
    cost, kv_dtype = model_cost(args, cfg, rep)
    state = state_pool_spec(cost, getattr(torch, args.mamba_ssm_dtype))
    max_bs, max_ctx = max(args.batch_sizes), max(args.contexts)
    row_len = max(max_ctx, args.prefill_len, 1024 + 128) + 1
    rows = max(max_bs, args.prefill_batch, 16)
    total = max(max_bs * max_ctx, args.prefill_batch * args.prefill_len, 16 * (1024 + 128)) + 64
    need = total * cost.kv_bytes_per_token
    states = (rows + 1) * state.bytes_per_row if state is not None else 0
    free, _ = torch.cuda.mem_get_info(device)
    weights = 0 if args.skip_model else (cost.decode_weight_bytes + cfg.vocab_size * cfg.hidden_size * 2)
    if need + states + weights + (6 << 30) > free:
        print(f"the KV pool ({need / 1e9:.1f} GB), recurrent states ({states / 1e9:.1f} GB: {rows} rows) and "
              f"weights ({weights / 1e9:.1f} GB) do not fit in {free / 1e9:.1f} GB free: use fewer or smaller "
              "--batch-sizes/--contexts", file=sys.stderr)
        return 2
    work = Workload(cfg, rows, row_len, max_ctx, total, device, args.seed, dtype=kv_dtype, state=state)
    rep.note(f"{args.model_path}: KV pool {total} tokens ({total * cost.kv_bytes_per_token / 1e9:.1f} GB), "
             f"weights read per decode step {cost.decode_weight_bytes / 1e9:.2f} GB, "
             f"KV {cost.kv_bytes_per_token} B/token" + hybrid_note(cost, state, rows))

    if not args.skip_attention and cfg.num_kv_layers:
        bench_decode_attention(args, work, cost, rep, bw)
        extend_variants = [{}]
        sweep = set() if args.sweep is None else (set(args.sweep) or {"decode", "extend"})
        if "decode" in sweep:
            sweep_decode_attention(args, work, cost, rep, bw)
        if "extend" in sweep:
            # A few configs besides the table's (scripts/extend_attention_sweep.py sweeps them all).
            from radixserve.kernels.extend_attention_config import ExtendAttentionConfig

            extend_variants += [dict(extend_config=ExtendAttentionConfig(128, 64, 8, 3, split_programs_per_sm=0)),
                                dict(extend_config=ExtendAttentionConfig(128, 64, 8, 4)),
                                dict(extend_config=ExtendAttentionConfig(64, 64, 4, 3))]
        bench_extend_attention(args, work, cost, rep, flops, extend_variants)
    if not args.skip_model:
        bench_model(args, work, cost, rep, bw, flops)
    rep.save()
    return 0


def model_cost(args, cfg: ModelConfig, rep: Report, tp: int = 1) -> tuple[ModelCost, torch.dtype]:
    """The floors' bytes (one per FP8 weight or KV value, a hybrid's states in --mamba-ssm-dtype;
    `tp`: a rank's shard) and the KV dtype."""
    fp8_weights, fp8_kv = args.quantization == "fp8" or cfg.quantization is not None, args.kv_cache_dtype != "auto"
    kv_dtype = torch.float8_e4m3fn if fp8_kv else torch.bfloat16
    ssm_elem = 2 if getattr(args, "mamba_ssm_dtype", "float32") == "bfloat16" else 4
    rep.meta.update(weights="fp8" if fp8_weights else "bf16", kv_cache_dtype=str(kv_dtype))
    return ModelCost(cfg, tp=tp, kv_elem=1 if fp8_kv else 2, weight_elem=1 if fp8_weights else 2,
                     ssm_elem=ssm_elem), kv_dtype


def hybrid_note(cost: ModelCost, state: Optional[RecurrentStateSpec], rows: int) -> str:
    """What the report says of a hybrid's layers and states ("" for an attention-only model)."""
    h = cost.cfg.hybrid
    if h is None:
        return ""
    from radixserve.kernels import fla_gdn

    text = f"; {h.num_linear_layers} linear / {h.num_full_layers} full layers"
    if state is not None:
        text += (f", recurrent states {cost.state_bytes_per_request / 1e6:.1f} MB/request ({rows} rows, "
                 f"{state.ssm_dtype}), read and written once a decode step")
    return text + ("; prefill's linear layers: fla's chunked kernel" if fla_gdn.available()
                   else "; prefill's linear layers: the recurrent kernel (fla-core is not installed)")


def time_on_all_ranks_ms(fn: Callable[[], object], rep_ms: int = 0, iters: int = 50, warmup: int = 10) -> float:
    """Mean ms of `iters` back-to-back calls, the slowest rank's: a fixed count (do_bench's adaptive
    count could differ between ranks, and every rank must make the same collectives)."""
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    ms = torch.tensor([start.elapsed_time(end) / iters], device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms.item())


def main_tensor_parallel(args) -> int:
    """The sharded model's decode steps on this rank's GPU (every rank runs this; rank 0 reports)."""
    from radixserve.distributed import check_divisible, destroy
    from radixserve.distributed.group import init_from_env
    from radixserve.model.moe_config import check_moe_layout

    if int(os.environ.get("WORLD_SIZE", "1")) != args.tp_size or not torch.cuda.is_available():
        print(f"--tp-size {args.tp_size} runs under torchrun --nproc-per-node {args.tp_size}, one GPU a rank",
              file=sys.stderr)
        return 2
    cfg = ModelConfig.from_dir(args.model_path)
    check_divisible(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dense_intermediate_size, args.tp_size)
    check_moe_layout(cfg.moe, cfg.quantization, args.tp_size)
    tp = init_from_env(torch.device("cuda", int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))))
    if tp.rank != 0:
        sys.stdout = open(os.devnull, "w")
    torch.manual_seed(args.seed)
    rep = Report(args.json if tp.rank == 0 else None)
    rep.meta.update(device=torch.cuda.get_device_properties(tp.device).name, tp_size=tp.size, commit=_commit(),
                    date=datetime.date.today().isoformat(), torch=torch.__version__, args=vars(args))
    bw = measure_copy_bandwidth(tp.device)
    rep.add("ceiling", "copy bandwidth (read+write)", None, None, tb_s=bw / 1e12)
    cost, kv_dtype = model_cost(args, cfg, rep, tp=tp.size)
    local = dataclasses.replace(cfg, num_attention_heads=cost.local_heads, num_key_value_heads=cost.local_kv_heads)
    max_bs, max_ctx = max(args.batch_sizes), max(args.contexts)
    state = state_pool_spec(cost, getattr(torch, args.mamba_ssm_dtype))
    work = Workload(local, max_bs, max_ctx + 1, max_ctx, max_bs * max_ctx + 64, tp.device, args.seed,
                    dtype=kv_dtype, state=state)
    rep.note(f"{args.model_path} at TP {tp.size}: per GPU {cost.decode_weight_bytes / 1e9:.2f} GB of weights, "
             f"KV {cost.kv_bytes_per_token} B/token; NVLink {args.nvlink_gb_s:g} GB/s per direction"
             + hybrid_note(cost, state, max_bs))
    model = _load_bf16_model(args, work, rep, args.decode_gemm_max_rows, tp=tp)
    if model is not None:
        bench_decode_steps(args, work, cost, rep, bw, model, f"decode-step-tp{tp.size}", timer=time_on_all_ranks_ms)
    rep.save()
    destroy(tp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
