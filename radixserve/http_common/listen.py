"""The address a server will listen on, checked before anything starts (the API server and the router).

A port outside 1-65535 is refused here: the socket layer takes it modulo 65536 (`--port 99999`
listened on 34463 while the log said 99999). Port 0 ("any free port" to the OS) is refused too:
the log line and every client that reads the flag would name a port nobody listens on.
"""

from __future__ import annotations

import errno
import socket

MIN_PORT, MAX_PORT = 1, 65535


class ListenAddressError(ValueError):
    """The server cannot listen there; the message says why in one line."""


def check_port_range(port: int) -> None:
    if not MIN_PORT <= port <= MAX_PORT:
        raise ListenAddressError(f"--port {port}: a TCP port is {MIN_PORT}-{MAX_PORT}")


def check_listen_address(host: str, port: int) -> None:
    """The port is in range and host:port binds the way uvicorn will bind it (SO_REUSEADDR); the
    socket is let go again."""
    check_port_range(port)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ListenAddressError(f"--host {host!r}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ListenAddressError(f"--port {port}: {host}:{port} is already in use (another server on it? "
                                         "choose another --port)") from None
            raise ListenAddressError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
