"""The router's OpenAPI schema: each endpoint with the answers the router can really give.

The router does not parse what it forwards (the worker validates it), so the bodies of the
generation and tokenizing endpoints are free JSON objects here; their 4xx come from the worker.
Its own 5xx is one: 503 when no worker could serve (none healthy, or each one tried failed before
anything was sent); a worker's 5xx is retried elsewhere, never passed on. Admin endpoints take
the router's own admin key (`adminBearer`), the rest the API key (`bearer`), as access.py says.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from radixserve.router.access import endpoint_class
from radixserve.http_common.openapi_schemas import ERROR_SCHEMA, EVENT_STREAM

FREE_OBJECT: dict[str, Any] = {"type": "object", "additionalProperties": True}
ANY_JSON: dict[str, Any] = {}
ERROR_DESCRIPTIONS = {
    "400": "Invalid request (the worker's or the router's OpenAI error body).",
    "401": "Missing or invalid key.", "403": "Admin endpoints are off (no --admin-api-key).",
    "404": "Unknown model, worker or resource.", "405": "Method not allowed.",
    "409": "Conflict with the router's or a worker's state.", "413": "Request body too large (worker).",
    "415": "The body is not sent as application/json (worker).",
    "503": "No worker could serve (none healthy, or each one tried failed); Retry-After."}
# What a forwarded answer can be: the worker's 4xx pass through unchanged.
FORWARDED_ERRORS = ("400", "401", "404", "405", "409", "413", "415", "503")
# Answered by a worker the router picks (GET): 503 when none is healthy.
WORKER_GET_ERRORS = ("401", "404", "405", "503")
ROUTER_ERRORS = {
    ("get", "/health"): ("405", "503"),
    ("get", "/workers"): ("401", "405"),
    ("get", "/metrics"): ("401", "405"),
    ("post", "/workers"): ("400", "401", "403", "405", "409"),
    ("delete", "/workers/{worker_id}"): ("401", "403", "404", "405"),
    ("post", "/flush_cache"): ("401", "403", "405", "409"),
}
STREAMING_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
ADD_WORKER_BODY = {"type": "object", "required": ["url"], "properties": {"url": {"type": "string"}},
                   "additionalProperties": True}


def _error_response(status: str) -> dict[str, Any]:
    return {"description": ERROR_DESCRIPTIONS[status],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def _document_operation(path: str, method: str, op: dict[str, Any], auth: bool) -> None:
    responses = op.setdefault("responses", {})
    responses.pop("422", None)  # validation errors are never 422 here
    kind = endpoint_class(method.upper(), path.replace("{worker_id}", "x"))
    if method == "post" and path not in ("/flush_cache",):
        body = ADD_WORKER_BODY if path == "/workers" else FREE_OBJECT
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if (method, path) in ROUTER_ERRORS:
        statuses = ROUTER_ERRORS[(method, path)]
    elif method == "post":
        statuses = FORWARDED_ERRORS
    else:
        statuses = WORKER_GET_ERRORS
    if kind == "admin":
        op["security"] = [{"adminBearer": []}]
    elif auth and kind != "open":
        op["security"] = [{"bearer": []}]
    for status in statuses:
        responses.setdefault(status, _error_response(status))
    ok = next((responses[s] for s in ("200", "201") if s in responses), None)
    if ok is None:
        return
    if path in STREAMING_PATHS:
        ok["content"] = {"application/json": {"schema": ANY_JSON}, **EVENT_STREAM}
    elif path == "/metrics":
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    else:  # the router's own JSON, or a worker's answer passed through
        ok["content"] = {"application/json": {"schema": ANY_JSON}}


def install_router_openapi(app: FastAPI, auth: bool) -> None:
    """Serve the completed schema at /openapi.json (auth: whether --api-key is set)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        schemas["ErrorResponse"] = ERROR_SCHEMA
        components["securitySchemes"] = {"adminBearer": {"type": "http", "scheme": "bearer",
                                                         "description": "the router's --admin-api-key"}}
        if auth:
            components["securitySchemes"]["bearer"] = {"type": "http", "scheme": "bearer",
                                                       "description": "an --api-key"}
        for path, ops in schema.get("paths", {}).items():
            for method, op in ops.items():
                _document_operation(path, method, op, auth)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
