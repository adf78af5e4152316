"""Operator endpoints: `/server_info`, `/flush_cache`, and `/kv_events` (the radix cache's event
stream that `kv_aware` routers mirror)."""

from __future__ import annotations

import asyncio
import os

from fastapi import APIRouter, FastAPI, Request

from radixserve.server.engine_client import EngineDeadError
from radixserve.server.errors import APIError, map_engine_error
from radixserve.server.kv_events import KvEventHub, install_kv_events
from radixserve.server.serving import Ctx, ServingContext

router = APIRouter()


@router.get("/server_info")
async def server_info(request: Request, ctx: Ctx):
    engine = ctx.engine
    info = ctx.settings.to_dict()
    for secret in ("api_key", "admin_api_key"):
        if info.get(secret):
            info[secret] = "***"
    stats = None
    if engine.alive:
        try:
            stats = await engine.get_stats()
        except (EngineDeadError, asyncio.TimeoutError):
            stats = None
    if stats is None and engine.latest_stats is not None:
        stats = engine.latest_stats.values
    ready = engine.ready
    # How many keys and whether their caches are apart: never a key, nor the other tenants' names.
    return {"settings": info, "api_key_count": len(ctx.api_keys), "cache_per_api_key": ctx.isolate_keys,
            "model_path": ctx.model_path, "served_model_name": ctx.served_model_name,
            "engine_alive": engine.alive, "engine_error": engine.dead_reason,
            "engine_pid": engine.engine_pid, "api_pid": os.getpid(),
            "pool_size": ready.pool_size if ready else None,
            "context_length": ready.context_len if ready else None,
            "max_running_requests": ready.max_running_requests if ready else None,
            "device": ready.device if ready else None, "dtype": ready.dtype if ready else None,
            "vocab_size": ready.vocab_size if ready else None,
            "memory": ready.memory if ready else None,
            "in_flight_requests": len(engine.groups), "ipc_dir": engine.ipc_dir, "stats": stats,
            "version": request.app.version}


@router.post("/flush_cache")
async def flush_cache(ctx: Ctx):
    try:
        reply = await ctx.engine.flush_cache()
    except (EngineDeadError, asyncio.TimeoutError) as e:
        raise map_engine_error(e if isinstance(e, EngineDeadError) else EngineDeadError("no reply")) from None
    if not reply.ok:
        raise APIError(409, f"cannot flush the cache: {reply.message}", code="requests_running")
    return {"status": "ok", "message": "the radix cache was flushed"}


def install_admin(app: FastAPI, ctx: ServingContext) -> KvEventHub:
    """Add the admin router and `/kv_events`; returns the event hub (shutdown closes its streams)."""
    app.include_router(router)
    return install_kv_events(app, ctx.engine)
