"""Turning HTTP requests into engine requests and engine outputs into responses.

One HTTP request becomes one or more engine requests (prompts x `n`); each is tracked by a
`Tracker` that detokenizes incrementally, times its tokens for the metrics and writes the
`--log-requests` lines.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

from radixserve.engine.io_struct import GenerateRequest, RequestOutput, SamplingParams, sampling_params_from_dict
from radixserve.server.detokenizer import IncrementalDetokenizer
from radixserve.server.engine_client import (EngineClient, EngineDeadError, EngineRequestError, QueueFullError,
                                             RequestGroup, ShuttingDownError)
from radixserve.server.errors import APIError, bad_request
from radixserve.server.metrics import ServerMetrics
from radixserve.settings import ServerSettings

logger = logging.getLogger("radixserve")

# max_tokens when a request does not say: this, capped by what the context and pool leave.
DEFAULT_MAX_TOKENS = 2048
RETRY_AFTER_S = 1
SEED_RANGE = (-(2**63), 2**63 - 1)
MAX_INT32 = 2**31 - 1
MAX_LABEL_CHARS = 128


@dataclass
class Tracker:
    """One engine request seen from the API process."""

    rid: str  # the engine's id, always made by the server
    index: int  # choice index in the HTTP response
    prompt_index: int
    input_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    arrival: float  # time.perf_counter() when the HTTP request arrived
    first_token_at: Optional[float] = None
    last_token_at: Optional[float] = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[dict] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    queue_time: Optional[float] = None
    finished: bool = False
    label: Optional[str] = None  # the client's `rid`: shown back to it and logged, never routed on

    @property
    def text(self) -> str:
        return self.detok.sent

    @property
    def e2e_latency(self) -> float:
        return (self.last_token_at or time.perf_counter()) - self.arrival


class ServingContext:
    """What the endpoints share: settings, tokenizer, engine handle, metrics."""

    def __init__(self, settings: ServerSettings, tokenizer, engine: EngineClient, metrics: ServerMetrics,
                 model_path: str, served_model_name: str):
        self.settings = settings
        self.tokenizer = tokenizer
        self.engine = engine
        self.metrics = metrics
        self.model_path = model_path
        self.served_model_name = served_model_name

    # ------------------------------------------------------------------ limits
    @property
    def context_len(self) -> int:
        return self.engine.ready.context_len

    @property
    def pool_size(self) -> int:
        return self.engine.ready.pool_size

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in (self.served_model_name, self.model_path):
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.served_model_name!r}", param="model", code="model_not_found")

    def tokenize(self, text: str, param: str) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("the served model has no tokenizer; send token ids", param)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise bad_request("the prompt is empty", param)
        vocab = self.engine.ready.vocab_size
        if max(ids) >= vocab:  # max() runs in C: a long prompt is checked in microseconds
            bad = next(t for t in ids if t >= vocab)
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", param)
        limit = min(self.context_len, self.pool_size)
        if len(ids) >= limit:
            raise bad_request(f"the prompt has {len(ids)} tokens; this model's context length is "
                              f"{self.context_len} (KV pool {self.pool_size}), which leaves no room to generate",
                              param, code="context_length_exceeded")

    def max_new_tokens(self, ids: list[int], requested: Optional[int], param: str) -> int:
        room = min(self.context_len, self.pool_size) - len(ids)
        if requested is None:
            return max(1, min(DEFAULT_MAX_TOKENS, room))
        if requested > room:
            raise bad_request(f"{param}={requested} plus the prompt's {len(ids)} tokens exceeds the context "
                              f"length {min(self.context_len, self.pool_size)}", param,
                              code="context_length_exceeded")
        return requested

    def sampling_params(self, values: dict[str, Any], param: str = "sampling_params") -> SamplingParams:
        try:
            params = sampling_params_from_dict(values)
        except ValueError as e:
            raise bad_request(str(e), param) from None
        # Ranges the engine would only find out about by failing mid-step.
        if params.seed is not None and not SEED_RANGE[0] <= params.seed <= SEED_RANGE[1]:
            raise bad_request(f"seed must fit in 64 bits, got {params.seed}", f"{param}.seed" if param else "seed")
        for name in ("max_new_tokens", "top_k"):
            if getattr(params, name) > MAX_INT32:
                raise bad_request(f"{name} is too large", name)
        if any(t > MAX_INT32 for t in params.stop_token_ids):
            raise bad_request("stop_token_ids must be 32-bit token ids", "stop_token_ids")
        vocab = self.engine.ready.vocab_size
        if params.top_k > vocab:
            params.top_k = -1  # the same distribution
        return params

    # ------------------------------------------------------------------ running
    def new_trackers(self, prompts: list[list[int]], params_per_prompt: list[list[SamplingParams]],
                     base_id: str, arrival: float, label: Optional[str] = None) -> list[Tracker]:
        trackers = []
        for p_idx, (ids, choice_params) in enumerate(zip(prompts, params_per_prompt)):
            for params in choice_params:
                index = len(trackers)
                rid = base_id if len(prompts) * len(choice_params) == 1 else f"{base_id}-{index}"
                trackers.append(Tracker(rid=rid, index=index, prompt_index=p_idx, input_ids=ids, params=params,
                                        detok=IncrementalDetokenizer(self.tokenizer, params), arrival=arrival,
                                        label=label))
        return trackers

    def submit(self, trackers: list[Tracker]) -> RequestGroup:
        now = time.monotonic()
        reqs = [GenerateRequest(rid=t.rid, input_ids=t.input_ids, sampling_params=t.params, arrival_time=now,
                                log=self.settings.log_requests) for t in trackers]
        if self.settings.log_requests:
            for t in trackers:
                logger.info("Request arrived. id: %s, #prompt-token: %d, max-new-tokens: %d, temperature: %g%s",
                            t.rid, len(t.input_ids), t.params.max_new_tokens, t.params.temperature,
                            "" if t.label is None else f", rid: {t.label}")
        try:
            group = self.engine.submit(reqs)
        except ShuttingDownError as e:
            raise map_engine_error(e) from None
        except EngineDeadError as e:
            raise engine_unavailable(str(e)) from None
        except EngineRequestError as e:
            raise bad_request(str(e), "rid") from None
        except (OverflowError, TypeError, ValueError) as e:  # not encodable: a value out of range
            raise bad_request(f"a request value is out of range: {e}") from None
        self.metrics.running_http.inc()
        return group

    def on_output(self, t: Tracker, out: RequestOutput) -> str:
        """Fold one engine output into its tracker; returns the new text to show."""
        now = time.perf_counter()
        if out.new_token_ids:
            if t.first_token_at is None:
                t.first_token_at = now
                self.metrics.ttft.observe(now - t.arrival)
            elif t.last_token_at is not None:
                gap = (now - t.last_token_at) / len(out.new_token_ids)
                for _ in out.new_token_ids:
                    self.metrics.itl.observe(gap)
            t.last_token_at = now
            self.metrics.generation_tokens.inc(len(out.new_token_ids))
        if out.queue_time is not None:
            t.queue_time = out.queue_time
            self.metrics.queue_time.observe(out.queue_time)
        t.output_ids.extend(out.new_token_ids)
        t.prompt_tokens = out.prompt_tokens
        t.cached_tokens = out.cached_tokens
        t.completion_tokens = out.completion_tokens
        delta = t.detok.add(out.new_token_ids)
        if out.finished:
            t.finished = True
            t.finish_reason = out.finish_reason
            t.last_token_at = t.last_token_at or now
            delta += t.detok.finish(out.finish_reason)
            self._finished(t)
        return delta

    def _finished(self, t: Tracker) -> None:
        reason = (t.finish_reason or {}).get("type", "unknown")
        self.metrics.requests.labels(finish_reason=reason).inc()
        self.metrics.e2e.observe(t.e2e_latency)
        self.metrics.request_prompt_tokens.inc(t.prompt_tokens)
        self.metrics.request_cached_tokens.inc(t.cached_tokens)
        if self.settings.log_requests:
            ttft = f"{t.first_token_at - t.arrival:.3f}s" if t.first_token_at else "-"
            logger.info("Request finished. id: %s, #prompt-token: %d, #cached-token: %d, #output-token: %d, "
                        "ttft: %s, latency: %.3fs, finish_reason: %s", t.rid, t.prompt_tokens, t.cached_tokens,
                        t.completion_tokens, ttft, t.e2e_latency, reason)

    def done(self, trackers: list[Tracker]) -> None:
        """Called once per HTTP request when it ends, however it ends."""
        self.metrics.running_http.dec()
        if self.settings.log_requests:
            for t in trackers:
                if not t.finished:
                    logger.info("Request aborted. id: %s, #output-token: %d, latency: %.3fs", t.rid,
                                len(t.output_ids), time.perf_counter() - t.arrival)


def engine_unavailable(message: str) -> APIError:
    return APIError(503, f"the engine is unavailable: {message}", code="engine_unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def request_label(rid: Optional[str]) -> Optional[str]:
    """A client's `rid`, checked: printable text of at most MAX_LABEL_CHARS characters."""
    if rid is None:
        return None
    if not rid or len(rid) > MAX_LABEL_CHARS or not rid.isprintable():
        raise bad_request(f"rid must be 1 to {MAX_LABEL_CHARS} printable characters", "rid")
    return rid


def map_engine_error(exc: BaseException) -> APIError:
    if isinstance(exc, ShuttingDownError):
        return APIError(503, str(exc), code="server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineDeadError):
        return engine_unavailable(str(exc))
    if isinstance(exc, EngineRequestError):
        return bad_request(str(exc))
    raise exc


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def first_then_rest(agen: AsyncIterator[RequestOutput]) -> tuple[Optional[RequestOutput],
                                                                      AsyncIterator[RequestOutput]]:
    """Wait for the first output (so errors like a full queue become an HTTP status, not a stream)."""
    try:
        first: Optional[RequestOutput] = await agen.__anext__()
    except StopAsyncIteration:
        first = None

    async def rest() -> AsyncIterator[RequestOutput]:
        if first is not None:
            yield first
        async for item in agen:
            yield item

    return first, rest()


def finish_reason_name(reason: Optional[dict]) -> Optional[str]:
    return None if reason is None else reason.get("type")

