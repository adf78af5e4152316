"""The host tier's memory: how much it may take, checked before it is built against what the OS
says is available (MemAvailable), so a `--hicache-size` beyond the machine is one line at start-up
instead of minutes building a free list and then a traceback (111 s and 15.6 GB once); and pinning
its buffers in place. No torch at import: the API process checks sizes with this module too."""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any, Optional

logger = logging.getLogger("radixserve")

MEMINFO = "/proc/meminfo"


def available_host_bytes() -> Optional[int]:
    """MemAvailable in bytes (memory the OS can hand out without swapping), or None where unknown."""
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_memory(needed_bytes: int, what: str) -> None:
    """ValueError naming `what` when `needed_bytes` is more than the host has available."""
    available = available_host_bytes()
    if available is not None and needed_bytes > available:
        raise ValueError(f"{what} needs {needed_bytes / 1e9:.1f} GB of host memory; {available / 1e9:.1f} GB is "
                         "available: lower it")


def pin_in_place(owner: Any, buffer: Any, what: str) -> bool:
    """Page-lock a CPU tensor in place for as long as `owner` lives (False where there is no CUDA or
    the driver refused: the copies then block and are slower). Registering it, unlike
    pin_memory(), does not round the size up to a power of two, which for tens of GB would double
    the host memory taken."""
    import torch

    if not torch.cuda.is_available():
        return False
    start = time.perf_counter()
    nbytes = buffer.numel() * buffer.element_size()
    cudart = torch.cuda.cudart()
    try:
        err = cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)
        failed = err != cudart.cudaError.success
    except Exception as e:  # noqa: BLE001: serve unpinned (slower, blocking copies) rather than not at all
        err, failed = e, True
    if failed:
        logger.warning("could not pin %s (%d bytes: %s): its copies will block and be slower",
                       what, nbytes, _error_name(cudart, err))
        # The failed call left its error as the thread's last CUDA error, which the next kernel
        # launch's check would report as its own: take it now.
        try:
            torch.zeros(1, device="cuda")
        except RuntimeError:
            pass
        return False
    logger.info("%s: %.1f GB pinned in %.1f s", what, nbytes / 1e9, time.perf_counter() - start)
    # Unregister before the buffer's memory goes back: a later allocation at the same addresses
    # could not be registered again ("already registered"). Not at exit: the driver drops it with
    # the process, and unregistering tens of GB would delay the exit.
    weakref.finalize(owner, _unpin, buffer).atexit = False
    return True


def _unpin(buffer: Any) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


def _error_name(cudart: Any, err: Any) -> str:
    try:
        return f"{int(err)} ({cudart.cudaGetErrorString(err)})"
    except Exception:  # noqa: BLE001: an exception, or an error code the binding cannot name
        return str(err)
