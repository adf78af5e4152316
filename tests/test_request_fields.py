"""Fields current SDKs and agent frameworks send: accepted where they cannot change the output,
refused by name (400 unsupported_parameter) where they would, and the served OpenAPI schema
allows exactly the accepted values."""

from __future__ import annotations

import httpx
import jsonschema
import openai
import pytest

USER = [{"role": "user", "content": "hi"}]
# Each accepted alone and all together.
ACCEPTED = {"store": False, "metadata": {"team": "search", "run": "7"}, "service_tier": "auto",
            "prompt_cache_key": "tenant-42/agent", "safety_identifier": "user-hash-1f2e", "verbosity": "medium",
            "reasoning_effort": "none", "modalities": ["text"], "prediction": None, "functions": None,
            "function_call": None, "audio": None}
ACCEPTED_NULLS = {name: None for name in ACCEPTED}
REFUSED = [("store", True), ("verbosity", "low"), ("reasoning_effort", "high"), ("modalities", ["text", "audio"]),
           ("audio", {"voice": "alloy", "format": "wav"}),
           ("prediction", {"type": "content", "content": "hello"}),
           ("functions", [{"name": "f", "parameters": {"type": "object"}}]), ("function_call", "auto")]


@pytest.fixture(scope="module")
def chat_schema(server) -> jsonschema.Draft202012Validator:
    """A validator of chat request bodies against the served /openapi.json."""
    spec = httpx.get(f"{server.base_url}/openapi.json", timeout=30).json()
    root = {"$ref": "#/components/schemas/ChatCompletionRequest", "components": spec["components"]}
    return jsonschema.Draft202012Validator(root)


def test_harmless_fields_are_accepted_and_the_schema_says_so(server, chat_schema):
    with server.client(timeout=60) as http:
        for extra in [*({name: value} for name, value in ACCEPTED.items()), ACCEPTED, ACCEPTED_NULLS]:
            body = {"messages": USER, "max_tokens": 2, **extra}
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, (extra, r.text)
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
            chat_schema.validate(body)


def test_the_sdk_sends_them(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"], messages=USER, max_tokens=2,
                                           store=False, metadata={"a": "b"}, service_tier="auto",
                                           prompt_cache_key="k", safety_identifier="s", verbosity="medium",
                                           reasoning_effort="none", modalities=["text"])
    assert reply.choices[0].message.role == "assistant"


@pytest.mark.parametrize("name,value", REFUSED, ids=[name for name, _ in REFUSED])
def test_values_that_would_change_the_output_are_refused_by_name(server, chat_schema, name, value):
    body = {"messages": USER, "max_tokens": 2, name: value}
    with server.client(timeout=60) as http:
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (name, "unsupported_parameter"), error
    assert not chat_schema.is_valid(body)


def test_out_of_bounds_metadata_is_refused(server, chat_schema):
    for metadata in ({f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": 1}):
        body = {"messages": USER, "max_tokens": 2, "metadata": metadata}
        with server.client(timeout=60) as http:
            r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("metadata"), r.text
        assert not chat_schema.is_valid(body)


def test_prompt_cache_key_is_accepted_on_completions_as_on_chat(server):
    """Accepted and not used on both (the radix cache finds a shared prefix by its tokens): the
    completion is the one without it, and the served schema allows it."""
    spec = httpx.get(f"{server.base_url}/openapi.json", timeout=30).json()
    validator = jsonschema.Draft202012Validator({"$ref": "#/components/schemas/CompletionRequest",
                                                 "components": spec["components"]})
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
    plain = client.completions.create(model=model, prompt="The river", max_tokens=4, temperature=0)
    keyed = client.completions.create(model=model, prompt="The river", max_tokens=4, temperature=0,
                                      extra_body={"prompt_cache_key": "tenant-42/agent"})
    assert keyed.choices[0].text == plain.choices[0].text
    validator.validate({"prompt": "The river", "prompt_cache_key": "tenant-42/agent"})
    with server.client(timeout=60) as http:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "prompt_cache_key": "k" * 1025})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_key", r.text
