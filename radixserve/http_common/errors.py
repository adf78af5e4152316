"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}` for every failure."""

from __future__ import annotations

import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
               415: "invalid_request_error",
               500: "server_error", 503: "service_unavailable_error"}
# The `code` of errors Starlette raises itself (unknown path, wrong method).
HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                   headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def bad_request(message: str, param: Optional[str] = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _param_of(loc) -> Optional[str]:
    # Union members show up in loc as "str", "list[int]" or a model's class name ("NativeSamplingParams"):
    # keep field names and list indices.
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part != "body" and not any(c in part for c in "[]-") and not part[:1].isupper() \
                and part not in ("str", "int", "float", "bool"):
            param += f".{part}" if param else part
    return param or None


def _validation_error(exc: RequestValidationError) -> tuple[str, Optional[str], str]:
    """(message, param, code) for the first problem pydantic found in a request body."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None, "invalid_request"
    # A value against a union (a prompt: token ids or text) fails every member; the members whose
    # type did not even match ("list_type", "int_type") say least about what is wrong.
    first: dict[str, Any] = next((e for e in errors if not e.get("type", "").endswith("_type")), errors[0])
    param = _param_of(first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "the body is not valid JSON", None, "invalid_request"
    if kind == "extra_forbidden":  # a field this server does not implement: refused by name
        return f"{param} is not supported by this server", param, "unsupported_parameter"
    message = first.get("msg", "invalid value")
    if param:
        message = f"{param}: {message}"
    return message, param, "invalid_request"


class CatchAllMiddleware:
    """Any exception a handler did not turn into a response becomes a 500 with an OpenAI error body,
    and the connection stays usable: Starlette's own last-resort handler answers 500 but re-raises,
    and the server then drops the keep-alive connection (the client's next request is reset)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001: the last line of defence, logged with its traceback
            logging.getLogger("radixserve").exception("unexpected error on %s", scope.get("path"))
            if not started:
                response = error_response(500, f"internal error: {type(exc).__name__}", code="internal_error")
                await response(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """Every failure as an OpenAI error body; add before any other middleware (so it is innermost)."""
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error_response(request: Request, exc: RequestValidationError):
        message, param, code = _validation_error(exc)
        return error_response(400, message, param=param, code=code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        return error_response(exc.status_code, message, code=HTTP_ERROR_CODES.get(exc.status_code),
                              headers=getattr(exc, "headers", None))

    app.add_middleware(CatchAllMiddleware)
