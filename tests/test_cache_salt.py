"""Cache salts against a real server with the openai SDK: `cache_salt` (vLLM's field, sent as
`extra_body`) keeps requests of different salts from sharing a cached prefix, so
`usage.prompt_tokens_details.cached_tokens` cannot tell one tenant whether another sent a prompt;
`--cache-salt-per-api-key` does the same per API key. Also: the field's validation (a 400 naming
it) and the router's keys, which match a prompt within its salt only, as the workers cache it."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from conftest import ServerProcess
from radixserve.cache.namespace import MAX_CACHE_SALT_CHARS, cache_namespace
from radixserve.router.keys import routing_keys
from radixserve.router.prefix_tree import BlockHashMirror, PrefixTree

pytestmark = pytest.mark.timeout(300)


def fresh_prompt() -> str:
    """A prompt no earlier request of the session sent: its only cached part can be this test's."""
    return f"The secret code of {uuid.uuid4().hex} is 4711, and nobody else may learn it. " * 3


def served_model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def chat_cached(client: openai.OpenAI, prompt: str, salt=None) -> int:
    extra = {"cache_salt": salt} if salt is not None else None
    reply = client.chat.completions.create(model=served_model(client), messages=[{"role": "user", "content": prompt}],
                                           max_tokens=1, temperature=0, extra_body=extra)
    return reply.usage.prompt_tokens_details.cached_tokens


def completion_cached(client: openai.OpenAI, prompt: str, salt=None) -> int:
    extra = {"cache_salt": salt} if salt is not None else None
    reply = client.completions.create(model=served_model(client), prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body=extra)
    return reply.usage.prompt_tokens_details.cached_tokens


def generate_cached(base_url: str, prompt: str, salt=None, headers=None) -> int:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(f"{base_url}/generate", json=body, headers=headers or {}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["cached_tokens"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_another_salt_finds_nothing_cached_and_the_same_salt_does(client, endpoint):
    cached = chat_cached if endpoint == "chat" else completion_cached
    prompt = fresh_prompt()
    alice, mallory = f"alice-{uuid.uuid4()}", f"mallory-{uuid.uuid4()}"
    assert cached(client, prompt, alice) == 0
    assert cached(client, prompt, mallory) == 0  # the same prompt under another salt: nothing to see
    hit = cached(client, prompt, alice)  # its own salt's prefix is cached: all of it but the last token
    assert hit > 100
    assert cached(client, prompt, mallory) == hit
    # Unsalted requests share one cache, which has none of the salted prompt (a chat template's head,
    # or a few words other tests sent, at most); nor does what they cache reach a new salt.
    assert cached(client, prompt) < hit // 2
    assert cached(client, prompt) == hit
    assert cached(client, prompt, f"eve-{uuid.uuid4()}") == 0


def test_generate_takes_cache_salt_too(server):
    prompt, salt = fresh_prompt(), f"tenant-{uuid.uuid4()}"
    assert generate_cached(server.base_url, prompt, salt) == 0
    assert generate_cached(server.base_url, prompt, f"other-{uuid.uuid4()}") == 0
    assert generate_cached(server.base_url, prompt, salt) > 0


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}}),
])
@pytest.mark.parametrize("salt", [123, "", True, ["a"], "x" * (MAX_CACHE_SALT_CHARS + 1)])
def test_a_bad_cache_salt_is_a_400_naming_it(server, path, body, salt):
    r = httpx.post(f"{server.base_url}{path}", json={**body, "cache_salt": salt}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt", r.text


def test_the_longest_salt_is_served(server):
    r = httpx.post(f"{server.base_url}/v1/completions",
                   json={"prompt": "hi", "max_tokens": 1, "cache_salt": "x" * MAX_CACHE_SALT_CHARS}, timeout=30)
    assert r.status_code == 200, r.text


def test_the_schema_states_the_field(server):
    schemas = httpx.get(f"{server.base_url}/openapi.json", timeout=10).json()["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest", "GenerateBody"):
        field = schemas[name]["properties"]["cache_salt"]
        assert {"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS} in field["anyOf"], field


# ---------------------------------------------------------------------------------------------- per API key
@pytest.fixture(scope="module")
def per_key_server(server_model_dir, server_workdir):
    """Keys are checked by a gateway in front; the server isolates each key's cache."""
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--cache-salt-per-api-key"],
                         server_workdir)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_each_api_key_gets_its_own_cache(per_key_server):
    url = f"{per_key_server.base_url}/v1"
    alice = openai.OpenAI(base_url=url, api_key="sk-alice", max_retries=0)
    mallory = openai.OpenAI(base_url=url, api_key="sk-mallory", max_retries=0)
    prompt = fresh_prompt()
    assert completion_cached(alice, prompt) == 0
    assert completion_cached(mallory, prompt) == 0  # another key: alice's prompt is not found
    assert completion_cached(alice, prompt) > 0
    assert completion_cached(mallory, prompt) > 0
    # A salt splits a key's cache further; the same salt under another key is still another cache.
    salt = f"shared-{uuid.uuid4()}"
    assert completion_cached(alice, prompt, salt) == 0
    assert completion_cached(mallory, prompt, salt) == 0
    assert completion_cached(alice, prompt, salt) > 0
    headers = {"Authorization": "Bearer sk-mallory"}
    assert generate_cached(per_key_server.base_url, prompt, headers=headers) > 0
    assert generate_cached(per_key_server.base_url, prompt, headers={"Authorization": "Bearer sk-eve"}) == 0


# ---------------------------------------------------------------------------------------------- the router
def test_the_router_matches_a_prompt_within_its_salt_only():
    ids = list(range(100, 164))
    plain = routing_keys("/generate", {"input_ids": ids})
    a = routing_keys("/generate", {"input_ids": ids, "cache_salt": "a"})
    a_again = routing_keys("/generate", {"input_ids": ids + [7], "cache_salt": "a"})
    b = routing_keys("/generate", {"input_ids": ids, "cache_salt": "b"})
    # kv_aware: hashed from the salt's namespace, exactly as the worker publishes its blocks.
    mirror = BlockHashMirror()
    mirror.insert_tokens(a.tokens)
    assert mirror.match_len(a_again.tokens) == 64 and mirror.match_len(b.tokens) == 0
    assert mirror.match_len(plain.tokens) == 0
    # cache_aware's approximate tree: a prompt's match stops at the namespace's prefix.
    text_a = routing_keys("/v1/completions", {"prompt": "hello there " * 20, "cache_salt": "a"}).text
    text_b = routing_keys("/v1/completions", {"prompt": "hello there " * 20, "cache_salt": "b"}).text
    tree = PrefixTree()
    tree.insert(text_a)
    assert tree.match_len(text_a) == len(text_a) and tree.match_len(text_b) < 0.05 * len(text_b)
    # Per API key (the workers' --cache-salt-per-api-key): the key is part of the namespace.
    keyed = routing_keys("/generate", {"input_ids": ids}, api_key="sk-alice")
    assert mirror.match_len(keyed.tokens) == 0 and keyed.tokens[0] == cache_namespace(None, "sk-alice")
    # A malformed salt (the worker answers 400) routes as unsalted.
    assert routing_keys("/generate", {"input_ids": ids, "cache_salt": 5}).tokens == ids
