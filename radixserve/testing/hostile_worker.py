"""A hostile worker: a real HTTP server on loopback that a router may be pointed at.

Its /health says ok (so it stays in rotation, or comes back to it); every other request gets one
of the misbehaviours of `MODES` in turn: bytes that are not HTTP, a hang then a reset, a reset, a
500, an event stream dripped slowly and cut off, a redirect to another loopback address (the
"collector", which records what follows it), a 200 whose JSON body is garbage, a body shorter than
its Content-Length. Every Authorization header it or the collector receives is recorded, so a
soak can tell whether a key meant for trusted workers ever reached it.

Plain sockets and threads (no framework), so each misbehaviour is exactly what goes on the wire.
"""

from __future__ import annotations

import collections
import itertools
import socket
import struct
import threading
import time
from typing import Optional

MODES = ("garbage", "hang", "reset", "status_500", "slow_sse", "redirect", "bad_json", "short_body")
# Marks every body it sends, so a client can tell an answer that came from it.
MARK = b"HOSTILE-WORKER"
HANG_S = 8.0


def _read_request(conn: socket.socket) -> Optional[tuple[str, str, dict[str, str]]]:
    """(method, path, headers) of one request; its body is read and dropped."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
        if len(data) > 1 << 20:
            return None
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) < 2:
        return None
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    remaining = int(headers.get("content-length") or 0) - len(rest)
    while remaining > 0:
        chunk = conn.recv(min(remaining, 65536))
        if not chunk:
            break
        remaining -= len(chunk)
    return parts[0], parts[1], headers


def _reset(conn: socket.socket) -> None:
    """Close with RST, not FIN: the peer sees 'connection reset'."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def _answer(status: str, content_type: str, body: bytes, extra: str = "", length: Optional[int] = None) -> bytes:
    length = len(body) if length is None else length
    return (f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {length}\r\n{extra}"
            f"connection: close\r\n\r\n").encode() + body


class _LoopbackServer:
    """Accepts connections on a loopback port, one thread each, and records Authorization headers."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.lock = threading.Lock()
        self.authorizations: collections.Counter = collections.Counter()  # header value -> requests
        self.requests: collections.Counter = collections.Counter()  # "METHOD path" -> requests
        self._closed = False
        threading.Thread(target=self._accept, name=name, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            request = _read_request(conn)
            if request is None:
                conn.close()
                return
            method, path, headers = request
            with self.lock:
                self.requests[f"{method} {path.split('?')[0]}"] += 1
                if "authorization" in headers:
                    self.authorizations[headers["authorization"]] += 1
            self.handle(conn, method, path)
        except OSError:
            pass
        finally:
            try:
                conn.close()
            except OSError:
                pass

    def handle(self, conn: socket.socket, method: str, path: str) -> None:
        conn.sendall(_answer("404 Not Found", "application/json", b'{"detail": "' + MARK + b'"}'))

    def received(self, authorization: str) -> int:
        with self.lock:
            return self.authorizations[authorization]

    def stop(self) -> None:
        self._closed = True
        self.sock.close()


class HostileWorker(_LoopbackServer):
    def __init__(self) -> None:
        super().__init__("hostile-worker")
        self.collector = _LoopbackServer("hostile-collector")  # where its redirects point
        self._modes = itertools.cycle(MODES)
        self.answered: collections.Counter = collections.Counter()  # mode -> requests

    def handle(self, conn: socket.socket, method: str, path: str) -> None:
        if path == "/health":
            conn.sendall(_answer("200 OK", "application/json", b'{"status": "ok"}'))
            return
        with self.lock:
            mode = next(self._modes)
            self.answered[mode] += 1
        if mode == "garbage":
            conn.sendall(b"\x00\xffNOT HTTP AT ALL " + MARK + b"\r\n\r\n")
        elif mode == "hang":
            time.sleep(HANG_S)
            _reset(conn)
        elif mode == "reset":
            _reset(conn)
        elif mode == "status_500":
            conn.sendall(_answer("500 Internal Server Error", "application/json",
                                 b'{"error": {"message": "' + MARK + b'", "code": "boom"}}'))
        elif mode == "slow_sse":
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                         b"connection: close\r\n\r\n")
            for i in range(3):
                event = b'data: {"drip": %d, "from": "' % i + MARK + b'"}\n\n'
                conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
                time.sleep(0.7)
            _reset(conn)  # cut off mid-stream, no [DONE]
        elif mode == "redirect":
            conn.sendall(_answer("307 Temporary Redirect", "application/json", b'{"to": "' + MARK + b'"}',
                                 extra=f"location: {self.collector.url}{path}\r\n"))
        elif mode == "bad_json":
            conn.sendall(_answer("200 OK", "application/json", b'{"choices": [' + MARK))
        else:  # short_body: promises more than it sends, then closes
            conn.sendall(_answer("200 OK", "application/json", b'{"' + MARK + b'"', length=4096))

    def stop(self) -> None:
        super().stop()
        self.collector.stop()
