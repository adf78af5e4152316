"""Backends: one streaming request against a server, timed per chunk.

- `radixserve`, `sglang`: SGLang's native `POST /generate` (SSE with cumulative text and
  `meta_info` carrying prompt, completion and cached token counts).
- `vllm`, `openai`: `POST /v1/completions` with `stream_options.include_usage`.
- `openai-chat`: `POST /v1/chat/completions` with the request's messages.

Every request asks for greedy sampling and `ignore_eos`, so each server does the same work.
A request that fails is returned with `success=False` and a short reason; nothing is raised.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp
import msgspec

from radixserve.bench.datasets import BenchRequest

BACKENDS = ("radixserve", "sglang", "vllm", "openai", "openai-chat")
# One stream event parsed: with a thousand streams the client parses every event of every one of
# them (a native event carries the whole output so far), and the stdlib parser was over a third
# of the client's CPU while streaming, enough to make the client, not the server, the bottleneck.
_decode_event = msgspec.json.Decoder().decode


class ServerUnreachable(RuntimeError):
    pass


@dataclass
class RequestResult:
    index: int
    success: bool = False
    error: str = ""
    prompt_len: int = 0  # as the server counted it (the local count when it does not say)
    output_len: int = 0
    cached_tokens: Optional[int] = None
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0  # perf_counter at send
    end: float = 0.0
    output_ids: Optional[list[int]] = None
    output_text: str = ""


def api_path(backend: str) -> str:
    return {"radixserve": "/generate", "sglang": "/generate", "vllm": "/v1/completions",
            "openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}[backend]


def build_payload(backend: str, req: BenchRequest, model: Optional[str], use_ids: bool) -> dict[str, Any]:
    if backend in ("radixserve", "sglang"):
        body: dict[str, Any] = {"sampling_params": {"max_new_tokens": req.output_len, "temperature": 0.0,
                                                    "ignore_eos": True}, "stream": True}
        if use_ids or req.prompt_text is None:
            body["input_ids"] = req.prompt_ids
        else:
            body["text"] = req.prompt_text
        return body
    common = {"max_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}
    if model:
        common["model"] = model
    if backend == "openai-chat":
        messages = req.messages or [{"role": "user", "content": req.prompt_text or ""}]
        return {"messages": messages, **common}
    prompt = req.prompt_ids if (use_ids or req.prompt_text is None) else req.prompt_text
    return {"prompt": prompt, **common}


def _error_text(status: int, text: str) -> str:
    try:
        body = json.loads(text)
        msg = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else body.get("error")
        msg = msg or body.get("detail") or text
    except (ValueError, AttributeError):
        msg = text
    msg = str(msg).strip().replace("\n", " ")
    return f"HTTP {status}: {msg[:160]}"


def encode_payload(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


async def send_request(session: aiohttp.ClientSession, url: str, backend: str, req: BenchRequest, index: int,
                       model: Optional[str], use_ids: bool, headers: dict[str, str],
                       body: Optional[bytes] = None) -> RequestResult:
    """One streamed request; `body` is the encoded payload when the caller prepared it already."""
    result = RequestResult(index=index, prompt_len=req.prompt_len)
    if body is None:
        body = encode_payload(build_payload(backend, req, model, use_ids))
    headers = {**headers, "Content-Type": "application/json"}
    native = backend in ("radixserve", "sglang")
    start = time.perf_counter()
    result.start = start
    last = start
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            if resp.status != 200:
                result.error = _error_text(resp.status, await resp.text())
                return result
            buffer = b""
            done = False
            # Whatever has arrived, split into lines here: one await per read, not per line.
            async for raw in resp.content.iter_any():
                *lines, buffer = (buffer + raw).split(b"\n")
                for line in lines:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    event = _decode_event(data)
                    if isinstance(event, dict) and "error" in event and not event.get("choices"):
                        err = event["error"]
                        msg = err.get("message") if isinstance(err, dict) else str(err)
                        result.error = f"stream error: {str(msg)[:160]}"
                        return result
                    now = time.perf_counter()
                    got_tokens = _consume(event, result, native)
                    if got_tokens:
                        if result.ttft == 0.0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                if done:
                    break
            if not done:
                result.error = "stream ended before [DONE]"
                return result
    except aiohttp.ClientConnectorError as e:
        result.error = f"connection refused: {e.os_error or e}"[:200]
        return result
    except aiohttp.ClientOSError as e:  # after connecting: reset by the server
        result.error = f"connection reset: {e.strerror or e}"[:200]
        return result
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as e:
        result.error = f"connection lost mid-stream: {type(e).__name__}"
        return result
    except aiohttp.ClientError as e:
        result.error = f"{type(e).__name__}: {e}"[:200]
        return result
    except TimeoutError:
        result.error = "timeout"
        return result
    except msgspec.DecodeError as e:
        result.error = f"malformed stream event: {e}"[:200]
        return result
    result.end = time.perf_counter()
    result.latency = result.end - start
    if result.output_len == 0:
        result.error = "the response carried no output tokens"
        return result
    result.success = True
    return result


def _consume(event: dict[str, Any], result: RequestResult, native: bool) -> bool:
    """Fold one SSE event into result; True when it carried new output."""
    if native:
        meta = event.get("meta_info") or {}
        before = result.output_len
        result.output_text = event.get("text", result.output_text)
        if "output_ids" in event:
            result.output_ids = event["output_ids"]
        result.output_len = int(meta.get("completion_tokens", len(result.output_ids or [])))
        if "prompt_tokens" in meta:
            result.prompt_len = int(meta["prompt_tokens"])
        if meta.get("cached_tokens") is not None:
            result.cached_tokens = int(meta["cached_tokens"])
        return result.output_len > before
    usage = event.get("usage")
    if usage:
        result.prompt_len = int(usage.get("prompt_tokens", result.prompt_len))
        result.output_len = int(usage.get("completion_tokens", result.output_len))
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            result.cached_tokens = int(details["cached_tokens"])
    got = False
    for choice in event.get("choices") or []:
        piece = choice.get("text")
        if piece is None:
            piece = (choice.get("delta") or {}).get("content")
        if piece:
            result.output_text += piece
            got = True
    return got


# ---------------------------------------------------------------------------- server side
def parse_prometheus(text: str) -> dict[str, float]:
    """name{labels} value -> {name{labels}: value}; comments skipped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^(\S+?(?:\{.*\})?)\s+(\S+)", line)
        if m:
            try:
                out[m.group(1)] = float(m.group(2))
            except ValueError:
                pass
    return out


# (prompt tokens, cached prompt tokens) counter pairs, first match wins.
CACHE_COUNTERS = (
    ("radixserve:prompt_tokens_total", "radixserve:cached_prompt_tokens_total"),
    ("sglang:prompt_tokens_total", "sglang:cached_tokens_total"),
    ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
)
REQUEST_COUNTERS = ("radixserve:request_prompt_tokens_total", "radixserve:request_cached_tokens_total")
# A radixserve server with a host tier (--hicache-size): cached prompt tokens copied back from the host.
HOST_TIER_COUNTER = "radixserve:host_cached_prompt_tokens_total"


def cache_counters(metrics: dict[str, float]) -> dict[str, Optional[float]]:
    def total(name: str) -> Optional[float]:
        values = [v for k, v in metrics.items() if k == name or k.startswith(name + "{")]
        return sum(values) if values else None

    out: dict[str, Optional[float]] = {"engine_prompt": None, "engine_cached": None, "source": None,
                                       "request_prompt": total(REQUEST_COUNTERS[0]),
                                       "request_cached": total(REQUEST_COUNTERS[1]),
                                       "engine_host_cached": total(HOST_TIER_COUNTER)}
    for prompt, cached in CACHE_COUNTERS:
        p, c = total(prompt), total(cached)
        if p is not None and c is not None:
            out.update(engine_prompt=p, engine_cached=c, source=prompt.split(":")[0])
            break
    return out


async def fetch_json(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> Optional[dict]:
    try:
        async with session.get(url, headers=headers) as resp:
            if resp.status != 200:
                return None
            return await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def fetch_metrics(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]):
    try:
        async with session.get(base_url + "/metrics", headers=headers) as resp:
            if resp.status != 200:
                return None
            return cache_counters(parse_prometheus(await resp.text()))
    except (aiohttp.ClientError, TimeoutError):
        return None


async def check_reachable(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> None:
    """Raise ServerUnreachable with a clear message when nothing answers HTTP at base_url."""
    for path in ("/health", "/v1/models"):
        try:
            async with session.get(base_url + path, headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=30)) as resp:
                if resp.status < 500 or path == "/v1/models":
                    return
        except aiohttp.ClientConnectorError as e:
            raise ServerUnreachable(f"cannot connect to {base_url}: {e.os_error or e}. Is the server running "
                                    f"(python -m radixserve.launch_server --port ...)?") from None
        except (aiohttp.ClientError, TimeoutError) as e:
            raise ServerUnreachable(f"{base_url} did not answer: {type(e).__name__} {e}") from None


async def open_connections(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str], n: int) -> None:
    """Leave n idle keep-alive connections in the session's pool (n concurrent GET /v1/models: any
    answer will do, and unlike /health, which may run the model, it leaves the server's counters
    alone), so that a burst of n requests sends at once instead of opening n connections
    inside the timed run (on loopback ~0.3 ms of the client's loop each: 0.4-0.6 s for 1,024, read
    as server latency)."""
    async def one() -> None:
        try:
            async with session.get(base_url + "/v1/models", headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=30)) as resp:
                await resp.read()
        except (aiohttp.ClientError, TimeoutError):
            pass  # the run itself reports an unreachable server

    await asyncio.gather(*(one() for _ in range(n)))


async def fetch_tokenizer_dir(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str],
                              model_type: str = "qwen2") -> Optional[str]:
    """Write the server's /tokenizer files to a temp dir; None when the server has none."""
    body = await fetch_json(session, base_url + "/tokenizer", headers)
    if not body or not body.get("files"):
        return None
    path = tempfile.mkdtemp(prefix="radixserve-bench-tokenizer-")
    for name, data in body["files"].items():
        with open(os.path.join(path, os.path.basename(name)), "wb") as f:
            f.write(base64.b64decode(data))
    if "config.json" not in body["files"]:
        # transformers picks the tokenizer class (and with it the pre-tokenizer) from the model
        # config; the server loads its tokenizer from a Qwen2 model directory, so say so, or the
        # same tokenizer.json would split text differently here than on the server.
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"model_type": model_type}, f)
    return path


class FailFast:
    """Notices a run whose first requests all fail for the same reason (a prompt longer than the
    context, a wrong model name, a bad key): the rest would fail the same way, so the run stops
    there instead of sending every request."""

    def __init__(self, total: int, first: int = 3):
        self.total = total
        self.first = first
        self.finished = 0
        self.succeeded = False
        self.reasons: set[str] = set()

    def add(self, result: RequestResult) -> bool:
        """Count one finished request; True when the run should stop now."""
        self.finished += 1
        if result.success:
            self.succeeded = True
        else:
            self.reasons.add(result.error)
        return (not self.succeeded and self.finished == self.first and self.finished < self.total
                and len(self.reasons) == 1)

    def message(self) -> str:
        reason = next(iter(self.reasons), "")
        return (f"the first {self.first} requests all failed with the same error, so the other "
                f"{self.total - self.finished} were not waited for: {reason}")
