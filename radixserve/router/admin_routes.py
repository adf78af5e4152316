"""The router's worker management and cache flush: `GET /workers`, and the admin endpoints
`POST /workers {"url": ...}`, `DELETE /workers/{id}` and `POST /flush_cache`, which take the
router's `--admin-api-key` and are off without one (access.py)."""

from __future__ import annotations

import json
from typing import Any, Optional, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from radixserve.http_common.errors import error_response
from radixserve.router.access import admin_refusal
from radixserve.router.workers import Worker, WorkerRegistry


class ManagedRouter(Protocol):
    """What these routes need from the router (app.Router implements it)."""

    registry: WorkerRegistry
    tokenizer_state: str

    @property
    def policy_name(self) -> str: ...

    @property
    def admin_api_key(self) -> Optional[str]: ...

    def add_worker(self, url: object) -> Worker: ...

    def remove_worker(self, worker_id: str) -> Worker: ...

    async def flush_workers(self) -> tuple[dict[str, object], bool]: ...


def add_admin_routes(app: FastAPI, router: ManagedRouter) -> None:
    def refusal(request: Request, endpoint: str) -> Optional[JSONResponse]:
        # Checked here as well as by the middleware's table, so no path spelling skips it.
        return admin_refusal(request.scope["headers"], router.admin_api_key, endpoint)

    @app.get("/workers")
    async def list_workers():
        return {"policy": router.policy_name, "tokenizer": router.tokenizer_state,
                "workers": [w.describe() for w in router.registry]}

    @app.post("/workers", status_code=201)
    async def add_worker(request: Request):
        if (denied := refusal(request, "POST /workers")) is not None:
            return denied
        raw = await request.body()
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            return error_response(400, "the body is not valid JSON", code="invalid_request")
        if not isinstance(body, dict) or "url" not in body:
            return error_response(400, 'the body must be a JSON object like {"url": "http://host:port"}',
                                  param="url", code="invalid_request")
        try:
            worker = router.add_worker(body["url"])
        except ValueError as e:
            return error_response(400, str(e), param="url", code="invalid_value")
        except KeyError:
            return error_response(409, f"a worker at {body['url']!r} is already registered", param="url",
                                  code="worker_exists")
        return JSONResponse(worker.describe(), status_code=201)

    @app.delete("/workers/{worker_id}")
    async def delete_worker(worker_id: str, request: Request):
        if (denied := refusal(request, "DELETE /workers/{id}")) is not None:
            return denied
        try:
            worker = router.remove_worker(worker_id)
        except KeyError:
            known = ", ".join(router.registry.workers) or "none"
            return error_response(404, f"unknown worker {worker_id!r} (registered: {known})",
                                  param="worker_id", code="worker_not_found")
        return {"id": worker.id, "url": worker.url, "removed": True, "in_flight": worker.load}

    @app.post("/flush_cache")
    async def flush_cache(request: Request):
        if (denied := refusal(request, "POST /flush_cache")) is not None:
            return denied
        results, ok = await router.flush_workers()
        return JSONResponse({"status": "ok" if ok else "partial", "workers": results},
                            status_code=200 if ok else 409)
