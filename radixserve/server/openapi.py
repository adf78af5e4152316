"""The served OpenAPI schema: FastAPI's, plus every answer the server can really give.

FastAPI declares a 422 the server never sends (validation errors are 400 here) and knows nothing
of event streams, Prometheus text, 401/413/415/503 or the error body; this module declares them,
bounds token ids by the served model's vocabulary once the engine has reported it, and names the
chat template variables a request may set.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from radixserve.http_common.openapi_schemas import ERROR_SCHEMA, EVENT_STREAM
from radixserve.server.protocol import (OUTPUT_TOKENS_SCHEMA_MARK, TEMPLATE_VARIABLES_SCHEMA_MARK,
                                       TOKEN_ID_KEYS_SCHEMA_MARK, TOKEN_ID_SCHEMA_MARK)

ERROR_DESCRIPTIONS = {"400": "Invalid request (OpenAI error body).", "401": "Missing or invalid API key.",
                      "404": "Unknown model or resource.", "405": "Method not allowed.",
                      "409": "Conflict with the server's state.", "413": "Request body too large.",
                      "415": "The body is not sent as application/json.",
                      "500": "Internal error.", "503": "Engine unavailable or queue full (Retry-After)."}
# Errors every operation can answer with; POST bodies add 400, 413 and 415.
COMMON_ERRORS = ("404", "405", "500", "503")
BODY_ERRORS = ("400", "413", "415")
STREAMING_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
EXTRA_ERRORS = {"/flush_cache": ("409",)}


def _error_response(status: str) -> dict[str, Any]:
    return {"description": ERROR_DESCRIPTIONS[status],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def _document_operation(path: str, method: str, op: dict[str, Any], auth: bool) -> None:
    responses = op.setdefault("responses", {})
    responses.pop("422", None)
    statuses = list(COMMON_ERRORS) + list(EXTRA_ERRORS.get(path, ()))
    if method == "post":
        statuses += BODY_ERRORS
    if auth and path != "/health":
        statuses.append("401")
        op["security"] = [{"bearer": []}]
    for status in statuses:
        responses.setdefault(status, _error_response(status))
    ok = responses.setdefault("200", {"description": "OK"})
    if path in STREAMING_PATHS:
        ok.setdefault("content", {}).update(EVENT_STREAM)
    elif path == "/kv_events":
        ok["content"] = dict(EVENT_STREAM)
    elif path == "/metrics":
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}


def _bound_by_model(node: Any, vocab_size: int, max_output_tokens: int,
                    template_variables: frozenset[str] = frozenset()) -> None:
    """Write the served model's bounds where the schema marks them: token ids by the vocabulary,
    output lengths by what the context leaves a one-token prompt (a larger max_tokens is a 400),
    chat_template_kwargs' names by what the served template reads."""
    if isinstance(node, dict):
        if node.pop(TEMPLATE_VARIABLES_SCHEMA_MARK, False):
            node["propertyNames"] = {"enum": sorted(template_variables)}
        if node.pop(TOKEN_ID_SCHEMA_MARK, False):
            node["maximum"] = vocab_size - 1
        if node.pop(TOKEN_ID_KEYS_SCHEMA_MARK, False):
            node["propertyNames"] = {"pattern": decimal_at_most_pattern(vocab_size - 1)}
        if node.pop(OUTPUT_TOKENS_SCHEMA_MARK, False):
            node["maximum"] = max_output_tokens
        for value in node.values():
            _bound_by_model(value, vocab_size, max_output_tokens, template_variables)
    elif isinstance(node, list):
        for value in node:
            _bound_by_model(value, vocab_size, max_output_tokens, template_variables)


def decimal_at_most_pattern(n: int) -> str:
    """A regular expression matching exactly the decimal spellings (no leading zeros) of 0..n."""
    digits = str(n)
    width = len(digits)
    if width == 1:
        return f"^[0-{digits}]$"
    alternatives = ["[0-9]" if width == 2 else f"0|[1-9][0-9]{{0,{width - 2}}}"]
    for i, ch in enumerate(digits):
        low, high = (1 if i == 0 else 0), int(ch) - 1
        if high >= low:
            rest = width - i - 1
            alternatives.append(digits[:i] + f"[{low}-{high}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    alternatives.append(digits)
    return "^(" + "|".join(alternatives) + ")$"


def install_openapi(app: FastAPI, auth: bool, vocab_size: Callable[[], Optional[int]],
                    max_output_tokens: Callable[[], Optional[int]] = lambda: None,
                    template_variables: Callable[[], frozenset[str]] = frozenset) -> None:
    """Serve the completed schema; cached once the engine has told the vocabulary size and the
    context (max_output_tokens: the longest output a one-token prompt leaves room for);
    template_variables: the chat template's variables a request may set."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        schema.setdefault("components", {}).setdefault("schemas", {})["ErrorResponse"] = ERROR_SCHEMA
        schema["components"]["schemas"].pop("HTTPValidationError", None)
        schema["components"]["schemas"].pop("ValidationError", None)
        if auth:
            schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, ops in schema.get("paths", {}).items():
            for method, op in ops.items():
                _document_operation(path, method, op, auth)
        vocab, longest = vocab_size(), max_output_tokens()
        if vocab is not None and longest is not None:
            _bound_by_model(schema, vocab, longest, template_variables())
            app.openapi_schema = schema
        return schema

    app.openapi = openapi
