"""The storage tier's reports under tensor parallelism: each rank other than 0 tells rank 0 what
became of its shard's writes and reads (cache/storage_shards.py), over one ZMQ socket rank 0 pulls
from. It runs the other way from the step messages and never inside a step: rank 0 reads it,
without waiting, when its tier polls (each step's start), and waits on it only at start-up, for
every rank's list of the pages it found.

Rank 0 binds the socket (IPC on one node, TCP on a free port when ranks run on other nodes) and
advertises its address in the group's store, under REPORTS_KEY; every rank connects to it there.
A report is a tuple of numbers, strings and lists, sent as JSON: rank 0 never unpickles what
arrives on a port it listens on.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Optional

import zmq

from radixserve.cache.storage_shards import Report

REPORTS_KEY = "radixserve/tp-storage-reports"


def _decode(data: bytes) -> Report:
    return tuple(json.loads(data))


class ReportInbox:
    """Rank 0's end: the other ranks' reports."""

    def __init__(self, ctx: zmq.Context, store, ipc_dir: str, host: Optional[str]):
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        if host is None:
            addr = f"ipc://{os.path.join(ipc_dir, 'storage-reports')}"
            self.sock.bind(addr)
        else:
            addr = f"tcp://{host}:{self.sock.bind_to_random_port('tcp://*')}"
        store.set(REPORTS_KEY, addr)

    def poll(self) -> list[Report]:
        reports = []
        while True:
            try:
                reports.append(_decode(self.sock.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return reports

    def wait(self, timeout_s: float) -> Optional[Report]:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return _decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close(0)


class ReportOutbox:
    """A rank's end (called from its engine thread and its store's events thread)."""

    def __init__(self, ctx: zmq.Context, store):
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(store.get(REPORTS_KEY).decode())
        self._lock = threading.Lock()

    def __call__(self, report: Report) -> None:
        data = json.dumps(report).encode()
        with self._lock:
            if not self.sock.closed:
                self.sock.send(data)

    def close(self) -> None:
        with self._lock:
            self.sock.close()
