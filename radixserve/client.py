"""An async client for a radixserve server, shaped like the seed article's client script:

    client = AsyncClient("http://127.0.0.1:8000")
    prompt = client.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    stream = await client.completions(model="qwen2-7b", prompt=prompt, stream=True, temperature=0.7)
    async for chunk in stream:
        print(chunk["choices"][0]["text"], end="")

Responses and stream chunks are the server's JSON as dicts (the OpenAI schema). `client.tokenizer`
is the served model's Hugging Face tokenizer: its files come from the server's `/tokenizer`
endpoint (written to a private temp dir and loaded with `AutoTokenizer`), so it works against a
remote server and needs no model download. The first access fetches it synchronously; in async
code `await client.load_tokenizer()` does the same without blocking the event loop.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any, AsyncIterator, Optional, Union

import httpx


class APIError(Exception):
    """The server answered with an error status; `body` is its OpenAI-style error object."""

    def __init__(self, status_code: int, body: Any):
        self.status_code = status_code
        self.body = body
        message = body.get("error", {}).get("message") if isinstance(body, dict) else str(body)
        super().__init__(f"HTTP {status_code}: {message}")


class Stream:
    """Server-sent events of one streaming response, as dicts, ending at `data: [DONE]`."""

    def __init__(self, response: httpx.Response):
        self.response = response

    def __aiter__(self) -> AsyncIterator[dict]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[dict]:
        try:
            async for line in self.response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if isinstance(event, dict) and "error" in event and len(event) == 1:
                    code = event["error"].get("code")
                    raise APIError(503 if code in ("queue_full", "engine_unavailable") else 400, event)
                yield event
        finally:
            await self.response.aclose()

    async def aclose(self) -> None:
        """Stop reading; the server aborts the request and frees its KV cache."""
        await self.response.aclose()


def _prompt_value(prompt: Any) -> Any:
    # transformers 5's apply_chat_template(tokenize=True) returns a BatchEncoding.
    if isinstance(prompt, Mapping) and "input_ids" in prompt:
        prompt = prompt["input_ids"]
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    return prompt


class AsyncClient:
    def __init__(self, base_url: str = "http://127.0.0.1:30000", api_key: Optional[str] = None,
                 timeout: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=self.headers,
                                       timeout=httpx.Timeout(timeout, connect=10.0))
        self._tokenizer = None
        self._tokenizer_dir: Optional[str] = None

    # ------------------------------------------------------------------ tokenizer
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            response = httpx.get(f"{self.base_url}/tokenizer", headers=self.headers, timeout=self.timeout)
            self._tokenizer = self._build_tokenizer(response)
        return self._tokenizer

    async def load_tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self._build_tokenizer(await self._http.get("/tokenizer"))
        return self._tokenizer

    def _build_tokenizer(self, response: httpx.Response):
        body = self._check(response)
        from transformers import AutoTokenizer

        self._tokenizer_dir = tempfile.mkdtemp(prefix="radixserve-tokenizer-")
        for name, data in body["files"].items():
            with open(os.path.join(self._tokenizer_dir, os.path.basename(name)), "wb") as f:
                f.write(base64.b64decode(data))
        return AutoTokenizer.from_pretrained(self._tokenizer_dir)

    # ------------------------------------------------------------------ requests
    @staticmethod
    def _check(response: httpx.Response) -> Any:
        try:
            body = response.json()
        except ValueError:
            body = response.text
        if response.status_code >= 400:
            raise APIError(response.status_code, body)
        return body

    async def _post(self, path: str, payload: dict, stream: bool) -> Union[dict, Stream]:
        if not stream:
            return self._check(await self._http.post(path, json=payload))
        request = self._http.build_request("POST", path, json=payload)
        response = await self._http.send(request, stream=True)
        if response.status_code >= 400:
            await response.aread()
            await response.aclose()
            self._check(response)
        return Stream(response)

    async def completions(self, prompt: Any, model: Optional[str] = None, stream: bool = False,
                          **params: Any) -> Union[dict, Stream]:
        """POST /v1/completions; `prompt` may be text, token ids, or what apply_chat_template returns."""
        payload = {"prompt": _prompt_value(prompt), "stream": stream, **params}
        if model is not None:
            payload["model"] = model
        return await self._post("/v1/completions", payload, stream)

    async def chat(self, messages: list[dict], model: Optional[str] = None, stream: bool = False,
                   **params: Any) -> Union[dict, Stream]:
        """POST /v1/chat/completions; the server applies the model's chat template."""
        payload = {"messages": messages, "stream": stream, **params}
        if model is not None:
            payload["model"] = model
        return await self._post("/v1/chat/completions", payload, stream)

    async def generate(self, text: Any = None, input_ids: Any = None, sampling_params: Optional[dict] = None,
                       stream: bool = False) -> Union[dict, list, Stream]:
        """POST /generate (SGLang-native); streamed events carry the cumulative text."""
        payload: dict[str, Any] = {"stream": stream, "sampling_params": sampling_params or {}}
        if text is not None:
            payload["text"] = text
        if input_ids is not None:
            payload["input_ids"] = _prompt_value(input_ids)
        return await self._post("/generate", payload, stream)

    async def models(self) -> dict:
        return self._check(await self._http.get("/v1/models"))

    async def health(self) -> bool:
        try:
            return (await self._http.get("/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def server_info(self) -> dict:
        return self._check(await self._http.get("/server_info"))

    async def flush_cache(self) -> dict:
        return self._check(await self._http.post("/flush_cache"))

    async def metrics(self) -> str:
        response = await self._http.get("/metrics")
        self._check(response)
        return response.text

    # ------------------------------------------------------------------ lifecycle
    async def close(self) -> None:
        await self._http.aclose()
        if self._tokenizer_dir:
            shutil.rmtree(self._tokenizer_dir, ignore_errors=True)
            self._tokenizer_dir = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
