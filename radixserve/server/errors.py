"""The server's errors: the OpenAI-style error shape shared with the router
(`radixserve.http_common.errors`) and the engine's failures mapped to HTTP statuses."""

from __future__ import annotations

from radixserve.http_common.errors import APIError, bad_request, error_body, error_response  # noqa: F401
from radixserve.server.engine_client import EngineDeadError, EngineRequestError, QueueFullError, ShuttingDownError

RETRY_AFTER_S = 1
# The code of a 400 for fields that are each valid but contradict each other (the OpenAPI schema
# bounds each field, not their relations).
CONFLICTING_FIELDS = "conflicting_fields"


def engine_unavailable(message: str) -> APIError:
    return APIError(503, f"the engine is unavailable: {message}", code="engine_unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def shutting_down(message: str) -> APIError:
    return APIError(503, message, code="server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})


def map_engine_error(exc: BaseException) -> APIError:
    if isinstance(exc, ShuttingDownError):
        return shutting_down(str(exc))
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineDeadError):
        return engine_unavailable(str(exc))
    if isinstance(exc, EngineRequestError):
        return bad_request(str(exc))
    raise exc
