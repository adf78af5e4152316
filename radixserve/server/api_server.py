"""The API process: FastAPI app, endpoints, and the uvicorn runner.

Endpoints: `/generate` (SGLang-native), `/v1/completions`, `/v1/chat/completions`, `/v1/models`,
`/health`, `/server_info`, `/flush_cache`, `/metrics`, `/tokenizer` (files for
`radixserve.client.AsyncClient.tokenizer`). With `--api-key`, every path but `/health` answers
401 without `Authorization: Bearer <key>`; `/health` stays open so load balancers can probe it and
reveals nothing but whether the engine generates.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import logging
import os
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from radixserve.engine.io_struct import SamplingParams
from radixserve.server.engine_client import EngineClient, EngineDeadError, EngineRequestError, QueueFullError
from radixserve.server.errors import APIError, bad_request, error_body, error_response, install_error_handlers
from radixserve.server.auth import APIKeyMiddleware
from radixserve.server.gc_tuning import governed_collections
from radixserve.server.loop_lag import watch_loop_lag
from radixserve.server.kv_events import install_kv_events
from radixserve.server.metrics import ServerMetrics
from radixserve.server.protocol import ROLES, ChatCompletionRequest, CompletionRequest, GenerateBody
from radixserve.server.startup import default_served_model_name
from radixserve.server.serving import (SSE_DONE, ServingContext, Tracker, finish_reason_name, first_then_rest,
                                       map_engine_error, new_id, sse)
from radixserve.settings import ServerSettings

logger = logging.getLogger("radixserve")

HEALTH_TIMEOUT_S = 20.0
# SIGTERM: in-flight requests get this long to finish before they are cut.
DRAIN_TIMEOUT_S = 30.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "chat_template.jinja", "chat_template.json", "added_tokens.json",
                   "tokenizer.model", "generation_config.json",
                   # AutoTokenizer picks the tokenizer class (and its pre-tokenizer) from config.json's
                   # model_type; without it a client would tokenize differently from the server.
                   "config.json")
ENGINE_ERRORS = (QueueFullError, EngineDeadError, EngineRequestError)


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that runs `on_close` however it ends (done, error, disconnect)."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()




def _usage(trackers: list[Tracker]) -> dict[str, Any]:
    # The prompt is counted once per prompt however many choices (`n`) it has, as OpenAI does.
    firsts: dict[int, Tracker] = {}
    for t in trackers:
        firsts.setdefault(t.prompt_index, t)
    prompt = sum(t.prompt_tokens or len(t.input_ids) for t in firsts.values())
    cached = sum(t.cached_tokens for t in firsts.values())
    completion = sum(t.completion_tokens for t in trackers)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _meta_info(t: Tracker) -> dict[str, Any]:
    return {"id": t.rid, "finish_reason": t.finish_reason, "prompt_tokens": t.prompt_tokens or len(t.input_ids),
            "completion_tokens": t.completion_tokens, "cached_tokens": t.cached_tokens,
            "e2e_latency": t.e2e_latency}


def _check_neutral(body, name: str, ok: Callable[[Any], bool], why: str) -> None:
    value = getattr(body, name, None)
    if value is not None and not ok(value):
        raise APIError(400, f"{name}={value!r} is not supported: {why}", param=name, code="unsupported_parameter")


def _check_common_unsupported(body) -> None:
    _check_neutral(body, "presence_penalty", lambda v: v == 0, "only 0")
    _check_neutral(body, "frequency_penalty", lambda v: v == 0, "only 0")
    _check_neutral(body, "logit_bias", lambda v: not v, "only an empty map")


class HealthChecker:
    """Probes run one at a time; concurrent /health calls share the probe in flight."""

    def __init__(self, engine: EngineClient, probe_ids: list[int]):
        self.engine = engine
        self.probe_ids = probe_ids
        self._inflight: Optional[asyncio.Future] = None

    async def check(self) -> float:
        if self._inflight is None or self._inflight.done():
            self._inflight = asyncio.ensure_future(self.engine.probe(self.probe_ids, HEALTH_TIMEOUT_S))
        return await asyncio.shield(self._inflight)


def create_app(settings: ServerSettings, model_path: str, tokenizer, engine: Optional[EngineClient] = None) -> FastAPI:
    engine = engine or EngineClient(settings)
    metrics = ServerMetrics(lambda: engine.latest_stats, lambda: engine.alive)
    served_name = settings.served_model_name or default_served_model_name(model_path)
    ctx = ServingContext(settings, tokenizer, engine, metrics, model_path, served_name)
    health = HealthChecker(engine, [0])

    def count_abort(out) -> None:
        if (out.finish_reason or {}).get("type") == "abort" and not out.rid.startswith("health-"):
            metrics.requests.labels(finish_reason="abort").inc()

    engine.on_untracked_finish = count_abort
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        try:
            async with governed_collections("api", lambda: not engine.groups), watch_loop_lag("api"):
                yield
        finally:
            await engine.stop()

    app = FastAPI(title="radixserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible and SGLang-native serving over a radix-tree KV cache.")
    install_error_handlers(app)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    app.state.engine = engine
    app.state.ctx = ctx

    # ------------------------------------------------------------------ shared running logic
    async def run(request: Request, trackers: list[Tracker], stream: bool,
                  render_final: Callable[[list[Tracker]], Any],
                  render_stream: Callable[[AsyncIterator, Callable[[], None]], AsyncIterator[str]]):
        group = ctx.submit(trackers)
        closed = False

        def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                group.close()
                ctx.done(trackers)

        by_rid = {t.rid: t for t in trackers}
        group.watch_disconnect(request.receive)
        outputs = group.outputs()
        try:
            if not stream:
                async for out in outputs:
                    ctx.on_output(by_rid[out.rid], out)
                if not all(t.finished for t in trackers):  # the client went away
                    return Response(status_code=499)
                return JSONResponse(render_final(trackers))
            first, rest = await first_then_rest(outputs)
            group.stop_watching()  # from here the streaming response watches the client
        except ENGINE_ERRORS as e:
            close()
            err = map_engine_error(e)
            metrics.rejected.labels(status=str(err.status)).inc()
            raise err from None
        except BaseException:
            close()
            raise
        finally:
            if not stream:
                close()
        if first is None:
            close()
            return Response(status_code=499)

        async def guarded() -> AsyncIterator[str]:
            try:
                async for chunk in render_stream(rest, close):
                    yield chunk
            except ENGINE_ERRORS as e:  # after the headers went out: an error event, then the end
                err = map_engine_error(e)
                yield sse(error_body(err.status, err.message, err.param, err.code))
                yield SSE_DONE

        return ClosingStreamingResponse(guarded(), on_close=close)

    def per_output(outputs: AsyncIterator, by_rid: dict[str, Tracker]):
        async def gen():
            async for out in outputs:
                t = by_rid[out.rid]
                yield t, out, ctx.on_output(t, out)
        return gen()

    # ------------------------------------------------------------------ /generate
    @app.post("/generate")
    async def generate(body: GenerateBody, request: Request):
        arrival = time.perf_counter()
        if (body.text is None) == (body.input_ids is None):
            raise bad_request("give exactly one of text or input_ids", "text")
        if body.text is not None:
            single = isinstance(body.text, str)
            texts = [body.text] if single else list(body.text)
            prompts = [ctx.tokenize(x, "text") for x in texts]
            param = "text"
        else:
            ids = body.input_ids
            single = not ids or isinstance(ids[0], int)
            prompts = [list(ids)] if single else [list(x) for x in ids]
            param = "input_ids"
        if not prompts:
            raise bad_request("the batch is empty", param)
        if body.stream and not single:
            raise bad_request("stream=true takes a single prompt", "stream")
        sp = body.sampling_params
        if isinstance(sp, list):
            if len(sp) != len(prompts):
                raise bad_request(f"{len(sp)} sampling_params for {len(prompts)} prompts", "sampling_params")
            sp_list = sp
        else:
            sp_list = [sp or {}] * len(prompts)
        params_per_prompt: list[list[SamplingParams]] = []
        for ids, values in zip(prompts, sp_list):
            ctx.check_prompt(ids, param)
            params = ctx.sampling_params(values)
            ctx.max_new_tokens(ids, params.max_new_tokens, "sampling_params.max_new_tokens")
            params_per_prompt.append([params])
        base = body.rid if (body.rid and single) else new_id("")
        trackers = ctx.new_trackers(prompts, params_per_prompt, base, arrival)

        def final(ts: list[Tracker]):
            results = [{"text": t.text, "output_ids": t.output_ids, "meta_info": _meta_info(t)} for t in ts]
            return results[0] if single else results

        async def stream(outputs, close):
            by_rid = {t.rid: t for t in trackers}
            async for t, out, delta in per_output(outputs, by_rid):
                yield sse({"text": t.text, "output_ids": t.output_ids, "meta_info": _meta_info(t)})
            close()
            yield SSE_DONE

        return await run(request, trackers, body.stream, final, stream)

    # ------------------------------------------------------------------ /v1/completions
    def openai_params(body, max_tokens: int, seed_offset: int) -> dict[str, Any]:
        values: dict[str, Any] = {"max_new_tokens": max_tokens,
                                  "temperature": 1.0 if body.temperature is None else body.temperature,
                                  "ignore_eos": body.ignore_eos, "skip_special_tokens": body.skip_special_tokens}
        for name in ("top_p", "top_k", "min_p", "stop_token_ids"):
            if getattr(body, name) is not None:
                values[name] = getattr(body, name)
        if body.stop is not None:
            values["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
        if body.seed is not None:
            # Each of the n choices gets its own stream of random numbers, reproducibly.
            values["seed"] = body.seed + seed_offset if body.seed + seed_offset < 2**63 else body.seed - seed_offset
        return values

    def build_choices(body, prompts: list[list[int]], param: str, max_tokens: Optional[int],
                      max_param: str) -> list[list[SamplingParams]]:
        out = []
        for ids in prompts:
            ctx.check_prompt(ids, param)
            mnt = ctx.max_new_tokens(ids, max_tokens, max_param)
            out.append([ctx.sampling_params(openai_params(body, mnt, j), "") for j in range(body.n)])
        return out

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        arrival = time.perf_counter()
        ctx.check_model(body.model)
        _check_common_unsupported(body)
        _check_neutral(body, "logprobs", lambda v: False, "log probabilities are not implemented")
        _check_neutral(body, "suffix", lambda v: False, "insertion is not implemented")
        _check_neutral(body, "best_of", lambda v: v == body.n, "only best_of == n")
        p = body.prompt
        if isinstance(p, str):
            texts: list[Optional[str]] = [p]
            prompts = [ctx.tokenize(p, "prompt")]
        elif not p:
            raise bad_request("the prompt is empty", "prompt")
        elif isinstance(p[0], str):
            texts = list(p)
            prompts = [ctx.tokenize(x, "prompt") for x in p]
        elif isinstance(p[0], int):
            texts, prompts = [None], [list(p)]
        else:
            texts, prompts = [None] * len(p), [list(x) for x in p]
        choices = build_choices(body, prompts, "prompt", body.max_tokens, "max_tokens")
        cid = new_id("cmpl-")
        trackers = ctx.new_trackers(prompts, choices, cid, arrival)
        model = ctx.served_model_name

        def echo_text(t: Tracker) -> str:
            if not body.echo:
                return ""
            text = texts[t.prompt_index]
            if text is None and ctx.tokenizer is not None:
                text = ctx.tokenizer.decode(t.input_ids)
            return text or ""

        def final(ts: list[Tracker]):
            return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
                    "choices": [{"index": t.index, "text": echo_text(t) + t.text, "logprobs": None,
                                 "finish_reason": finish_reason_name(t.finish_reason)} for t in ts],
                    "usage": _usage(ts)}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choices_: list[dict]) -> str:
            data = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
                    "choices": choices_}
            if include_usage:
                data["usage"] = None
            return sse(data)

        async def stream(outputs, close):
            by_rid = {t.rid: t for t in trackers}
            echoed: set[str] = set()
            async for t, out, delta in per_output(outputs, by_rid):
                if t.rid not in echoed:
                    echoed.add(t.rid)
                    delta = echo_text(t) + delta
                if delta or t.finished:
                    yield chunk([{"index": t.index, "text": delta, "logprobs": None,
                                  "finish_reason": finish_reason_name(t.finish_reason)}])
            close()
            if include_usage:
                yield sse({"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
                           "choices": [], "usage": _usage(trackers)})
            yield SSE_DONE

        return await run(request, trackers, body.stream, final, stream)

    # ------------------------------------------------------------------ /v1/chat/completions
    def chat_prompt(body: ChatCompletionRequest) -> list[int]:
        messages = []
        for i, msg in enumerate(body.messages):
            if msg.role not in ROLES:
                raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {msg.role!r}",
                                  f"messages[{i}].role")
            content = msg.content
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise APIError(400, f"messages[{i}].content[{j}]: only text parts are supported, got "
                                            f"{part.type!r}", param=f"messages[{i}].content",
                                       code="unsupported_parameter")
                    parts.append(part.text)
                content = "\n".join(parts)
            messages.append({"role": msg.role, "content": content or ""})
        tok = ctx.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise bad_request("the served model has no chat template; use /v1/completions", "messages")
        try:
            text = tok.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=body.add_generation_prompt)
        except Exception as e:  # a template that rejects this conversation (raise_exception, ...)
            raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None
        return ctx.tokenize(text, "messages")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        arrival = time.perf_counter()
        ctx.check_model(body.model)
        _check_common_unsupported(body)
        _check_neutral(body, "logprobs", lambda v: v is False, "log probabilities are not implemented")
        _check_neutral(body, "top_logprobs", lambda v: False, "log probabilities are not implemented")
        _check_neutral(body, "tools", lambda v: not v, "tool calls are not implemented")
        _check_neutral(body, "tool_choice", lambda v: v == "none", "tool calls are not implemented")
        if body.response_format is not None and body.response_format.type != "text":
            raise APIError(400, f"response_format type {body.response_format.type!r} is not supported",
                           param="response_format", code="unsupported_parameter")
        if body.max_tokens is not None and body.max_completion_tokens is not None \
                and body.max_tokens != body.max_completion_tokens:
            raise bad_request("max_tokens and max_completion_tokens disagree", "max_completion_tokens")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        ids = chat_prompt(body)
        choices = build_choices(body, [ids], "messages", max_tokens,
                                "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
        cid = new_id("chatcmpl-")
        trackers = ctx.new_trackers([ids], choices, cid, arrival)
        model = ctx.served_model_name

        def final(ts: list[Tracker]):
            return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
                    "choices": [{"index": t.index, "message": {"role": "assistant", "content": t.text},
                                 "logprobs": None, "finish_reason": finish_reason_name(t.finish_reason)}
                                for t in ts],
                    "usage": _usage(ts)}

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(index: int, delta: dict, finish: Optional[str]) -> str:
            data = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                    "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}
            if include_usage:
                data["usage"] = None
            return sse(data)

        async def stream(outputs, close):
            by_rid = {t.rid: t for t in trackers}
            for t in trackers:
                yield chunk(t.index, {"role": "assistant", "content": ""}, None)
            async for t, out, delta in per_output(outputs, by_rid):
                if delta:
                    yield chunk(t.index, {"content": delta}, None)
                if t.finished:
                    yield chunk(t.index, {}, finish_reason_name(t.finish_reason))
            close()
            if include_usage:
                yield sse({"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                           "model": model, "choices": [], "usage": _usage(trackers)})
            yield SSE_DONE

        return await run(request, trackers, body.stream, final, stream)

    # ------------------------------------------------------------------ info and control
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model", "created": created,
                                            "owned_by": "radixserve", "root": model_path,
                                            "max_model_len": engine.ready.context_len if engine.ready else None}]}

    @app.get("/health")
    async def health_check():
        if not engine.alive:
            return error_response(503, f"the engine is unavailable: {engine.dead_reason or 'not started'}",
                                  code="engine_unavailable")
        try:
            seconds = await health.check()
        except asyncio.TimeoutError:
            return error_response(503, f"the engine did not generate a token within {HEALTH_TIMEOUT_S:.0f} s",
                                  code="engine_unavailable")
        except (EngineDeadError, EngineRequestError, QueueFullError) as e:
            return error_response(503, f"the engine is unavailable: {e}", code="engine_unavailable")
        return {"status": "ok", "probe_seconds": round(seconds, 4)}

    @app.get("/server_info")
    async def server_info():
        info = settings.to_dict()
        if info.get("api_key"):
            info["api_key"] = "***"
        stats = None
        if engine.alive:
            try:
                stats = await engine.get_stats()
            except (EngineDeadError, asyncio.TimeoutError):
                stats = None
        if stats is None and engine.latest_stats is not None:
            stats = engine.latest_stats.values
        ready = engine.ready
        return {"settings": info, "model_path": model_path, "served_model_name": served_name,
                "engine_alive": engine.alive, "engine_error": engine.dead_reason,
                "engine_pid": engine.engine_pid, "api_pid": os.getpid(),
                "pool_size": ready.pool_size if ready else None,
                "context_length": ready.context_len if ready else None,
                "max_running_requests": ready.max_running_requests if ready else None,
                "device": ready.device if ready else None, "dtype": ready.dtype if ready else None,
                "vocab_size": ready.vocab_size if ready else None,
                "in_flight_requests": len(engine.groups), "ipc_dir": engine.ipc_dir, "stats": stats,
                "version": app.version}

    @app.post("/flush_cache")
    async def flush_cache():
        try:
            reply = await engine.flush_cache()
        except (EngineDeadError, asyncio.TimeoutError) as e:
            raise map_engine_error(e if isinstance(e, EngineDeadError) else EngineDeadError("no reply")) from None
        if not reply.ok:
            raise APIError(409, f"cannot flush the cache: {reply.message}", code="requests_running")
        return {"status": "ok", "message": "the radix cache was flushed"}

    app.state.kv_events = install_kv_events(app, engine)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/tokenizer")
    async def tokenizer_files():
        """The served tokenizer's files (base64), for clients that need `apply_chat_template`."""
        root = settings.tokenizer_path or model_path
        files = {}
        for name in TOKENIZER_FILES:
            path = os.path.join(root, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    files[name] = base64.b64encode(f.read()).decode()
        if not files:
            raise APIError(404, "the served model has no tokenizer files", code="tokenizer_not_found")
        return {"model": served_name, "files": files}

    @app.get("/get_model_info")
    async def get_model_info():
        return {"model_path": model_path, "tokenizer_path": settings.tokenizer_path or model_path,
                "served_model_name": served_name, "is_generation": True}

    return app


def run_server(settings: ServerSettings) -> int:
    """Build the tokenizer, start uvicorn (which starts the engine process); returns an exit code."""
    import uvicorn

    from radixserve.engine.core import ensure_model_path, load_tokenizer
    from radixserve.server.startup import ServingServer

    model_path = ensure_model_path(settings.model_path)
    engine = EngineClient(settings.__class__(**{**settings.to_dict(), "model_path": model_path}))
    atexit.register(engine.close_sockets)
    atexit.register(engine.kill_now)  # atexit runs last-registered first
    engine.spawn()  # the engine loads the model while this process loads the tokenizer
    tokenizer = load_tokenizer(settings.tokenizer_path or model_path)
    app = create_app(settings, model_path, tokenizer, engine)
    import importlib.util

    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    config = uvicorn.Config(app, host=settings.host, port=settings.port, loop=loop, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=DRAIN_TIMEOUT_S, lifespan="on")
    kv_events = app.state.kv_events

    def close_kv_event_streams() -> None:
        # Open /kv_events streams never end by themselves; close them so the drain can finish.
        if kv_events.loop is not None:
            kv_events.loop.call_soon_threadsafe(kv_events.close_all)

    server = ServingServer(config, f"serving {model_path} on http://{settings.host}:{settings.port}",
                           on_exit_signal=close_kv_event_streams)
    server.run()
    engine.kill_now()
    engine.close_sockets()
    if not server.started:
        return 1
    logger.info("%s", server.shutdown_line())
    return 0
