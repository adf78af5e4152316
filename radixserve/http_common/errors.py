"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}` for every failure."""

from __future__ import annotations

from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
               503: "service_unavailable_error"}


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


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first: dict[str, Any] = errors[0]
    # Union members show up in loc as "str" or "list[int]": keep field names and list indices.
    param = ""
    for part in first.get("loc", ()):
        if isinstance(part, int):
            param += f"[{part}]"
        elif part != "body" and not any(c in part for c in "[]-") and part not in ("str", "int", "float", "bool"):
            param += f".{part}" if param else part
    param = param or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "the body is not valid JSON", None
    message = first.get("msg", "invalid value")
    if param:
        message = f"{param}: {message}"
    return message, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param=param, code="invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        import logging

        logging.getLogger("radixserve").exception("unexpected error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", code="internal_error")
