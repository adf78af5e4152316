"""NCCL's all-reduce against torch's symmetric-memory all-reduce at decode sizes, on one node.

    torchrun --nproc-per-node N scripts/tp_allreduce_bench.py [--hidden 8192] [--layers 80]
        [--batch-sizes 1 8 32 64 128 256] [--json out.json]

A tensor-parallel decode step makes 2 x layers + 1 all-reduces of [batch, hidden] bf16 (o_proj,
down_proj, the embedding), small messages whose cost is mostly latency. For each batch size this
times, per all-reduce, in microseconds (the slowest rank's mean over a fixed count):
  nccl      torch.distributed.all_reduce (what the engine uses)
  one_shot  torch.ops.symm_mem.one_shot_all_reduce: each rank reads every peer's buffer over NVLink
  two_shot  torch.ops.symm_mem.two_shot_all_reduce_: reduce-scatter then all-gather through peers'
            buffers
each eager (one call at a time) and inside a CUDA graph of 2 x layers calls (as in the decode
graph). NVLink multicast (the multimem_* ops) is not used: it stays off on these machines. Every
symmetric-memory result is checked against NCCL's on the same inputs (bf16 tolerance) before it is
timed; a method that fails or disagrees is reported, not timed. Rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Optional

import torch
import torch.distributed as dist

from radixserve.bench_one_batch import time_on_all_ranks_ms


def timed_us(fn: Callable[[], object], calls_per_fn: int, iters: int = 50, warmup: int = 5) -> float:
    return time_on_all_ranks_ms(fn, iters=iters, warmup=warmup) * 1e3 / calls_per_fn


def in_graph(fn: Callable[[], object], calls: int) -> Callable[[], None]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    return graph.replay


def symmetric_ops(group_name: str, max_rows: int, hidden: int, device: torch.device):
    """{name: (input buffer, op(rows) -> result)} for the symmetric-memory all-reduces, or the error."""
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9, a no-op after
        symm_mem.enable_symm_mem_for_group(group_name)
    buf = symm_mem.empty((max_rows, hidden), dtype=torch.bfloat16, device=device)
    symm_mem.rendezvous(buf, group_name)
    ops = torch.ops.symm_mem
    return buf, {
        "one_shot": lambda rows: ops.one_shot_all_reduce(buf[:rows], "sum", group_name),
        "two_shot": lambda rows: ops.two_shot_all_reduce_(buf[:rows], "sum", group_name),
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=8192, help="hidden size (Qwen2-72B: 8192, 7B: 3584)")
    p.add_argument("--layers", type=int, default=80, help="a graph holds 2 x layers all-reduces")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if "RANK" not in os.environ or not torch.cuda.is_available():
        print("run under torchrun --nproc-per-node N on a node with N GPUs", file=sys.stderr)
        return 2
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    group_name = dist.group.WORLD.group_name
    max_rows, calls = max(args.batch_sizes), 2 * args.layers
    rows_out: list[dict] = []
    try:
        buf, sym = symmetric_ops(group_name, max_rows, args.hidden, device)
    except Exception as e:  # an older torch, or no P2P between these GPUs
        buf, sym = None, {}
        rows_out.append({"method": "symmetric memory", "error": repr(e)})
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    for bs in args.batch_sizes:
        x = torch.randn((bs, args.hidden), dtype=torch.bfloat16, device=device, generator=gen)
        ref = x.clone()
        dist.all_reduce(ref)
        nccl_buf = x.clone()
        methods: dict[str, Callable[[], object]] = {"nccl": lambda t=nccl_buf: dist.all_reduce(t)}
        for name, op in sym.items():
            try:
                buf[:bs].copy_(x)
                out = op(bs)
                ok = torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * world)
                agreed = torch.tensor([int(ok)], device=device)
                dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
                if not agreed.item():
                    rows_out.append({"method": name, "batch": bs, "error": "result differs from NCCL's"})
                    continue
                methods[name] = (lambda op=op, rows=bs: op(rows))
            except Exception as e:
                rows_out.append({"method": name, "batch": bs, "error": repr(e)})
        msg_bytes = bs * args.hidden * 2
        for name, fn in methods.items():
            row = {"method": name, "batch": bs, "bytes": msg_bytes}
            row["eager_us"] = timed_us(fn, 1)
            try:
                row["graph_us"] = timed_us(in_graph(fn, calls), calls, iters=10)
            except Exception as e:
                row["graph_error"] = repr(e)
            best = min(v for k, v in row.items() if k.endswith("_us"))
            row["algbw_gb_s"] = msg_bytes / (best * 1e-6) / 1e9
            rows_out.append(row)
    if rank == 0:
        print(f"# {torch.cuda.get_device_name(device)} x {world}, torch {torch.__version__}, hidden {args.hidden}")
        for row in rows_out:
            print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "hidden": args.hidden, "rows": rows_out}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
