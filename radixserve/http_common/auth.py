"""Bearer-token check shared by the server and the router."""

from __future__ import annotations

import hmac
from typing import Optional

from radixserve.http_common.errors import error_response


def bearer_token(header: bytes) -> Optional[bytes]:
    """The token of an `Authorization: Bearer <token>` header; the scheme is case-insensitive
    (RFC 9110), so `bearer` and `BEARER` work too."""
    scheme, _, token = header.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


class APIKeyMiddleware:
    """Pure ASGI (streams pass through untouched); compares keys in constant time."""

    OPEN_PATHS = ("/health",)

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = bearer_token(dict(scope.get("headers") or ()).get(b"authorization", b""))
        if given is not None and hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        response = error_response(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
