"""Bearer-token check shared by the server and the router."""

from __future__ import annotations

from typing import Optional

from radixserve.http_common.api_keys import ApiKey, ApiKeyRing
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
    """Pure ASGI (streams pass through untouched); keys are looked up by digest (`ApiKeyRing`), so
    the time a check takes says nothing about how close a wrong key came.

    `keys` guard every path but /health; `admin_api_key` guards `ADMIN_PATHS` instead of them
    (without it, the admin paths take any of `keys`; with neither, nothing is checked)."""

    OPEN_PATHS = ("/health",)

    def __init__(self, app, keys: Optional[ApiKeyRing] = None, admin_api_key: Optional[str] = None):
        self.app = app
        self.keys = keys if keys else None
        self.admin_keys = ApiKeyRing([ApiKey(admin_api_key, "admin")]) if admin_api_key else self.keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.OPEN_PATHS:
            return await self.app(scope, receive, send)
        admin = scope["path"] in ADMIN_PATHS
        expected = self.admin_keys if admin else self.keys
        if expected is None:
            return await self.app(scope, receive, send)
        given = bearer_token(dict(scope.get("headers") or ()).get(b"authorization", b""))
        if expected.match(given) is not None:
            return await self.app(scope, receive, send)
        what = "admin API key" if admin and self.admin_keys is not self.keys else "API key"
        response = error_response(401, f"missing or invalid {what} (send 'Authorization: Bearer <key>')",
                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
