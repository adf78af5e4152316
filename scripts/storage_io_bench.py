"""Read bandwidth of the storage tier's store while the engine's thread is busy, on the CPU.

Writes --pages pages of a 7B model's shape (16 tokens x 57,344 bytes: Qwen2-7B's bf16 KV) into a
store under --dir (tmpfs by default: the disk is not what is measured), then reads them back as
one run into a host tier's slots, --repeats times, first with the process otherwise idle and then
beside a thread running Python without pause (the engine's thread between its kernel launches). What it shows: whether
the store's I/O shares the engine's interpreter lock. One JSON line per configuration.

    python scripts/storage_io_bench.py [--dir /dev/shm] [--pages 400] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time

import torch

from radixserve.cache.host_pool import HostKVPool
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.stores.disk import DiskStore
from radixserve.cache.stores.page_files import LocalFileBackend, PageRecord, StoreStamp

PAGE_SIZE, BYTES_PER_TOKEN = 16, 57344


def spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def read_once(store: DiskStore, host: HostKVPool, records: list[PageRecord], job_id: int) -> float:
    """One read of records into host tier slots, as the tier reads them; its bytes per second."""
    page_bytes = PAGE_SIZE * BYTES_PER_TOKEN
    job = store.new_read(job_id, records, host.alloc(len(records) * PAGE_SIZE))
    start = time.perf_counter()
    store.read(job)
    while not store.finished():
        time.sleep(0.0005)
    seconds = time.perf_counter() - start
    assert job.pages_read == len(records)
    store.release(job)
    host.allocator.free_slots(job.host_slots)
    return len(records) * page_bytes / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--pages", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    root = tempfile.mkdtemp(dir=args.dir)
    stamp = StoreStamp("bench", PAGE_SIZE, "bfloat16", BYTES_PER_TOKEN, 28)
    page_bytes = stamp.page_bytes
    # A host tier of the 7B's shape (28 layers, 4 KV heads of 128, bf16: 57,344 bytes a token)
    # that the reads land in, shared with the store's I/O process as the engine's is.
    device = KVPool(PAGE_SIZE, PAGE_SIZE, 28, 4, 128, torch.bfloat16, "cpu")
    host = HostKVPool(args.pages * PAGE_SIZE, device, pin=False, shared=True)
    assert host.bytes_per_token == BYTES_PER_TOKEN
    store = DiskStore(LocalFileBackend(root, 1 << 40), stamp, host_pool=host)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    try:
        records = [PageRecord(i + 1, i or None, list(range(i * PAGE_SIZE, (i + 1) * PAGE_SIZE)))
                   for i in range(args.pages)]
        for record in records:
            store.write(record, torch.randint(0, 256, (page_bytes,), dtype=torch.uint8), wait=True)
        store.flush()
        while store.pending_bytes:
            time.sleep(0.01)
        for busy in (False, True):
            stop = threading.Event()
            spinner = threading.Thread(target=spin, args=(stop,), daemon=True)
            if busy:
                spinner.start()
            rates = [read_once(store, host, records, i) for i in range(args.repeats)]
            stop.set()
            print(json.dumps({"engine_thread": "busy" if busy else "idle", "commit": commit, "dir": args.dir,
                              "pages": args.pages, "mb": round(args.pages * page_bytes / 1e6),
                              "median_gbps": round(statistics.median(rates) / 1e9, 2),
                              "min_gbps": round(min(rates) / 1e9, 2), "max_gbps": round(max(rates) / 1e9, 2),
                              "cpus": os.cpu_count()}))
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
