"""Which key each router endpoint takes, checked before anything is read or forwarded.

- `/health`: open.
- Admin endpoints (`POST /workers`, `DELETE /workers/{id}`, `POST /flush_cache`): they decide where
  every user's requests, keys and prompts go, and flush every worker with the workers' admin key,
  so they take the router's own `--admin-api-key` and never `--api-key`, which every client holds.
  Without `--admin-api-key` they are off: 403 with an error body that says how to turn them on.
  Not "loopback only": a reverse proxy or a sidecar on the router's host connects from loopback
  on behalf of any client.
- Answered by the router itself, nothing forwarded (`GET /workers`, `GET /metrics`): `--api-key`
  or `--admin-api-key`, so the operator's tools need only the admin key.
- Everything else is forwarded to a worker with the client's `Authorization` header: `--api-key`
  (open without one). The admin key is refused there, so it never reaches a worker.

The admin endpoints check the admin key themselves (`admin_refusal`); the middleware only lets
them past the user key check. A path spelling the table here misses therefore reaches no admin
handler without the admin key: it is checked as a forwarded path.
"""

from __future__ import annotations

import hmac
from typing import Optional

from fastapi.responses import JSONResponse

from radixserve.http_common.api_keys import ApiKeyRing
from radixserve.http_common.auth import bearer_token
from radixserve.http_common.errors import error_response

OPEN_PATHS = ("/health",)
ROUTER_READ_PATHS = ("/workers", "/metrics")
READ_METHODS = ("GET", "HEAD")
ADMIN_ENDPOINTS = "POST /workers, DELETE /workers/{id} and POST /flush_cache"


def endpoint_class(method: str, path: str) -> str:
    """'open', 'admin', 'router_read' or 'forwarded'."""
    if path in OPEN_PATHS:
        return "open"
    if path == "/flush_cache" or path.startswith("/workers/") or (path == "/workers" and method not in READ_METHODS):
        return "admin"
    if path in ROUTER_READ_PATHS and method in READ_METHODS:
        return "router_read"
    return "forwarded"


def _authorization(headers: list[tuple[bytes, bytes]]) -> tuple[int, Optional[bytes]]:
    """(how many Authorization headers, the bearer token of the one there is)."""
    values = [v for k, v in headers if k.lower() == b"authorization"]
    return len(values), bearer_token(values[0]) if len(values) == 1 else None


def _matches(given: Optional[bytes], expected: Optional[bytes]) -> bool:
    return given is not None and expected is not None and hmac.compare_digest(given, expected)


def admin_refusal(headers: list[tuple[bytes, bytes]], admin_api_key: Optional[str],
                  endpoint: str) -> Optional[JSONResponse]:
    """None when the request carries the router's admin key; else the error to answer with."""
    if not admin_api_key:
        return error_response(
            403, f"{endpoint} is off: this router was started without --admin-api-key. Start it with "
            "--admin-api-key KEY (a key other than --api-key) and send 'Authorization: Bearer KEY'.",
            code="admin_api_disabled")
    count, given = _authorization(headers)
    if count == 1 and _matches(given, admin_api_key.encode()):
        return None
    return error_response(401, f"{endpoint} takes the router's admin API key (--admin-api-key), not the API "
                          "key: missing or invalid (send 'Authorization: Bearer <admin key>')",
                          code="invalid_admin_api_key", headers={"WWW-Authenticate": "Bearer"})


class RouterAccessMiddleware:
    """Pure ASGI (streams pass through untouched); keys are compared in constant time."""

    def __init__(self, app, keys: Optional[ApiKeyRing] = None, admin_api_key: Optional[str] = None):
        self.app = app
        self.keys = keys if keys else None
        self.admin_expected = admin_api_key.encode() if admin_api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        kind = endpoint_class(scope["method"], scope["path"])
        if kind in ("open", "admin"):  # admin: the handler checks the admin key
            return await self.app(scope, receive, send)
        count, given = _authorization(scope.get("headers") or [])
        if count > 1:  # which one would a worker read? answer none
            response = error_response(400, "send one Authorization header at most", code="invalid_request")
        elif _matches(given, self.admin_expected):
            if kind == "router_read":
                return await self.app(scope, receive, send)
            response = error_response(
                401, "the router's admin API key is taken only by its admin and status endpoints and is never "
                "forwarded to a worker: send the API key (--api-key) here", code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"})
        elif self.keys is None or self.keys.match(given) is not None:
            return await self.app(scope, receive, send)
        else:
            response = error_response(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def access_summary(has_api_keys: bool, admin_api_key: Optional[str]) -> str:
    """One start-up log line: who may do what."""
    users = "take --api-key" if has_api_keys else "are open (no --api-key)"
    if admin_api_key:
        admin = f"{ADMIN_ENDPOINTS} take --admin-api-key only"
    else:
        admin = f"{ADMIN_ENDPOINTS} are off (403) until the router is started with --admin-api-key"
    return f"router: generation, tokenizing and status endpoints {users}; {admin}"
