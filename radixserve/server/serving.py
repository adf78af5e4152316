"""Turning HTTP requests into engine requests and engine outputs into responses.

One HTTP request becomes one or more engine requests (prompts x `n`); each is tracked by a
`Tracker` that detokenizes incrementally, times its tokens for the metrics and writes the
`--log-requests` lines.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, AsyncIterator, Callable, Optional, TypeVar

import msgspec
from fastapi import Depends, Request

from radixserve.cache.namespace import cache_namespace as namespace_of
from radixserve.chat_formats import SystemTurns
from radixserve.engine.messages import GenerateRequest, RequestOutput
from radixserve.http_common.api_keys import load_admin_key, load_key_ring
from radixserve.http_common.auth import bearer_token
from radixserve.sampling_params import FinishReason, SamplingParams, TokenLogprob, sampling_params_from_dict
from radixserve.server.detokenizer import IncrementalDetokenizer
from radixserve.server.engine_client import (EngineClient, EngineDeadError, EngineRequestError, QueueFullError,
                                             RequestGroup, ShuttingDownError)
from radixserve.server.errors import CONFLICTING_FIELDS, APIError, bad_request, engine_unavailable, shutting_down
from radixserve.server.logprob_format import TokenTexts
from radixserve.server.metrics import ServerMetrics
from radixserve.settings import ServerSettings
from radixserve.validation import SamplingValueError

logger = logging.getLogger("radixserve")

# max_tokens when a request does not say: this, capped by what the context and pool leave.
DEFAULT_MAX_TOKENS = 2048
HEALTH_TIMEOUT_S = 20.0
# Most log-probability entries (a position's token, or one of its top alternatives) one response may
# carry: about 40 MB of JSON at ~20 bytes an entry; 2,048 tokens x n 32 x (1 + 20 top) is under it.
MAX_LOGPROB_ENTRIES = 1 << 21
# Texts up to this long are tokenized on the event loop (tens of microseconds, less than the hop
# to a thread); longer ones in the tokenizer thread pool.
INLINE_TOKENIZE_CHARS = 4096
TOKENIZER_THREADS = 2
T = TypeVar("T")
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
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per output token, when asked for
    # Prompt log probabilities (params.logprob_start_len), of prompt tokens max(start, 1) onwards.
    input_logprobs: list[TokenLogprob] = field(default_factory=list)
    logprob_text_offset: int = 0  # characters of token text already reported (completions' text_offset)
    finish_reason: Optional[FinishReason] = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    queue_time: Optional[float] = None
    finished: bool = False
    label: Optional[str] = None  # the client's `rid`: shown back to it and logged, never routed on
    cache_namespace: Optional[str] = None  # of its cache_salt and API key (radixserve.cache.namespace)
    branch_hints: tuple[int, ...] = ()  # GenerateRequest.branch_hints

    @property
    def text(self) -> str:
        return self.detok.sent

    @property
    def e2e_latency(self) -> float:
        return (self.last_token_at or time.perf_counter()) - self.arrival


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


class ServingContext:
    """What the endpoints of every router share: settings, tokenizer, engine handle, metrics."""

    def __init__(self, settings: ServerSettings, tokenizer, engine: EngineClient, metrics: ServerMetrics,
                 model_path: str, served_model_name: str):
        self.settings = settings
        self.tokenizer = tokenizer
        self.engine = engine
        self.metrics = metrics
        self.model_path = model_path
        self.served_model_name = served_model_name
        # The accepted keys (--api-key, --api-key-file); whether each key's requests get their own cache.
        self.api_keys = load_key_ring(settings.api_key, settings.api_key_file)
        self.admin_api_key = load_admin_key(settings.admin_api_key, settings.admin_api_key_file)
        self.isolate_keys = self.api_keys.isolates_cache(settings.cache_salt_per_api_key,
                                                         settings.shared_cache_across_keys)
        self.health = HealthChecker(engine, [0])
        self.executor = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
        self.max_token_chars = longest_token_chars(tokenizer)
        self.token_texts = TokenTexts(tokenizer)
        # Where a ChatML prompt's system turn ends, read from its tokens (None: not a ChatML tokenizer).
        self.system_turns = SystemTurns.of(tokenizer) if tokenizer is not None else None
        self.created = int(time.time())  # the model's `created` in /v1/models
        self.chat_control_tokens: Any = None  # radixserve.server.chat_prompt's, made on first use
        # --reasoning-parser's format (radixserve.server.reasoning.ReasoningFormat), or None: off.
        self.reasoning: Any = None

    # ------------------------------------------------------------------ limits
    @property
    def context_len(self) -> int:
        return self.engine.ready.context_len

    @property
    def pool_size(self) -> int:
        return self.engine.ready.pool_size

    def cache_namespace(self, salt: Optional[str], request: Request) -> Optional[str]:
        """The cache namespace of a request with this cache_salt: of its API key too where keys
        isolate (--cache-salt-per-api-key, or several keys without --shared-cache-across-keys): the
        bearer token as sent; none sent: the salt's alone."""
        key = None
        if self.isolate_keys:
            token = bearer_token(request.headers.get("authorization", "").encode("latin-1", "replace"))
            key = token.decode("latin-1") if token else None
        return namespace_of(salt, key)

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in (self.served_model_name, self.model_path):
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.served_model_name!r}", param="model", code="model_not_found")

    @property
    def prompt_token_limit(self) -> int:
        return min(self.context_len, self.pool_size)

    def check_sequences(self, prompts: int, n: int, param: str) -> None:
        """prompts x n engine requests at most --max-request-sequences: checked before anything is
        tokenized (a 100,000-prompt batch held the event loop 4.3 s; 2,000 prompts x n 64 queued
        128,000 sequences ahead of everyone else)."""
        limit = self.settings.max_request_sequences
        if prompts * n > limit:
            what = f"{prompts} prompts" + (f" x n={n}" if n > 1 else "")
            raise bad_request(f"{what} is {prompts * n} sequences; this server takes at most {limit} per request "
                              "(--max-request-sequences): send fewer prompts or a lower n, or split the batch",
                              param, code="too_many_sequences")

    async def tokenize(self, text: str, param: str) -> list[int]:
        """Token ids of `text`. A text longer than the longest prompt the model can take could
        possibly spell is refused before tokenizing; a long one is tokenized in a worker thread."""
        if self.tokenizer is None:
            raise bad_request("the served model has no tokenizer; send token ids", param)
        self.check_text_length(text, param)
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self.encode(text)
        return await self.run_blocking(self.encode, text)

    def check_text_length(self, text: str, param: str) -> None:
        """400 for a text longer than the longest prompt the model can take could possibly spell."""
        limit = self.prompt_token_limit
        if len(text) > self.max_token_chars * limit:
            raise bad_request(f"the text has {len(text)} characters; no {limit}-token prompt of this model is that "
                              f"long (this model's context length is {self.context_len}, KV pool {self.pool_size})",
                              param, code="context_length_exceeded")

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run O(input) work (tokenizing, a chat template, decoding a prompt) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

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
        except SamplingValueError as e:
            raise bad_request(str(e), f"{param}.{e.field}" if param else e.field,
                              code=CONFLICTING_FIELDS if e.conflicting else "invalid_value") from None
        except ValueError as e:
            raise bad_request(str(e), param or None) from None
        if params.top_k > self.engine.ready.vocab_size:
            params.top_k = -1  # the same distribution
        return params

    def logit_bias(self, bias: Optional[dict[str, float]], param: str) -> dict[int, float]:
        """A logit_bias map (token ids as decimal strings) as token id -> bias, ids checked against
        the vocabulary."""
        vocab = self.engine.ready.vocab_size
        out: dict[int, float] = {}
        for key, value in (bias or {}).items():
            # ASCII digits without a leading zero, as the schema's pattern says: "05" or "٣" is no
            # spelling of a token id (int() would take both).
            if not (key.isascii() and key.isdigit()) or (len(key) > 1 and key[0] == "0") or int(key) >= vocab:
                raise bad_request(f"{param} keys must be token ids in [0, {vocab}) spelled in decimal, got {key!r}",
                                  param)
            out[int(key)] = value
        return out

    # ------------------------------------------------------------------ running
    def check_logprob_volume(self, prompts: list[list[int]], params_per_prompt: list[list[SamplingParams]],
                             fields: str) -> None:
        """400 before anything runs when the log probabilities asked for could pass
        MAX_LOGPROB_ENTRIES (each position's token and top alternatives, over every sequence, the
        echoed prompt's positions included): echo with logprobs 20 and n 64 over a 4,000-token
        prompt built a 107 MB reply that held the event loop 1.6 s."""
        entries = 0
        for ids, choice_params in zip(prompts, params_per_prompt):
            for params in choice_params:
                if params.return_logprob:
                    positions = params.max_new_tokens
                    if params.wants_prompt_logprobs:
                        positions += len(ids) - params.logprob_start_len
                    entries += positions * (1 + params.top_logprobs_num)
        if entries > MAX_LOGPROB_ENTRIES:
            raise bad_request(f"the log probabilities asked for could reach {entries} entries (sequences x positions "
                              f"x (1 + top logprobs), the echoed prompt included), more than one response carries "
                              f"({MAX_LOGPROB_ENTRIES}): lower {fields}", fields.split(",")[0],
                              code="response_too_large")

    def new_trackers(self, prompts: list[list[int]], params_per_prompt: list[list[SamplingParams]],
                     base_id: str, arrival: float, label: Optional[str] = None, *,
                     logprob_fields: str = "logprobs, n, max_tokens",
                     cache_namespace: Optional[str] = None, branch_hints: tuple[int, ...] = ()) -> list[Tracker]:
        self.check_logprob_volume(prompts, params_per_prompt, logprob_fields)
        trackers = []
        for p_idx, (ids, choice_params) in enumerate(zip(prompts, params_per_prompt)):
            for params in choice_params:
                index = len(trackers)
                rid = base_id if len(prompts) * len(choice_params) == 1 else f"{base_id}-{index}"
                trackers.append(Tracker(rid=rid, index=index, prompt_index=p_idx, input_ids=ids, params=params,
                                        detok=IncrementalDetokenizer(self.tokenizer, params), arrival=arrival,
                                        label=label, cache_namespace=cache_namespace, branch_hints=branch_hints))
        return trackers

    def submit(self, trackers: list[Tracker], stream: bool = True) -> RequestGroup:
        """Send the trackers' requests to the engine; stream=False: the reply is the whole result,
        so the engine sends each request's first token and end only."""
        now = time.monotonic()
        reqs = [GenerateRequest(rid=t.rid, input_ids=t.input_ids, sampling_params=t.params, arrival_time=now,
                                log=self.settings.log_requests, stream=stream, cache_namespace=t.cache_namespace,
                                branch_hints=t.branch_hints)
                for t in trackers]
        if self.settings.log_requests:
            for t in trackers:
                logger.info("Request arrived. id: %s, #prompt-token: %d, max-new-tokens: %d, temperature: %g%s",
                            t.rid, len(t.input_ids), t.params.max_new_tokens, t.params.temperature,
                            "" if t.label is None else f", rid: {t.label}")
        try:
            group = self.engine.submit(reqs)
        except ShuttingDownError as e:
            raise shutting_down(str(e)) from None
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
        t.logprobs.extend(out.new_logprobs)
        t.input_logprobs.extend(out.input_logprobs)
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
        reason = "unknown" if t.finish_reason is None else t.finish_reason.type
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


def longest_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token of `tokenizer` stands for: its longest vocabulary
    entry (byte-level BPE entries spell one character per byte, so never fewer than they stand for)."""
    if tokenizer is None:
        return 1
    try:
        return max(1, max(len(piece) for piece in tokenizer.get_vocab()))
    except (AttributeError, NotImplementedError, ValueError):
        return 1 << 20  # no vocabulary to read: no early bound worth having


def request_label(rid: Optional[str]) -> Optional[str]:
    """A client's `rid`, checked as the schema checks it: 1 to MAX_LABEL_CHARS printable ASCII
    characters (so it can never break a log line or look like another field)."""
    if rid is None:
        return None
    if not 1 <= len(rid) <= MAX_LABEL_CHARS or not all(" " <= c <= "~" for c in rid):
        raise bad_request(f"rid must be 1 to {MAX_LABEL_CHARS} printable ASCII characters", "rid")
    return rid


async def serving_context(request: Request) -> ServingContext:
    """The app's one `ServingContext` (a FastAPI dependency of every router). A coroutine so that
    FastAPI calls it on the event loop: a plain function it would run in a worker thread, a thread
    hop per request for one attribute read."""
    return request.app.state.ctx


Ctx = Annotated[ServingContext, Depends(serving_context)]


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def sse(data: Any) -> bytes:
    """One server-sent event: compact JSON, UTF-8 (msgspec's encoder takes a tenth of the json
    module's time, and a stream pays it once per token)."""
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


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


def finish_reason_name(reason: Optional[FinishReason]) -> Optional[str]:
    return None if reason is None else reason.type

