"""Grammars the backend would not enforce, and grammars as a denial of service, against a real
server over the tiny random model: what xgrammar would silently drop is a 400 naming the keyword
and where it is; what is too large is a 400 naming the limit, fast; a slow compile ends its
request with a 400 at the compile timeout; and a small structured request is answered while 20
attackers arrive at once."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import jsonschema
import pytest

from tests.conftest import ServerProcess


def generate(server, grammar: dict, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(f"{server.base_url}/generate", timeout=timeout, json={
        "text": "Answer:", "sampling_params": {"max_new_tokens": 64, "temperature": 1.0, "seed": 1, **grammar}})


def chat_schema(server, schema: dict, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chat/completions", timeout=timeout, json={
        "messages": [{"role": "user", "content": "JSON"}], "max_tokens": 64, "temperature": 1.0, "seed": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})


NOT_ENFORCED = [
    ({"allOf": [{"type": "integer", "minimum": 5}, {"type": "integer", "maximum": 7}]}, "'allOf' at #"),
    ({"type": "object", "properties": {"id": {"type": "string", "pattern": "^(?=ab)a.$"}}},
     "lookahead"),
    ({"type": "string", "pattern": "^a(?<=a)b$"}, "lookbehind"),
    ({"type": "string", "pattern": "^(a|b)\\1$"}, "backreference"),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}},
     "'uniqueItems' at #/properties/tags"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "'contains' at #"),
    ({"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]}, "'oneOf' at #"),
    ({"$ref": "http://example.com/schema.json"}, "'$ref' at #"),
    ({"not": {"type": "integer"}}, "'not' at #"),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}, "'if' at #"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf' at #"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, "'maxLength' at #"),
    ({"type": "string", "format": "email", "maxLength": 5}, "'maxLength' at #"),
    ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2}, "beside '$ref'"),
    ({"enum": ["a", "bbbb"], "maxLength": 2}, "beside 'enum'"),
    ({"const": "a", "type": "integer"}, "'type' at #"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, "'required' at #"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]}, "beside 'anyOf'"),
    ({"type": "string", "pattern": '^a"b$'}, "must escape"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired' at #"),
    ({"type": "object", "properties": {"site": {"type": "string", "format": "iri"}}}, "'format' at #/properties/site"),
    ({"type": "integer", "format": "int32"}, "'format' at #"),
    ({"type": "string", "format": "ipv4", "pattern": "^10\\."}, "'pattern' at #"),
]


@pytest.mark.parametrize("schema, words", NOT_ENFORCED, ids=[w for _, w in NOT_ENFORCED])
def test_unenforceable_schema_is_400_naming_the_keyword(server, schema, words):
    r = chat_schema(server, schema)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == "response_format", error
    r = generate(server, {"json_schema": json.dumps(schema)})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_lookahead_regex_is_400(server):
    r = generate(server, {"regex": "(?!no)[a-z]{2,4}"})
    assert r.status_code == 400 and "lookahead" in r.json()["error"]["message"].lower(), r.text


ENFORCED = [
    {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 3}]},
    {"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "n": {"type": "integer"}},
                "required": ["kind", "n"], "additionalProperties": False},
               {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"],
                "additionalProperties": False}]},
    {"allOf": [{"type": "integer", "minimum": 3, "maximum": 5}]},
    {"enum": ["x", "y"], "type": "string", "title": "annotations are fine"},
    {"type": "string", "pattern": "^[a-z]{1,4}-[^\"]{0,3}$"},
    {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "additionalProperties": False}},
     "$ref": "#/$defs/node"},
]


@pytest.mark.parametrize("schema", ENFORCED)
def test_enforceable_schemas_still_served(server, schema):
    r = chat_schema(server, schema)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_string_formats_are_enforced(server):
    """`format` values the server accepts hold for every reply: a random model writes whatever the
    grammar allows (xgrammar's own ipv4 let "99.99.30.057" through, its date "2021-06-31")."""
    import datetime
    import ipaddress

    schema = {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"},
                                               "day": {"type": "string", "format": "date"},
                                               "at": {"type": "string", "format": "date-time"}},
              "required": ["ip", "day", "at"], "additionalProperties": False}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "JSON"}], "max_tokens": 96, "temperature": 1.0, "seed": 1, "n": 16,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        value = json.loads(choice["message"]["content"])
        ipaddress.IPv4Address(value["ip"])
        datetime.date.fromisoformat(value["day"])
        datetime.datetime.fromisoformat(value["at"].replace("Z", "+00:00"))


def many_properties(n: int, required: bool = False) -> dict:
    props = {f"p{i}": {"type": "integer"} for i in range(n)}
    return {"type": "object", "properties": props, **({"required": list(props)} if required else {})}


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def slow_optional_objects() -> dict:
    """8 objects of 250 optional bounded strings: 5.9 s to compile against the tiny vocabulary."""
    return {"type": "object", "properties": {f"o{j}": {"type": "object", "properties": {
        f"p{i}": {"type": "string", "maxLength": 5} for i in range(250)}} for j in range(8)}}


OVER_LIMITS = [
    ({"json_schema": json.dumps(many_properties(2000, required=True))}, "the limit is 1024"),
    ({"json_schema": json.dumps(many_properties(200))}, "optional properties"),
    ({"json_schema": json.dumps(slow_optional_objects())}, "optional properties"),
    ({"json_schema": json.dumps(nested(200))}, "nests deeper than 32"),
    ({"json_schema": json.dumps({"enum": list(range(5000))})}, "the limit is 1024"),
    ({"json_schema": json.dumps({"type": "string", "pattern": "^" + "(ab|cd)" * 300 + "$"})}, "the limit is 1000"),
    ({"json_schema": json.dumps({"description": "x" * 200_000})}, "bytes"),
    ({"regex": "[a-z]{100000}"}, "automaton states"),
    ({"regex": "x" * 5000}, "the limit is 4,096"),
    ({"ebnf": 'root ::= "a"\n' + "\n".join(f'r{i} ::= "a" r{i + 1}' for i in range(5000))}, "the limit is 65,536"),
]


@pytest.mark.parametrize("grammar, words", OVER_LIMITS, ids=[w for _, w in OVER_LIMITS])
def test_grammar_over_a_limit_is_a_fast_400(server, grammar, words):
    start = time.monotonic()
    r = generate(server, grammar)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text[:500]
    assert time.monotonic() - start < 10.0  # a check, not a compile


def test_small_request_answered_while_twenty_attackers_arrive(server):
    """20 attack grammars at once (over limits, catastrophic-looking patterns, recursion, left
    recursion, distinct slow schemas), and a small structured request beside them: it is answered
    within 10 s, and every attacker gets a 400 or an answer."""
    attacks = [
        {"json_schema": json.dumps(many_properties(10_000))},
        {"json_schema": json.dumps(nested(200))},
        {"json_schema": json.dumps({"enum": [f"v{i}" for i in range(20_000)]})},
        {"json_schema": json.dumps({"type": "string", "pattern": "^(a+)+$"})},
        {"json_schema": json.dumps({"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 2}},
                                    "$ref": "#/$defs/n"})},
        {"regex": "(a+)+$"},
        {"regex": "(a|aa)*b"},
        {"ebnf": 'root ::= root "a" | "a"'},
        {"ebnf": 'root ::= x\nx ::= x x | "y"'},
    ]
    # Distinct slow schemas (each would compile for seconds; the limits refuse them up front).
    attacks += [{"json_schema": json.dumps({**slow_optional_objects(), "title": f"attack {i}"})} for i in range(11)]
    assert len(attacks) == 20
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}

    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            def post(grammar):
                return client.post("/generate", json={"text": "Go:", "sampling_params": {
                    "max_new_tokens": 16, "temperature": 1.0, **grammar}})
            attackers = [asyncio.create_task(post(g)) for g in attacks]
            await asyncio.sleep(0.2)
            start = time.monotonic()
            reply = await post({"json_schema": json.dumps(small)})
            small_s = time.monotonic() - start
            return reply, small_s, await asyncio.gather(*attackers)

    reply, small_s, answers = asyncio.run(run())
    assert reply.status_code == 200, reply.text
    assert small_s < 10.0, small_s
    jsonschema.validate(json.loads(reply.json()["text"]), small)
    # 413: the 10,000-property schema is over the request body limit before any grammar check.
    assert all(a.status_code in (200, 400, 413) for a in answers), [a.text[:200] for a in answers]
    assert sum(a.status_code in (400, 413) for a in answers) >= 14


@pytest.fixture(scope="module")
def short_timeout_server(server_model_dir, tmp_path_factory):
    proc = ServerProcess(["--model-path", str(server_model_dir), "--device", "cpu", "--grammar-compile-timeout-s", "0.05"],
                         tmp_path_factory.mktemp("grammar-timeout"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def within_limits_but_slow() -> dict:
    """15 objects of 128 optional bounded strings: within every limit, ~0.5 s to compile."""
    return {"type": "object", "properties": {f"o{j}": {"type": "object", "properties": {
        f"p{i}": {"type": "string", "maxLength": 5} for i in range(128)}} for j in range(15)}}


def test_compile_timeout_is_a_400_naming_it(short_timeout_server):
    server = short_timeout_server
    r = chat_schema(server, within_limits_but_slow())
    assert r.status_code == 400, r.text[:500]
    error = r.json()["error"]
    assert error["code"] == "grammar_compile_timeout" and "compile timeout" in error["message"], error
    stream = httpx.post(f"{server.base_url}/generate", timeout=60, json={
        "text": "x", "stream": True, "sampling_params": {"max_new_tokens": 8,
                                                         "json_schema": json.dumps({**within_limits_but_slow(),
                                                                                    "title": "another"})}})
    assert stream.status_code == 400 and "compile timeout" in stream.json()["error"]["message"], stream.text[:500]
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
