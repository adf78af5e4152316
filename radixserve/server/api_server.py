"""The API process: the FastAPI app assembled from its routers, and the uvicorn runner.

Endpoints, by router (`radixserve.server.routes`): OpenAI (`/v1/completions`,
`/v1/chat/completions`, `/v1/models`), SGLang-native (`/generate`, `/get_model_info`, `/tokenizer`
with the files `radixserve.client.AsyncClient.tokenizer` needs), tokenizer (`/v1/tokenize`,
`/v1/detokenize` and SGLang's `/tokenize`, `/detokenize`), admin (`/server_info`,
`/flush_cache`, `/kv_events`) and observability (`/health`, `/health_generate`, `/metrics`). They
share one `ServingContext`. With `--api-key` (or `--api-key-file`), every path but `/health` answers
401 without `Authorization: Bearer <key>` of one of the keys; `/health` stays open so load balancers
can probe it and reveals nothing but whether the engine runs. `/flush_cache` and `/kv_events` take `--admin-api-key`
when it is set. Shutdown and engine death: `radixserve.server.lifecycle`.
"""

from __future__ import annotations

import atexit
import logging
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI

from radixserve.http_common.auth import APIKeyMiddleware
from radixserve.server.engine_client import EngineClient
from radixserve.http_common.errors import install_error_handlers
from radixserve.process.gc_tuning import governed_collections
from radixserve.http_common.loop_lag import watch_loop_lag
from radixserve.http_common.open_files import connection_cap
from radixserve.http_common.paced_http import PacedHttpProtocol
from radixserve.server.lifecycle import CLOSE_TIMEOUT_S, ServingServer
from radixserve.server.intake import (REQUEST_BYTES_PER_CONTEXT_TOKEN, BodyLimitMiddleware, JSONContentTypeMiddleware,
                                      RejectionRecorder)
from radixserve.server.chat_prompt import check_template_keeps_reasoning, settable_template_variables
from radixserve.server.metrics import ServerMetrics
from radixserve.server.reasoning import reasoning_format
from radixserve.server.openapi import install_openapi
from radixserve.server.routes import native, observability, openai_api, tokenize
from radixserve.server.routes.admin import install_admin
from radixserve.server.serving import ServingContext
from radixserve.server.startup import default_served_model_name
from radixserve.settings import ServerSettings

logger = logging.getLogger("radixserve")

# Sizes the body limit until the engine reports its context length (Qwen2's).
FALLBACK_CONTEXT_LEN = 32768


def request_bytes_limit(settings: ServerSettings, engine: EngineClient) -> int:
    if settings.max_request_bytes is not None:
        return settings.max_request_bytes
    context = engine.ready.context_len if engine.ready else (settings.context_length or FALLBACK_CONTEXT_LEN)
    return REQUEST_BYTES_PER_CONTEXT_TOKEN * context


def create_app(settings: ServerSettings, model_path: str, tokenizer, engine: Optional[EngineClient] = None) -> FastAPI:
    engine = engine or EngineClient(settings)
    served_name = settings.served_model_name or default_served_model_name(model_path)
    metrics = ServerMetrics(lambda: engine.latest_stats, lambda: engine.alive, served_name, settings.page_size,
                            prefix_caching=lambda: engine.ready.prefix_caching if engine.ready
                            else not settings.disable_radix_cache)
    ctx = ServingContext(settings, tokenizer, engine, metrics, model_path, served_name)
    if settings.reasoning_parser is not None:  # a tokenizer without the format's tags fails here, in one line
        ctx.reasoning = reasoning_format(settings.reasoning_parser, tokenizer)
    if settings.keep_reasoning_history:
        check_template_keeps_reasoning(tokenizer)

    def count_abort(out) -> None:
        if out.finish_reason is not None and out.finish_reason.type == "abort" and not out.rid.startswith("health-"):
            metrics.requests.labels(finish_reason="abort").inc()

    engine.on_untracked_finish = count_abort

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()  # under run_server ServingServer started it first: ready at once
        try:
            async with governed_collections("api", lambda: not engine.groups), watch_loop_lag("api"):
                yield
        finally:
            await engine.stop()

    app = FastAPI(title="radixserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible and SGLang-native serving over a radix-tree KV cache.")
    # Middleware added later runs earlier: the recorder sees every answer, 401s and 413s included.
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, limit=lambda: request_bytes_limit(settings, engine))
    app.add_middleware(JSONContentTypeMiddleware)
    if ctx.api_keys or ctx.admin_api_key:
        app.add_middleware(APIKeyMiddleware, keys=ctx.api_keys, admin_api_key=ctx.admin_api_key)
    if ctx.api_keys or ctx.isolate_keys:  # names and counts only, never a key
        logger.info("API keys: %s", ctx.api_keys.describe(ctx.isolate_keys) if ctx.api_keys
                    else "none checked here; each bearer key sent gets its own prefix cache")
    app.add_middleware(RejectionRecorder, metrics=metrics, log=settings.log_requests)
    app.state.engine = engine
    app.state.ctx = ctx
    app.include_router(native.router)
    app.include_router(openai_api.router)
    app.include_router(tokenize.router)
    app.include_router(observability.router)
    app.state.kv_events = install_admin(app, ctx)
    install_openapi(app, auth=bool(ctx.api_keys),
                    vocab_size=lambda: engine.ready.vocab_size if engine.ready else None,
                    max_output_tokens=lambda: (min(engine.ready.context_len, engine.ready.pool_size) - 1
                                               if engine.ready else None),
                    template_variables=lambda: settable_template_variables(tokenizer))
    return app


def run_server(settings: ServerSettings) -> int:
    """Build the tokenizer, start uvicorn (which starts the engine process); returns an exit code."""
    import uvicorn

    from radixserve.default_model import ensure_model_path
    from radixserve.process.tokenizer import load_tokenizer

    model_path = ensure_model_path(settings.model_path)
    engine = EngineClient(settings.__class__(**{**settings.to_dict(), "model_path": model_path}))
    atexit.register(engine.close_sockets)
    atexit.register(engine.kill_now)  # atexit runs last-registered first
    engine.spawn()  # the engine loads the model while this process loads the tokenizer
    tokenizer = load_tokenizer(settings.tokenizer_path or model_path)
    if settings.chat_template:
        from radixserve.server.tool_calls import load_chat_template

        load_chat_template(tokenizer, settings.chat_template)
    app = create_app(settings, model_path, tokenizer, engine)
    import importlib.util

    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    config = uvicorn.Config(app, host=settings.host, port=settings.port, loop=loop, http=PacedHttpProtocol,
                            log_level="warning", access_log=False, timeout_graceful_shutdown=CLOSE_TIMEOUT_S,
                            lifespan="on", limit_concurrency=connection_cap(settings.max_connections))
    # Open /kv_events streams never end by themselves; they are closed when the drain ends.
    server = ServingServer(config, engine, settings.graceful_shutdown_timeout,
                           announce=f"serving {model_path} on http://{settings.host}:{settings.port}",
                           on_drain_end=app.state.kv_events.close_all)
    server.run()
    engine.kill_now()
    engine.close_sockets()
    if not server.started:
        return 1
    if server.exit_code == 0:
        logger.info("%s", server.shutdown_line())
    return server.exit_code
