"""What load balancers and scrapers read: `/health` (open even with `--api-key`: it reveals
nothing but whether the engine runs), `/health_generate` and `/metrics` (Prometheus).

`/health` is answered in the API process from the engine's heartbeats (`radixserve.server.liveness`),
without a round trip through the engine: 200 while the engine process beats and its loop finishes
its steps, however busy (a load balancer that restarted a busy server would drop everything it
serves); 503 when the engine process is gone, stopped, or wedged in one step for
--health-stall-timeout-s, and while the server shuts down. `/health_generate` (SGLang's) is the
deeper check: 200 when a one-token request generates within HEALTH_TIMEOUT_S, so on a busy engine
it waits its turn behind the running requests' steps."""

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
    if engine.draining is not None:
        return error_response(503, f"the engine is unavailable: {engine.draining}", code="engine_unavailable")
    state = engine.liveness(ctx.settings.health_stall_timeout_s)
    if not state.ok:
        return error_response(503, f"the engine is unavailable: {state.reason}", code="engine_unavailable")
    return {"status": "ok", "busy": state.busy, "step_seconds": round(state.loop_s, 3),
            "engine_steps": state.steps}


@router.get("/health_generate")
async def health_generate(ctx: Ctx):
    try:
        seconds = await ctx.health.check()
    except asyncio.TimeoutError:
        return error_response(503, f"the engine did not generate a token within {HEALTH_TIMEOUT_S:.0f} s",
                              code="engine_unavailable")
    except (EngineDeadError, EngineRequestError, QueueFullError) as e:
        return error_response(503, f"the engine is unavailable: {e}", code="engine_unavailable")
    return {"status": "ok", "probe_seconds": round(seconds, 4)}


@router.get("/metrics")
async def prometheus_metrics(ctx: Ctx):
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)
