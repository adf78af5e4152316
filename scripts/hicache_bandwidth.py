"""Host-to-device load bandwidth of the host tier against a plain pinned copy, on one GPU.

The KV shape is the Qwen2-7B architecture's (28 layers, 4 KV heads of 128, bf16: 56 KiB a token).
For each case it writes `--tokens` tokens back to the host tier, then loads them into device slots
and reports the copy engine's measured bandwidth next to one `copy_` of the same bytes from a
pinned buffer (the ceiling). Cases: host slots in one run (a fresh host pool), and host slots
scattered page by page (a fragmented host pool), at page sizes 1 and 16. The target is >= 70% of
the plain copy. On the H200 machine, from the repository root:

    bash scripts/gpu_run.sh python scripts/hicache_bandwidth.py [--tokens 16384] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from radixserve.cache.host_pool import CudaCopyEngine, HostKVPool
from radixserve.cache.kv_pool import KVPool

LAYERS, KV_HEADS, HEAD_DIM = 28, 4, 128


def plain_pinned_copy(nbytes: int, repeats: int) -> float:
    """Bytes per second of one pinned host -> device copy_ of nbytes (best of repeats)."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return nbytes / best


def tier_load(tokens: int, page_size: int, scattered: bool, repeats: int) -> dict:
    """The copy engine's load bandwidth for tokens written back to the host, best of repeats."""
    pool = KVPool(tokens, page_size, LAYERS, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    host = HostKVPool(2 * tokens, pool, pin=True)
    copier = CudaCopyEngine(pool, host)
    slots = pool.allocator.pages_to_slots(pool.allocator.alloc_pages(tokens // page_size))
    host_slots = host.alloc(tokens)
    if scattered:  # every other host page, in shuffled order: one copy per page
        num = tokens // page_size
        pages = (torch.arange(num) * 2 + 1)[torch.randperm(num)]
        host_slots = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    copier.write_back(slots, host_slots)
    copier.wait_all()
    best, wall = 0.0, float("inf")
    for _ in range(repeats):
        before_bytes, before_s = copier.stats.loaded_bytes, copier.stats.load_seconds
        t0 = time.perf_counter()
        copier.load(host_slots, slots)
        issue_s = time.perf_counter() - t0
        copier.wait_all()
        wall = min(wall, time.perf_counter() - t0)
        bandwidth = (copier.stats.loaded_bytes - before_bytes) / (copier.stats.load_seconds - before_s)
        best = max(best, bandwidth)
    return {"tokens": tokens, "page_size": page_size, "scattered": scattered, "bytes": tokens * host.bytes_per_token,
            "load_gbps": best / 1e9, "wall_gbps": tokens * host.bytes_per_token / wall / 1e9,
            "issue_ms": issue_s * 1000, "pinned": host.pinned}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per load (default 16384: 0.9 GiB)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    bytes_per_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2
    plain = plain_pinned_copy(args.tokens * bytes_per_token, args.repeats)
    print(f"plain pinned copy of {args.tokens * bytes_per_token / 2**30:.2f} GiB: {plain / 1e9:.1f} GB/s")
    rows = []
    for page_size in (1, 16):
        for scattered in (False, True):
            row = tier_load(args.tokens, page_size, scattered, args.repeats)
            row["vs_plain"] = row["load_gbps"] * 1e9 / plain
            rows.append(row)
            print(f"page {page_size:>2}, host slots {'scattered' if scattered else 'in one run'}: "
                  f"load {row['load_gbps']:.1f} GB/s ({row['vs_plain']:.0%} of plain), wall {row['wall_gbps']:.1f} "
                  f"GB/s, issued in {row['issue_ms']:.1f} ms, pinned={row['pinned']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plain_gbps": plain / 1e9, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
