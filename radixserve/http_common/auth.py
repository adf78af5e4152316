"""Bearer-token check shared by the server and the router."""

from __future__ import annotations

import hmac
from typing import Optional

from radixserve.http_common.errors import error_response

# Endpoints that change every user's state (/flush_cache wipes everyone's cache) or show what other
# users sent (/kv_events follows what every user's prompts share).
ADMIN_PATHS = ("/flush_cache", "/kv_events")


def bearer_token(header: bytes) -> Optional[bytes]:
    """The token of an `Authorization: Bearer <token>` header; the scheme is case-insensitive
    (RFC 9110), so `bearer` and `BEARER` work too."""
    scheme, _, token = header.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


class APIKeyMiddleware:
    """Pure ASGI (streams pass through untouched); compares keys in constant time.

    `api_key` guards every path but /health; `admin_api_key` guards `ADMIN_PATHS` instead of it
    (with only `api_key` set, the admin paths take that key; with neither, nothing is checked)."""

    OPEN_PATHS = ("/health",)

    def __init__(self, app, api_key: Optional[str] = None, admin_api_key: Optional[str] = None):
        self.app = app
        self.expected = api_key.encode() if api_key else None
        self.admin_expected = admin_api_key.encode() if admin_api_key else self.expected

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.OPEN_PATHS:
            return await self.app(scope, receive, send)
        admin = scope["path"] in ADMIN_PATHS
        expected = self.admin_expected if admin else self.expected
        if expected is None:
            return await self.app(scope, receive, send)
        given = bearer_token(dict(scope.get("headers") or ()).get(b"authorization", b""))
        if given is not None and hmac.compare_digest(given, expected):
            return await self.app(scope, receive, send)
        what = "admin API key" if admin and self.admin_expected is not self.expected else "API key"
        response = error_response(401, f"missing or invalid {what} (send 'Authorization: Bearer <key>')",
                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
