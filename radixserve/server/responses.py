"""Running one HTTP request's engine requests to a JSON body or a server-sent event stream.

Every generation endpoint builds its `Tracker`s, then hands them here with two renderers: one for
the final JSON body and one for the event stream. This module owns what they share: submitting,
watching for a client that goes away, turning engine errors into HTTP errors (before the headers)
or an error event (after), and releasing the requests however the response ends.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Callable

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from radixserve.server.engine_client import EngineDeadError, EngineRequestError, QueueFullError
from radixserve.server.errors import error_body, map_engine_error
from radixserve.server.intake import CLIENT_CLOSED_STATUS
from radixserve.server.serving import SSE_DONE, ServingContext, Tracker, first_then_rest, sse
from radixserve.server.structured import grammar_failure

logger = logging.getLogger("radixserve")

ENGINE_ERRORS = (QueueFullError, EngineDeadError, EngineRequestError)

RenderFinal = Callable[[list[Tracker]], Any]
RenderStream = Callable[[AsyncIterator, Callable[[], None]], AsyncIterator[bytes]]


# Starlette's StreamingResponse headers for text/event-stream, in its order.
EVENT_STREAM_HEADERS = ((b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
                        (b"content-type", b"text/event-stream; charset=utf-8"))


class ResultResponse(JSONResponse):
    """A generation's JSON body: compact UTF-8 like Starlette's, encoded by msgspec in a fraction
    of the time (log probabilities are made finite before they get here)."""

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


class EventStreamResponse(Response):
    """Server-sent events written straight to the ASGI channel; runs `on_close` however the
    stream ends (done, error, disconnect).

    Starlette's StreamingResponse starts a task group and a task per response to listen for the
    client going away; here the request group's own watcher (`RequestGroup.watch_disconnect`),
    started before the first token, keeps watching for the whole stream and ends the group's
    outputs when the client goes away, so its requests are aborted in the engine even while
    nothing is being written. Each send waits while the client's socket buffer is full (the
    server's flow control), so a slow reader holds back its own stream only."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.raw_headers = list(EVENT_STREAM_HEADERS)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.on_close()


async def run_request(ctx: ServingContext, request: Request, trackers: list[Tracker], stream: bool,
                      render_final: RenderFinal, render_stream: RenderStream) -> Response:
    """Submit `trackers` and answer with `render_final`'s JSON or `render_stream`'s events."""
    group = ctx.submit(trackers, stream)
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
                return Response(status_code=CLIENT_CLOSED_STATUS)
            failure = grammar_failure([t.finish_reason for t in trackers])
            if failure is not None:
                raise failure
            return ResultResponse(render_final(trackers))
        first, rest = await first_then_rest(outputs)  # the group goes on watching the client
    except ENGINE_ERRORS as e:
        close()
        raise map_engine_error(e) from None
    except BaseException:
        close()
        raise
    finally:
        if not stream:
            close()
    if first is None:
        close()
        return Response(status_code=CLIENT_CLOSED_STATUS)
    failure = grammar_failure([first.finish_reason]) if first.finished else None
    if failure is not None:  # before the headers: the grammar's error is the answer
        close()
        raise failure

    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for chunk in render_stream(rest, close):
                yield chunk
        except ENGINE_ERRORS as e:  # after the headers went out: an error event, then the end
            err = map_engine_error(e)
            yield sse(error_body(err.status, err.message, err.param, err.code))
            yield SSE_DONE
        except Exception as e:  # noqa: BLE001: a bug mid-stream still ends the stream properly
            logger.exception("unexpected error while streaming %s", request.url.path)
            yield sse(error_body(500, f"internal error: {type(e).__name__}", code="internal_error"))
            yield SSE_DONE

    return EventStreamResponse(guarded(), on_close=close)


def per_output(ctx: ServingContext, outputs: AsyncIterator, trackers: list[Tracker]):
    """Each engine output folded into its tracker: (tracker, output, new text)."""
    by_rid = {t.rid: t for t in trackers}

    async def gen():
        async for out in outputs:
            t = by_rid[out.rid]
            yield t, out, ctx.on_output(t, out)
    return gen()


def usage(trackers: list[Tracker]) -> dict[str, Any]:
    # The prompt is counted once per prompt however many choices (`n`) it has, as OpenAI does.
    firsts: dict[int, Tracker] = {}
    for t in trackers:
        firsts.setdefault(t.prompt_index, t)
    prompt = sum(t.prompt_tokens or len(t.input_ids) for t in firsts.values())
    cached = sum(t.cached_tokens for t in firsts.values())
    completion = sum(t.completion_tokens for t in trackers)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
