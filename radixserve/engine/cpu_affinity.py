"""Keep an engine process on the CPU cores next to its GPU, and its torch CPU ops on one thread.

A small model's decode step is bound by the host: Python builds the batch and launches a few
hundred kernels, each a write across PCIe to the GPU. On a machine with several NUMA nodes a
process the OS placed on the far node pays the interconnect on every launch and every pinned
copy, for the whole run, and where it lands changes from one start to the next. The kernel tells
which cores are local to a PCI device (`local_cpulist` in sysfs); binding the engine there before
it allocates pinned memory or starts threads makes every run start from the same place.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

SYSFS_PCI = Path("/sys/bus/pci/devices")


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def gpu_local_cpus(device: torch.device, sysfs: Path = SYSFS_PCI) -> Optional[set[int]]:
    """The cores the kernel lists as local to this CUDA device's PCI function; None where unknown."""
    props = torch.cuda.get_device_properties(device)
    ids = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(i is None for i in ids):
        return None
    path = sysfs / f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0" / "local_cpulist"
    try:
        return parse_cpulist(path.read_text()) or None
    except (OSError, ValueError):
        return None


def bind_near_gpu(device: torch.device) -> Optional[set[int]]:
    """Restrict this process to the allowed cores local to `device` when they are a proper subset
    of what it may run on (several NUMA nodes); returns the cores bound to, else None."""
    if device.type != "cuda" or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    local = gpu_local_cpus(device)
    if not local:
        return None
    near = local & allowed
    if not near or near == allowed:
        return None
    # Threads started so far (ZMQ's I/O thread) keep their own mask: move every one; later ones inherit.
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
        try:
            os.sched_setaffinity(int(tid), near)
        except OSError:  # a thread that ended meanwhile
            pass
    logger.info("engine bound to the %d CPU cores local to %s (of %d allowed)", len(near), device, len(allowed))
    return near


def one_host_thread(device: torch.device) -> bool:
    """Run this process's torch CPU operations on one thread when it serves a GPU; whether it did.

    A GPU engine's CPU tensors are a step's index lists (up to a few hundred thousand ints when a
    burst of prompts is admitted). Over 32k elements torch splits an operation across its
    intra-op pool, one thread per core, and the operation waits for the slowest: on a machine
    whose cores also run the API process, the client and other ranks, a descheduled pool thread
    stalls it. Measured on a 2-core machine with one competing busy process: a burst step's table
    writes 5-6 ms on two threads, 2 ms on one; on an H200 host these operations took 17-20% of a
    host-bound 0.5B engine's samples. An explicit OMP_NUM_THREADS is left as it is."""
    if device.type != "cuda" or "OMP_NUM_THREADS" in os.environ:
        return False
    torch.set_num_threads(1)
    return True
