"""Sweeps behind the decode defaults, on a GPU: projections at decode batch sizes, decode attention.

    python scripts/decode_sweep.py --models benchmarks/configs/qwen2-7b benchmarks/configs/qwen2-0.5b \
        --json sweep.json [--skip-gemm] [--skip-attention]

Projections: each linear of the model (qkv, o, gate_up, down, lm_head) at M rows, through
cuBLAS (torch's default) and cuBLASLt (torch's other BLAS back end), against its floor (weights +
activations read once / copy bandwidth). Decode attention: every layer's KV store + split-K
decode, at the given batch sizes and contexts, over a grid of tiles, warps, pipeline stages and
programs per SM, against the floor of reading the live KV once. Both are timed as a decode step
runs them: many calls, each on its own weights or its own layer's KV (together far bigger than
the L2 cache), captured in one CUDA graph; medians over replays.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radixserve.bench_one_batch import ModelCost, Workload, measure_copy_bandwidth  # noqa: E402
from radixserve.model.config import ModelConfig  # noqa: E402


def linear_shapes(cfg: ModelConfig) -> list[tuple[str, int, int, bool]]:
    h = cfg.hidden_size
    return [("qkv", cfg.q_size + 2 * cfg.kv_size, h, cfg.qkv_bias), ("o", h, cfg.q_size, False),
            ("gate_up", 2 * cfg.intermediate_size, h, False), ("down", h, cfg.intermediate_size, False),
            ("lm_head", cfg.vocab_size, h, False)]


def time_per_call(calls: list, replays: int = 10) -> float:
    """ms per call: the calls (each on its own weights, together far bigger than the L2 cache, as
    the layers of a model are) captured in one CUDA graph, median over replays."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2] / len(calls)


def sweep_gemm(cfg: ModelConfig, name: str, rows: list[int], bw: float, out: list[dict]) -> None:
    dev = torch.device("cuda")
    for layer, n, k, has_bias in linear_shapes(cfg):
        copies = max(2, min(64, -(-(384 << 20) // (2 * n * k))))
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(copies)]
        b = torch.randn(n, dtype=torch.bfloat16, device=dev) if has_bias else None
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            floor_ms = (n * k + m * k + m * n) * 2 / bw * 1e3
            results = {}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                calls = [lambda w=w: torch.matmul(x, w.T, out=y) if b is None else torch.addmm(b, x, w.T, out=y)
                         for w in weights]
                calls[0]()  # the BLAS handle and workspace are made outside the capture
                torch.cuda.synchronize()
                results[lib] = time_per_call(calls)
            torch.backends.cuda.preferred_blas_library("cublas")
            print(f"{name} {layer:8s} M={m:4d} N={n:6d} K={k:6d} floor {floor_ms * 1e3:7.1f} us | "
                  + " | ".join(f"{lib} {t * 1e3:7.1f} us ({t / floor_ms:.2f}x)" for lib, t in results.items()),
                  flush=True)
            out.append(dict(kind="gemm", model=name, layer=layer, m=m, n=n, k=k, floor_ms=floor_ms,
                            results=[dict(variant=v, ms=t) for v, t in results.items()]))
        del weights
        torch.cuda.empty_cache()


def sweep_attention(cfg: ModelConfig, name: str, batch_sizes: list[int], contexts: list[int], bw: float,
                    out: list[dict]) -> None:
    from radixserve.attention.triton_backend import TritonAttentionBackend

    dev = torch.device("cuda")
    cost = ModelCost(cfg)
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    max_bs, max_ctx = max(batch_sizes), max(contexts)
    work = Workload(cfg, max_bs, max_ctx + 1, max_ctx, max_bs * max_ctx + 64, dev, 0)
    per_tok = cost.kv_bytes_per_token_layer()
    variants = [dict(decode_block_n=bn, decode_num_warps=wp, decode_num_stages=st, decode_programs_per_sm=pps)
                for bn, wp, st, pps in itertools.product((32, 64, 128), (2, 4), (2, 3, 4), (1, 2, 4, 8))]
    label = "bn={decode_block_n} w={decode_num_warps} st={decode_num_stages} pps={decode_programs_per_sm}"
    layers = range(cfg.num_hidden_layers)
    for bs in batch_sizes:
        batch = work.decode_batch(bs, max_ctx)
        q = torch.randn(bs, hq, d, dtype=torch.bfloat16, device=dev)
        k = torch.randn(bs, hkv, d, dtype=torch.bfloat16, device=dev)
        v = torch.randn(bs, hkv, d, dtype=torch.bfloat16, device=dev)
        for ctx in contexts:
            work.set_decode_context(batch, ctx)
            floor_ms = bs * ctx * per_tok / bw * 1e3
            results = []
            for variant in variants:
                backend = TritonAttentionBackend(**variant)
                backend.reserve_decode_workspace(bs, hq, hkv, d, dev)
                try:
                    backend.init_forward(batch)
                    backend.forward(q, k, v, 0, batch)
                    torch.cuda.synchronize()
                    ms = time_per_call([lambda: backend.init_forward(batch)]
                                       + [lambda i=i: backend.forward(q, k, v, i, batch) for i in layers])
                except Exception as e:  # a tile that does not fit in shared memory
                    print(f"  skip {variant}: {type(e).__name__}", flush=True)
                    continue
                ms = ms * (len(layers) + 1) / len(layers)  # per layer
                results.append((label.format(**variant), ms, backend.num_splits(bs, hkv, dev)))
            results.sort(key=lambda r: r[1])
            default = next((r for r in results if r[0] == "bn=128 w=4 st=3 pps=2"), ("", float("nan"), 0))
            print(f"{name} attention bs={bs:3d} ctx={ctx:5d} floor {floor_ms * 1e3:6.1f} us | default "
                  f"{default[1] * 1e3:6.1f} ({default[1] / floor_ms:.2f}x, {default[2]} splits) | best: "
                  + "; ".join(f"{r[0]} {r[1] * 1e3:.1f} us ({r[2]} splits)" for r in results[:3]), flush=True)
            out.append(dict(kind="attention", model=name, bs=bs, ctx=ctx, floor_ms=floor_ms,
                            results=[dict(variant=v, ms=t, splits=s) for v, t, s in results]))
    del work
    torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", required=True, help="directories with a config.json")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 256], help="M of the projections")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[1536])
    p.add_argument("--skip-gemm", action="store_true")
    p.add_argument("--skip-attention", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("decode_sweep needs a CUDA GPU", file=sys.stderr)
        return 2
    bw = measure_copy_bandwidth(torch.device("cuda"))
    print(f"# copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    out: list[dict] = []
    for path in args.models:
        cfg = ModelConfig.from_dir(path)
        name = Path(path).name
        if not args.skip_gemm:
            sweep_gemm(cfg, name, args.rows, bw, out)
        if not args.skip_attention:
            sweep_attention(cfg, name, args.batch_sizes, args.contexts, bw, out)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(bandwidth=bw, rows=out), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
