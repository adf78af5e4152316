"""Structured outputs against a real server over the tiny random model: only the grammar keeps a
random model's output valid, so every output checked against its schema shows the grammar at work."""

from __future__ import annotations

import asyncio
import json
import random
import re

import httpx
import jsonschema
import openai
import pytest

NUM_RANDOM_SCHEMAS = 50
MAX_TOKENS = 400


def parse_json(text: str):
    return json.loads(text)  # strict: a raw control character in a string is not JSON


def served_model(server) -> str:
    return httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"]


def random_leaf(rng: random.Random) -> dict:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "null"])
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(2, 8)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 1000}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", 1, 2, True, None], rng.randint(1, 4))}
    return {"type": kind}


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object of leaves, arrays of leaves and (up to two levels) nested objects; every string and
    array bounded, so a random model can always finish within MAX_TOKENS."""
    properties = {}
    for i in range(rng.randint(1, 4)):
        roll = rng.random()
        if roll < 0.2 and depth < 2:
            properties[f"obj{i}"] = random_schema(rng, depth + 1)
        elif roll < 0.4:
            properties[f"list{i}"] = {"type": "array", "items": random_leaf(rng), "maxItems": rng.randint(1, 3)}
        else:
            properties[f"field{i}"] = random_leaf(rng)
    required = [name for name in properties if rng.random() < 0.8]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def test_random_schemas_validate(server):
    """50 random schemas through the openai SDK, half of them streamed: every reply parses, validates
    against its schema and ends because the grammar completed (finish_reason stop)."""
    schemas = [random_schema(random.Random(i)) for i in range(NUM_RANDOM_SCHEMAS)]

    async def one(client, i: int, schema: dict):
        response_format = {"type": "json_schema", "json_schema": {"name": f"schema{i}", "schema": schema,
                                                                  "strict": True}}
        kwargs = dict(model=served_model(server), messages=[{"role": "user", "content": f"Describe item {i} as JSON."}],
                      response_format=response_format, max_tokens=MAX_TOKENS, temperature=1.0, seed=i)
        if i % 2:
            text, finish = "", None
            async for chunk in await client.chat.completions.create(stream=True, **kwargs):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
            return text, finish
        reply = await client.chat.completions.create(**kwargs)
        return reply.choices[0].message.content, reply.choices[0].finish_reason

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                                    timeout=300)
        limit = asyncio.Semaphore(NUM_RANDOM_SCHEMAS)  # one batch: a step costs about the same for 1 or 50 rows

        async def bounded(i, schema):
            async with limit:
                return await one(client, i, schema)
        return await asyncio.gather(*(bounded(i, s) for i, s in enumerate(schemas)))

    results = asyncio.run(run())
    for i, ((text, finish), schema) in enumerate(zip(results, schemas)):
        assert finish == "stop", (i, schema, text)
        jsonschema.validate(parse_json(text), schema)


BOUNDED_STRINGS_SCHEMA = {
    "type": "object",
    "properties": {"short": {"type": "string", "maxLength": 6},
                   "ranged": {"type": "string", "minLength": 2, "maxLength": 12},
                   "words": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
                   "key_limited": {"type": "object", "propertyNames": {"maxLength": 3},
                                   "additionalProperties": {"type": "integer"}, "maxProperties": 2}},
    "required": ["short", "ranged", "words", "key_limited"], "additionalProperties": False}


def test_bounded_strings_are_strict_json(server):
    """Strings with minLength/maxLength (and bounded property names) hold JSON string characters
    only: a random model picks control bytes and backslashes, and every reply over 48 seeds parses
    with a strict parser, validates, and counts an escape as one character of the bound."""
    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        response_format = {"type": "json_schema", "json_schema": {"name": "bounded", "schema": BOUNDED_STRINGS_SCHEMA}}
        return await asyncio.gather(*(client.chat.completions.create(
            model=served_model(server), messages=[{"role": "user", "content": f"Item {seed}"}],
            response_format=response_format, max_tokens=MAX_TOKENS, temperature=1.5, seed=seed) for seed in range(48)))

    escapes = 0
    for reply in asyncio.run(run()):
        text = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), BOUNDED_STRINGS_SCHEMA)
        escapes += text.count("\\")
    assert escapes > 0  # the random model does write escapes, so the test saw them counted


def test_json_object_and_completions(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=served_model(server), messages=[{"role": "user", "content": "JSON please"}],
                                           response_format={"type": "json_object"}, max_tokens=48,
                                           temperature=0.0)
    text = reply.choices[0].message.content
    assert text.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    done = client.completions.create(model=served_model(server), prompt="The answer:", max_tokens=32, temperature=1.0, seed=3,
                                     extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                         "name": "answer", "schema": schema}}})
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(parse_json(done.choices[0].text), schema)


def test_generate_regex_ebnf_json_schema(server):
    with server.client() as http:
        pattern = r"[a-z]{2,6}@(example|test)\.(com|org)"
        outs = http.post("/generate", json={"text": ["Mail:", "Write:", "To:"], "sampling_params": {
            "regex": pattern, "max_new_tokens": 64, "temperature": 1.0, "seed": 5}}).json()
        for out in outs:
            assert re.fullmatch(pattern, out["text"]), out["text"]
            assert out["meta_info"]["finish_reason"]["type"] == "stop"
        ebnf = 'root ::= "yes" | "no" | "maybe " digit\ndigit ::= [0-9]'
        out = http.post("/generate", json={"text": "Answer:", "sampling_params": {
            "ebnf": ebnf, "max_new_tokens": 16, "temperature": 1.0}}).json()
        assert re.fullmatch(r"yes|no|maybe [0-9]", out["text"]), out["text"]
        schema = {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2}
        lines = [json.loads(line[len("data: "):]) for line in http.post("/generate", json={
            "text": "List:", "stream": True, "sampling_params": {"json_schema": json.dumps(schema),
                                                                  "max_new_tokens": 32}}).text.splitlines()
                 if line.startswith("data: {")]
        jsonschema.validate(parse_json(lines[-1]["text"]), schema)


@pytest.mark.parametrize("body, param, words", [
    ({"text": "x", "sampling_params": {"regex": "a(b"}}, "sampling_params.regex", "parenthesis"),
    ({"text": "x", "sampling_params": {"ebnf": "root ::= foo"}}, "sampling_params.ebnf", "foo"),
    ({"text": "x", "sampling_params": {"json_schema": "{not json"}}, "sampling_params.json_schema", "not valid JSON"),
    ({"text": "x", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}, "sampling_params.ebnf",
     "at most one"),
])
def test_generate_invalid_grammar_is_400(server, body, param, words):
    r = httpx.post(f"{server.base_url}/generate", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_invalid_response_format_is_400(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=served_model(server), messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "bad", "schema": {"type": "bogus"}}})
    assert "bogus" in e.value.message and e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=served_model(server), messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       response_format={"type": "xml"})
