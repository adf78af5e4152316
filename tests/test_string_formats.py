"""JSON Schema `format` values: each is enforced (every string the grammar allows is valid, checked
by walking the grammar at random against Python's own parsers) or refused by name; and a pattern's
optional group is enforced as written. No server: the grammars are built as the server builds them
and walked over a one-character-a-token vocabulary."""

from __future__ import annotations

import datetime
import ipaddress
import json
import random
import uuid

import pytest

from radixserve.grammar.spec import build_grammar

# One token per printable ASCII character, two non-ASCII ones, and a stop token last.
VOCAB = [chr(c) for c in range(0x20, 0x7F)] + ["\u00e9", "\u4e2d", "</s>"]
STOP = len(VOCAB) - 1
WALKS = 200
MAX_CHARS = 300


@pytest.fixture(scope="module")
def compiler():
    import xgrammar

    info = xgrammar.TokenizerInfo(VOCAB, vocab_type=xgrammar.VocabType.RAW, stop_token_ids=[STOP])
    return xgrammar.GrammarCompiler(info)


def walks(compiler, schema: dict, count: int, seed: int) -> list[str]:
    """`count` JSON texts the grammar of `schema` allows, each token picked at random among those
    allowed (stopping, when allowed, one time in six)."""
    import torch
    import xgrammar

    compiled = compiler.compile_grammar(build_grammar("json_schema", json.dumps(schema)))
    rng = random.Random(seed)
    bits = torch.arange(32, dtype=torch.int32)
    out = []
    while len(out) < count:
        matcher = xgrammar.GrammarMatcher(compiled)
        mask = xgrammar.allocate_token_bitmask(1, len(VOCAB))
        text = ""
        for _ in range(MAX_CHARS):
            matcher.fill_next_token_bitmask(mask)
            allowed_mask = ((mask[0].unsqueeze(1) >> bits) & 1).flatten()[:len(VOCAB)]
            allowed = allowed_mask.nonzero().flatten().tolist()
            if STOP in allowed and (len(allowed) == 1 or rng.random() < 1 / 6):
                out.append(text)
                break
            token = rng.choice([t for t in allowed if t != STOP])
            assert matcher.accept_token(token)
            text += VOCAB[token]
    return out


def _time(value: str) -> datetime.time:
    return datetime.time.fromisoformat(value.replace("Z", "+00:00"))


def _date_time(value: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))


def _uuid(value: str) -> uuid.UUID:
    assert all(value[i] == "-" for i in (8, 13, 18, 23))
    return uuid.UUID(value)


def _hostname(value: str) -> None:
    labels = value.split(".")
    assert len(value) <= 253 and all(1 <= len(label) <= 63 for label in labels)
    assert all(label[0] != "-" and label[-1] != "-" for label in labels)


# format -> (the reference check, valid values the grammar must allow, invalid ones it must not).
FORMATS = {
    "ipv4": (ipaddress.IPv4Address, ["0.0.0.0", "192.168.1.10", "255.255.255.255"],
             ["99.99.30.057", "256.1.1.1", "1.2.3", "01.2.3.4"]),
    "ipv6": (ipaddress.IPv6Address, ["::", "::1", "fe80::1", "2001:db8::8a2e:370:7334", "::ffff:192.0.2.1",
                                     "1:2:3:4:5:6:1.2.3.4"],
             ["::ffff:01.2.3.4", "1:2:3:4:5:6:7:8:9", ":::"]),
    "date": (datetime.date.fromisoformat, ["2024-02-29", "2000-02-29", "0001-01-01", "1999-12-31"],
             ["2023-02-29", "1900-02-29", "2021-06-31", "0000-01-01", "2021-13-01"]),
    "time": (_time, ["08:30:06Z", "23:59:59.123456789+05:30"], ["08:30:60Z", "08:30:06", "24:00:00Z"]),
    "date-time": (_date_time, ["2024-02-29T08:30:06Z", "1999-12-31T23:59:59.5-01:00"],
                  ["2023-02-29T08:30:06Z", "2021-06-31T00:00:00Z", "2021-06-30T12:00:60Z"]),
    "hostname": (_hostname, ["www.example.com", "a", "db1.prod.eu-west-1.corp.example.com", "a" * 63 + ".com"],
                 ["a" * 64, "-a.com", "a_b.com", ".".join(["a" * 63] * 4) + "a"]),
    "uuid": (_uuid, ["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000"]),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_string_a_format_allows_is_valid(compiler, fmt):
    import xgrammar.testing

    check, valid, invalid = FORMATS[fmt]
    schema = {"type": "string", "format": fmt}
    grammar = build_grammar("json_schema", json.dumps(schema))
    for value in valid:
        assert xgrammar.testing._is_grammar_accept_string(grammar, json.dumps(value)), value
    for value in invalid:
        assert not xgrammar.testing._is_grammar_accept_string(grammar, json.dumps(value)), value
    for text in walks(compiler, schema, WALKS, seed=len(fmt)):
        check(json.loads(text))  # raises on an invalid value


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "string", "format": "idn-email"}, "format"),
    ({"type": "string", "format": "iri"}, "format"),
    ({"type": "string", "format": "regex"}, "format"),
    ({"type": "string", "format": "ipvanyaddress"}, "format"),
    ({"type": "integer", "format": "int32"}, "format"),
    ({"format": "ipv4"}, "format"),  # no type: the backend ignores the format
    ({"type": "string", "format": "ipv4", "pattern": "^1"}, "pattern"),  # the backend ignores the pattern
])
def test_an_unenforced_format_is_refused_by_name(schema, keyword):
    with pytest.raises(ValueError, match=f"keyword '{keyword}' at #"):
        build_grammar("json_schema", json.dumps({"type": "object", "properties": {"a": schema}}))


def test_formats_enforced_in_nested_schemas_and_definitions(compiler):
    schema = {"type": "object", "properties": {"hosts": {"type": "array", "items": {"$ref": "#/$defs/ip"},
                                                         "minItems": 1, "maxItems": 3}},
              "required": ["hosts"], "additionalProperties": False,
              "$defs": {"ip": {"type": ["string", "null"], "format": "ipv4"}}}
    for text in walks(compiler, schema, 20, seed=1):
        for host in json.loads(text)["hosts"]:
            assert host is None or ipaddress.IPv4Address(host)


def test_an_optional_group_ending_in_a_repeat_is_enforced():
    """xgrammar 0.2.9 lets `(x[0-9]{1,2})?` inside a JSON string skip the group's start ("a1b");
    the pattern reaches it with the `?` written `{0,1}`, which it enforces."""
    import xgrammar.testing

    for pattern, bad, good in ((r"^a(x[0-9]{1,2})?b$", "a1b", "ax12b"), (r"^a(xy+)?b$", "ayb", "axyyb"),
                               (r"^[A-Z][a-z]+( [A-Z][a-z]+)?$", "AbcDef", "Abc Def")):
        grammar = build_grammar("json_schema", json.dumps({"type": "string", "pattern": pattern}))
        assert not xgrammar.testing._is_grammar_accept_string(grammar, json.dumps(bad)), pattern
        assert xgrammar.testing._is_grammar_accept_string(grammar, json.dumps(good)), pattern
