"""The storage tier's I/O process: `PageIO` in a process of its own, beside the engine's.

The engine process starts it (`IOProcess`) with a socket pair and three shared buffers
(shared_buffer.py): pages to write, copied there by the engine; the host tier's KV slots, which
pages are read straight into; and a read buffer for the rest (a hybrid's state snapshots, and
buffers of a caller's own). Over the socket go small pickled messages only: commands one way, batches of
events the other (page_io.py). A thread of the engine process waits on the socket and hands the
events to the store; it takes the interpreter lock once per batch, where reading a page in the
engine's process took it several times per page.

The process ignores Ctrl-C (the server shuts it down in order: the queued writes finish, the index
is saved) and ends by itself when the engine's end of the socket closes, a crash included, after
writing what was queued.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable, Optional

from radixserve.cache.stores.page_files import PageBackend, StoreStamp
from radixserve.cache.stores.page_io import Event, PageIO
from radixserve.cache.stores.shared_buffer import SharedBuffer

logger = logging.getLogger("radixserve")

# How long close waits for the process to write what is queued and save its index.
CLOSE_WAIT_S = 600.0


class IOProcess:
    """The engine's end: starts the process, opens the backend there, sends commands and hands
    the events that come back to `on_events` (from a thread of its own); `on_exit(why)` when the
    process ended without being closed."""

    def __init__(self, backend: PageBackend, stamp: StoreStamp, *, write_bytes: int, read_bytes: int,
                 host_buffer: Optional[SharedBuffer], on_events: Callable[[list[Event]], None],
                 on_exit: Callable[[str], None]):
        self.on_events = on_events
        self.on_exit = on_exit
        self.write_buffer = SharedBuffer(write_bytes, "radixserve-storage-writes")
        self.read_buffer = SharedBuffer(read_bytes, "radixserve-storage-reads", populate=True)
        ours, theirs = socket.socketpair()
        fds = (theirs.fileno(), self.write_buffer.fd, self.read_buffer.fd) + ((host_buffer.fd,) if host_buffer else ())
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[3])  # the directory holding the radixserve package
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        args = [str(theirs.fileno()), str(self.write_buffer.fd), str(self.write_buffer.nbytes),
                str(self.read_buffer.fd), str(self.read_buffer.nbytes),
                str(host_buffer.fd if host_buffer else -1), str(host_buffer.nbytes if host_buffer else 0)]
        self.process = subprocess.Popen([sys.executable, "-m", "radixserve.cache.stores.io_process", *args],
                                        pass_fds=fds, env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._closing = False
        try:
            self.conn.send(("open", backend, stamp))
            reply = self.conn.recv()
            while isinstance(reply, list):  # what the backend logged while opening
                on_events(reply)
                reply = self.conn.recv()
        except (EOFError, OSError):
            self.process.wait(10)
            raise RuntimeError(f"storage tier: its I/O process ended at start-up (exit code "
                               f"{self.process.returncode}; its error is above)") from None
        if reply[0] == "failed":
            self.process.wait(10)
            kind, message = reply[1], reply[2]
            raise (ValueError if kind == "ValueError" else RuntimeError)(message)
        self.keys, self.namespace, self.used_bytes = reply[1], reply[2], reply[3]
        self._thread = threading.Thread(target=self._receive, name="storage-events", daemon=True)
        self._thread.start()

    def submit(self, command: tuple) -> bool:
        """Send a command; False when the process is gone (its end was reported to on_exit)."""
        try:
            with self._send_lock:
                self.conn.send(command)
            return True
        except OSError:
            return False

    def _receive(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                if not self._closing:
                    self.on_exit(f"exit code {self.process.wait()}")
                return
            if message == ("closed",):
                return
            try:
                self.on_events(message)
            except Exception:  # noqa: BLE001: the next events must still be heard
                logger.exception("storage tier: handling the I/O process's events failed")

    def close(self) -> None:
        """Let the process finish the queued writes, save its index and end."""
        self._closing = True
        if self.submit(("close",)):
            self._thread.join(CLOSE_WAIT_S)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            logger.warning("storage tier: its I/O process did not end; stopping it")
            self.process.kill()
            self.process.wait()
        self.conn.close()
        self.write_buffer.close()
        self.read_buffer.close()


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock_fd, write_fd, write_bytes, read_fd, read_bytes, host_fd, host_bytes = (int(a) for a in argv)
    conn = Connection(sock_fd)
    buffers = {"w": SharedBuffer.attach(write_fd, write_bytes), "r": SharedBuffer.attach(read_fd, read_bytes, populate=True)}
    if host_fd >= 0:
        buffers["h"] = SharedBuffer.attach(host_fd, host_bytes)
        buffers["h"].populate_in_background()
    send_lock = threading.Lock()

    def send(events: list[Event]) -> None:
        with send_lock:
            try:
                conn.send(events)
            except OSError:
                pass  # the engine is gone: what is queued is still written

    class ToEngine(logging.Handler):  # what the backend logs goes to the engine's log
        def emit(self, record: logging.LogRecord) -> None:
            send([("log", record.levelno, record.getMessage())])

    logger.addHandler(ToEngine())
    logger.setLevel(logging.INFO)
    logger.propagate = False

    def view(handle: tuple[str, int], nbytes: int) -> memoryview:
        return buffers[handle[0]].view(handle[1], nbytes)

    _, backend, stamp = conn.recv()
    io = PageIO(backend, send, view, threaded=True)
    try:
        opened = io.open(stamp)
    except Exception as e:  # noqa: BLE001: told to the engine, which raises it
        conn.send(("failed", type(e).__name__, str(e)))
        return 1
    conn.send(("opened", *opened))

    def receive() -> None:
        while True:
            try:
                command: Optional[tuple] = conn.recv()
            except (EOFError, OSError):
                command = ("close",)  # the engine is gone: finish the queued writes and end
            io.command(command)
            if command[0] == "close":
                return

    threading.Thread(target=receive, name="storage-commands", daemon=True).start()
    io.run()
    try:
        conn.send(("closed",))
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
