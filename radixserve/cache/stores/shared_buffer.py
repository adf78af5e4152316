"""Memory two processes map: the storage tier's pages on their way to and from its I/O process.

A `SharedBuffer` is an anonymous memory file (memfd: not under /dev/shm, so a container's small
/dev/shm does not limit it), mapped by the engine process and by the I/O process it starts, which
receives the file descriptor. Its memory is taken from the OS as it is first written, not when it
is made, unless it is populated. `Regions` hands out parts of one (first fit, aligned, neighbours merged when freed); only
the engine process allocates, and tells the I/O process the offsets.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
from typing import Optional

ALIGN = 4096  # regions start on a memory page: copies into them run at full speed
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14 (Python names it from 3.13 on)


class SharedBuffer:
    def __init__(self, nbytes: int, name: str, *, fd: Optional[int] = None, populate: bool = False):
        self.nbytes = max(-(-nbytes // ALIGN) * ALIGN, ALIGN)
        if fd is None:
            fd = os.memfd_create(name)  # close-on-exec: only the I/O process it is passed to inherits it
            os.ftruncate(fd, self.nbytes)
        self.fd = fd
        # populate: its memory taken and mapped now, so the first read into it pays no page faults
        # (0.4 s for a 16k-token prefix of a 7B model).
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        self.map = mmap.mmap(fd, self.nbytes, flags=flags)

    @classmethod
    def attach(cls, fd: int, nbytes: int, *, populate: bool = False) -> "SharedBuffer":
        """The other process's mapping of a buffer whose descriptor it was given."""
        return cls(nbytes, "", fd=fd, populate=populate)

    def populate_in_background(self) -> None:
        """Map all of it into this process on a thread of its own, so a first read into a part
        pays no page faults then (a 16k-token prefix of a 7B model: 230,000 of them)."""
        threading.Thread(target=self._populate, name="populate", daemon=True).start()

    def _populate(self) -> None:
        step = 64 << 20  # a call at a time: each holds the interpreter lock
        for start in range(0, self.nbytes, step):
            try:
                self.map.madvise(MADV_POPULATE_WRITE, start, min(step, self.nbytes - start))
            except (OSError, ValueError):  # an older kernel: read a byte of each memory page (never
                view = memoryview(self.map)  # write one: the engine may be writing there)
                for at in range(start, self.nbytes, mmap.PAGESIZE):
                    view[at]
                return

    def view(self, offset: int, size: int) -> memoryview:
        return memoryview(self.map)[offset:offset + size]

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:
            pass  # a view is still alive (a tensor over it): the mapping goes with the process
        os.close(self.fd)


class Regions:
    """Allocation of [0, capacity) in ALIGN-sized steps: first fit, freed neighbours merged."""

    def __init__(self, capacity: int):
        self.capacity = capacity // ALIGN * ALIGN
        self._free_starts: list[int] = [0] if self.capacity else []
        self._free_sizes: dict[int, int] = {0: self.capacity} if self.capacity else {}
        self._taken: dict[int, int] = {}  # offset -> size
        self.used = 0

    def alloc(self, nbytes: int) -> Optional[int]:
        """The offset of a free region of nbytes (None: no free region that large)."""
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for i, start in enumerate(self._free_starts):
            free = self._free_sizes[start]
            if free < size:
                continue
            del self._free_sizes[start]
            if free == size:
                del self._free_starts[i]
            else:
                self._free_starts[i] = start + size
                self._free_sizes[start + size] = free - size
            self._taken[start] = size
            self.used += size
            return start
        return None

    def free(self, offset: int) -> None:
        size = self._taken.pop(offset)
        self.used -= size
        i = bisect.bisect_left(self._free_starts, offset)
        if i < len(self._free_starts) and offset + size == self._free_starts[i]:  # merge the one after
            size += self._free_sizes.pop(self._free_starts.pop(i))
        if i and self._free_starts[i - 1] + self._free_sizes[self._free_starts[i - 1]] == offset:  # and before
            before = self._free_starts[i - 1]
            self._free_sizes[before] += size
            return
        self._free_starts.insert(i, offset)
        self._free_sizes[offset] = size

    def __contains__(self, offset: int) -> bool:
        return offset in self._taken
