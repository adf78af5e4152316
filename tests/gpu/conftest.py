"""GPU tests share one device across pytest-xdist's workers. A test that measures how much device
memory is in use (the memory plan's arithmetic) asks for `gpu_alone`: it then runs while no other
worker's test runs, every other test holding the device shared."""
from __future__ import annotations

import fcntl
import os
import tempfile
from typing import Iterator

import pytest

_LOCK_PATH = os.path.join(tempfile.gettempdir(), "radixserve-gpu-tests.lock")


@pytest.fixture(autouse=True)
def _gpu_shared(request) -> Iterator[None]:
    with open(_LOCK_PATH, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if "gpu_alone" in request.fixturenames else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def gpu_alone() -> None:
    """Marker fixture: `_gpu_shared` takes the device lock exclusively for this test."""
