"""What load balancers and scrapers read: `/health` (open even with `--api-key`: it reveals
nothing but whether the engine generates) and `/metrics` (Prometheus).

`/health` is 200 when a one-token probe request generates within HEALTH_TIMEOUT_S, or, when it does
not, while the engine still reports finished steps (busy, not stuck); 503 when the engine is gone
or finished no step in that time."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from radixserve.server.engine_client import EngineDeadError, EngineRequestError, QueueFullError
from radixserve.server.errors import error_response
from radixserve.server.serving import HEALTH_TIMEOUT_S, Ctx

router = APIRouter()


@router.get("/health")
async def health_check(ctx: Ctx):
    engine = ctx.engine
    if not engine.alive:
        return error_response(503, f"the engine is unavailable: {engine.dead_reason or 'not started'}",
                              code="engine_unavailable")
    try:
        seconds = await ctx.health.check()
    except asyncio.TimeoutError:
        if engine.progressed_within(HEALTH_TIMEOUT_S):
            # Busy, not stuck: the probe waits behind long steps, but steps finish. A liveness probe
            # that restarted a busy server would drop everything it was serving.
            return {"status": "ok", "busy": True, "probe_seconds": None}
        return error_response(503, f"the engine did not generate a token within {HEALTH_TIMEOUT_S:.0f} s "
                              "and finished no step in that time", code="engine_unavailable")
    except (EngineDeadError, EngineRequestError, QueueFullError) as e:
        return error_response(503, f"the engine is unavailable: {e}", code="engine_unavailable")
    return {"status": "ok", "probe_seconds": round(seconds, 4)}


@router.get("/metrics")
async def prometheus_metrics(ctx: Ctx):
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)
