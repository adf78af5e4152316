"""What the API process does with a request before any endpoint sees it (after uvicorn's paced
HTTP parsing, `radixserve.http_common.paced_http`): refuse a body over `--max-request-bytes` (413,
before reading it) and a body that is not JSON (415), count and log every request it rejects, and
parse JSON bodies with msgspec (`MsgspecJSONRoute`).

The body limit and the rejection count are pure ASGI middleware, so streams pass through untouched.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Coroutine

import msgspec
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve.http_common.errors import error_response
from radixserve.server.metrics import ServerMetrics

logger = logging.getLogger("radixserve")

# A request body may hold this many bytes per context token by default: 4 bytes a character
# (UTF-8's longest) times 16 characters a token, more than any real tokenizer averages.
REQUEST_BYTES_PER_CONTEXT_TOKEN = 4 * 16
# Paths whose errors are answers, not rejections: a red /health is what a probe asked about.
NOT_REJECTIONS = ("/health", "/health_generate")
# The status a client that went away is answered with (nobody reads it).
CLIENT_CLOSED_STATUS = 499


def _too_large_message(limit: int) -> str:
    return f"the request body is larger than {limit} bytes (--max-request-bytes)"


class _TooLarge(StarletteHTTPException):
    """Raised from the body's receive once a chunked body passes the limit. An HTTPException, so
    FastAPI's body reader passes it on (any other exception there becomes a generic 400) and the
    error handler answers 413."""

    def __init__(self, limit: int):
        super().__init__(413, _too_large_message(limit), headers={"Connection": "close"})


# Media types a JSON body may be sent as: application/json and its +json relatives. A body with no
# Content-Type is refused too, as FastAPI's strict default would (a browser's cross-site "simple"
# request cannot send application/json).
def _is_json_media_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class JSONContentTypeMiddleware:
    """415 for a request body sent as anything but JSON: curl's `-d` sends
    application/x-www-form-urlencoded, which the endpoints would otherwise see as raw bytes and
    refuse with a pydantic message about dictionaries that names nothing the client did."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        content_type = headers.get(b"content-type")
        has_body = headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers
        if not has_body or (content_type is not None and _is_json_media_type(content_type.decode("latin-1"))):
            return await self.app(scope, receive, send)
        got = repr(content_type.decode("latin-1").split(";", 1)[0].strip()) if content_type else "none"
        response = error_response(
            415, f"the request body must be JSON sent with Content-Type: application/json, not {got} "
            "(with curl: -H 'Content-Type: application/json')", param="Content-Type",
            code="unsupported_media_type", headers={"Connection": "close"})
        await response(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over `limit()` bytes: by its Content-Length before reading anything, or as
    soon as a chunked body passes the limit."""

    def __init__(self, app, limit: Callable[[], int]):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit()
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await self._refuse(scope, receive, send, limit)
        seen = 0

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge(limit)
            return message

        try:
            await self.app(scope, counting_receive, send)
        except _TooLarge:
            await self._refuse(scope, receive, send, limit)

    @staticmethod
    async def _refuse(scope, receive, send, limit: int) -> None:
        response = error_response(413, _too_large_message(limit), code="request_too_large",
                                  headers={"Connection": "close"})
        await response(scope, receive, send)


class RejectionRecorder:
    """Counts every request answered with an error (`radixserve:rejected_requests_total` by status
    and reason, the error body's `code`) and, with `--log-requests`, logs one line for it: path,
    status, reason and field, never the request's text."""

    def __init__(self, app, metrics: ServerMetrics, log: bool):
        self.app = app
        self.metrics = metrics
        self.log = log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in NOT_REJECTIONS:
            return await self.app(scope, receive, send)
        status = 0
        recorded = False

        async def recording_send(message):
            nonlocal status, recorded
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400 and status != CLIENT_CLOSED_STATUS \
                    and not recorded:
                recorded = True
                self.record(scope, status, message.get("body", b""))
            await send(message)

        await self.app(scope, receive, recording_send)

    def record(self, scope, status: int, body: bytes) -> None:
        reason, param = f"http_{status}", None
        try:
            error = json.loads(body)["error"]
            reason = error.get("code") or reason
            param = error.get("param")
        except (ValueError, KeyError, TypeError):
            pass
        self.metrics.rejected.labels(status=str(status), reason=str(reason)).inc()
        if self.log:  # the field name may be the client's own (an unknown field): escaped
            logger.info("Request rejected. path: %s, status: %d, reason: %s, param: %s",
                        _escaped(scope.get("path")), status, _escaped(reason), _escaped(param))


def _escaped(value) -> str:
    return str(value).encode("unicode_escape").decode("ascii")


class MsgspecJSONRequest(Request):
    """A request whose JSON body is parsed by msgspec: a prompt of 2,000 token ids takes the json
    module ~0.24 ms, on the event loop, msgspec a third of that. Whatever msgspec refuses (NaN,
    a lone surrogate, a byte-order mark, malformed JSON) is parsed by the json module as before,
    so the values and the errors stay the json module's."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = msgspec.json.decode(body)
            except msgspec.DecodeError:
                self._json = json.loads(body)
        return self._json


class MsgspecJSONRoute(APIRoute):
    """An API route whose endpoint gets its JSON body through `MsgspecJSONRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def msgspec_json_handler(request: Request) -> Response:
            return await handler(MsgspecJSONRequest(request.scope, request.receive, request._send))
        return msgspec_json_handler
