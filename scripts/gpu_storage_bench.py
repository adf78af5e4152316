"""TTFT of a long prefix served from the storage tier against computing it, on one GPU.

A server with the storage tier (7B dummy weights by default) computes a 16k-token prompt (the
recompute TTFT), is stopped (SIGTERM writes its cached pages to --storage-dir), the OS page cache
is dropped where we may, and a restarted server answers the same prompt plus one token from disk
(the storage TTFT); a fresh 16k-token prompt on the restarted server is the recompute TTFT beside
it. On the GPU machine, from the repository root, with .whl and .qwen2-tokenizer carried:

    bash scripts/gpu_run.sh python scripts/gpu_storage_bench.py --out $OUT/storage.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: argparse.Namespace, log: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--model-path", args.model, "--load-format", "dummy",
           "--tokenizer-path", args.tokenizer, "--page-size", str(args.page_size), "--hicache-ratio", "1",
           "--max-total-tokens", str(args.pool), "--storage-dir", args.storage_dir, "--storage-size", "40",
           "--cuda-graph-max-bs", "8", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {open(log).read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("server not ready")


def ttft(url: str, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    reply = httpx.post(url + "/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 1, "temperature": 0}}, timeout=600)
    seconds = time.perf_counter() - start
    reply.raise_for_status()
    return seconds, reply.json()["meta_info"]["cached_tokens"]


def metrics(url: str) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("radixserve:storage") or line.startswith("radixserve:hicache_load"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(300)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="benchmarks/configs/qwen2-7b")
    p.add_argument("--tokenizer", default=".qwen2-tokenizer")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--pool", type=int, default=120000)
    p.add_argument("--storage-dir", default="/tmp/radixserve-storage")
    p.add_argument("--out", default="storage.json")
    args = p.parse_args()
    rng = random.Random(1)
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f).get("vocab_size", 100000)
    ids = lambda n: [rng.randrange(vocab // 100, min(vocab, 100000)) for _ in range(n)]  # noqa: E731
    warm, prompt, fresh = ids(args.tokens), ids(args.tokens), ids(args.tokens)
    log_dir = os.path.dirname(os.path.abspath(args.out))
    result: dict = {"tokens": args.tokens, "page_size": args.page_size}
    proc, url = start(args, os.path.join(log_dir, "server-1.log"))
    try:
        ttft(url, warm)  # the first long prefill pays for kernel choices
        result["recompute_ttft_s_first_server"], _ = ttft(url, prompt)
    finally:
        stop(proc)
    dropped = subprocess.run("sync && echo 3 > /proc/sys/vm/drop_caches", shell=True).returncode == 0
    result["page_cache_dropped"] = dropped
    proc, url = start(args, os.path.join(log_dir, "server-2.log"))
    try:
        ttft(url, warm[: args.tokens // 2] + ids(args.tokens // 2))  # kernels warm; half of it from disk
        before = metrics(url)
        result["storage_ttft_s"], result["storage_cached_tokens"] = ttft(url, prompt + [7])
        result["recompute_ttft_s"], result["recompute_cached_tokens"] = ttft(url, fresh)
        after = metrics(url)
        result["metrics_delta"] = {k: after[k] - before.get(k, 0.0) for k in after}
    finally:
        stop(proc)
    result["speedup"] = result["recompute_ttft_s"] / result["storage_ttft_s"]
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
