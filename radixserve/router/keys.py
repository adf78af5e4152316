"""What the router matches a request on.

- `cache_aware` matches on **text**, as SGLang's router does: the prompt string of `/generate`
  and `/v1/completions`, and for chat a plain serialisation of the messages (role and content of
  each, in order). Both keep the property that matters: a conversation's next turn extends the
  previous turn's key. No tokenizer is needed. Requests that carry token ids are matched on ids.
- `kv_aware` matches on **token ids**, hashed into chained block hashes exactly as the workers
  publish their cache in `/kv_events` (`radixserve.cache.block_hash`; the mirror hashes them).
  The router tokenizes exactly as the server does: `encode(text, add_special_tokens=False)`, and
  for chat the model's chat template applied to the messages first. The tokenizer is read from
  `--tokenizer-path` or fetched once from a worker's `/tokenizer` endpoint.

A batch (a list of prompts) is routed as a whole on its first prompt.

A request with a `cache_salt` (or, where keys isolate, `--cache-salt-per-api-key` or several keys,
any request with a key) is in its own cache namespace on the workers (`radixserve.cache.namespace`):
its keys start with the namespace (text: the digest and a NUL; tokens: the digest as a first
symbol, which the kv mirror hashes from, as the workers do), so its prefix matches only what
requests of the same namespace left on a worker.
"""

from __future__ import annotations

import base64
import os
import tempfile
from typing import Any, Optional

from radixserve.cache.namespace import MAX_CACHE_SALT_CHARS, cache_namespace
from radixserve.process.tokenizer import load_tokenizer
from radixserve.router.policies import RoutingKeys


def _first_prompt(value: Any) -> Any:
    """str | list[int] | None from a prompt field that may be a batch."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        head = value[0]
        if isinstance(head, int):
            return value if all(isinstance(t, int) for t in value) else None
        if isinstance(head, (str, list)):
            return _first_prompt(head)
    return None


def _chat_messages(body: dict) -> Optional[list[dict]]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    out = []
    for msg in messages:
        if not isinstance(msg, dict):
            return None
        content = msg.get("content")
        if isinstance(content, list):
            content = "\n".join(p.get("text") or "" for p in content if isinstance(p, dict))
        out.append({"role": str(msg.get("role", "")), "content": content if isinstance(content, str) else ""})
    return out


def chat_text(messages: list[dict]) -> str:
    return "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)


def request_namespace(body: dict, api_key: Optional[str]) -> Optional[str]:
    """The workers' cache namespace of a request (api_key: its key where keys isolate, else None);
    a malformed cache_salt (the worker answers 400) counts as none."""
    salt = body.get("cache_salt")
    if not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        salt = None
    return cache_namespace(salt, api_key)


def _in_namespace(key: Any, namespace: str) -> Any:
    if isinstance(key, str):
        return f"{namespace}\0{key}"
    return [namespace, *key] if isinstance(key, list) else key


def routing_keys(path: str, body: Any, tokenizer=None, want_tokens: bool = False,
                 api_key: Optional[str] = None) -> RoutingKeys:
    """api_key: the request's key when the workers isolate keys (--cache-salt-per-api-key, several keys)."""
    if not isinstance(body, dict):
        return RoutingKeys(None, None)
    text: Any = None
    tokens: Optional[list[int]] = None
    chat_template_text: Optional[str] = None
    if path == "/generate":
        text = _first_prompt(body.get("text")) if body.get("text") is not None else _first_prompt(body.get("input_ids"))
    elif path == "/v1/completions":
        text = _first_prompt(body.get("prompt"))
    elif path == "/v1/chat/completions":
        messages = _chat_messages(body)
        if messages is not None:
            text = chat_text(messages)
            if want_tokens and tokenizer is not None and getattr(tokenizer, "chat_template", None):
                try:
                    chat_template_text = tokenizer.apply_chat_template(
                        messages, tokenize=False, add_generation_prompt=body.get("add_generation_prompt", True))
                except Exception:  # the worker will answer 400; route anywhere
                    chat_template_text = None
    if isinstance(text, list):
        tokens = text
    elif want_tokens and tokenizer is not None:
        source = chat_template_text if path == "/v1/chat/completions" else text
        if isinstance(source, str):
            try:
                tokens = list(tokenizer.encode(source, add_special_tokens=False))
            except Exception:
                tokens = None
    namespace = request_namespace(body, api_key)
    if namespace is not None:
        same = tokens is text
        text = _in_namespace(text, namespace)
        tokens = text if same else _in_namespace(tokens, namespace)
    return RoutingKeys(text, tokens)


def tokenizer_from_files(files: dict[str, str]):
    """Build a tokenizer from a worker's `/tokenizer` answer (file name -> base64 content)."""
    directory = tempfile.mkdtemp(prefix="radixserve-router-tok-")
    for name, data in files.items():
        if os.path.basename(name) != name:
            continue
        with open(os.path.join(directory, name), "wb") as f:
            f.write(base64.b64decode(data))
    return load_tokenizer(directory, required=True)
