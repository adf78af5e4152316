"""A request's grammar: its kind and text, and checking it before a request is accepted.

The kinds are SGLang's sampling parameters: `json_schema` (a JSON Schema as text), `regex` and
`ebnf` (xgrammar's EBNF dialect, GBNF-like). The OpenAI API's `response_format` and forced tool
calls are turned into one of these by the server. Checking builds the grammar without a tokenizer
(no vocabulary work), so the API process can refuse a bad one with a message naming the problem.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from radixserve.grammar.json_strings import escape_bounded_strings
from radixserve.grammar.regex_check import RegexRefused, check_regex
from radixserve.grammar.schema_check import MAX_SCHEMA_BYTES, SchemaRefused, check_schema, enforceable_schema
from radixserve.sampling_params import GRAMMAR_KINDS

# Outputs are compact JSON (", " and ": " separators, no other whitespace): a model cannot pad
# an object with whitespace forever, and a schema's output has one spelling.
JSON_SEPARATORS = (", ", ": ")
# `response_format: json_object` (any JSON object).
ANY_OBJECT_SCHEMA = '{"type": "object"}'
_XGRAMMAR_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
# Error codes of a grammar the server refuses (400), also the `code` of the finish_reason of a
# request that ended in the engine because of its grammar.
INVALID_GRAMMAR = "invalid_grammar"
GRAMMAR_COMPILE_TIMEOUT = "grammar_compile_timeout"
# Grammar text bounds, checked before anything parses it (the schema's own limits are in
# radixserve.grammar.schema_check, the regex's in radixserve.grammar.regex_check).
MAX_GRAMMAR_BYTES = {"json_schema": MAX_SCHEMA_BYTES, "regex": 4096, "ebnf": 64 * 1024}


def grammar_spec(params: Any) -> Optional[tuple[str, str]]:
    """(kind, text) of the grammar a SamplingParams asks for, or None."""
    for kind in GRAMMAR_KINDS:
        text = getattr(params, kind, None)
        if text is not None:
            return kind, text
    return None


def clean_error(error: Exception) -> str:
    """xgrammar's message without its timestamp and source location."""
    return _XGRAMMAR_LOCATION.sub("", str(error).strip()).strip()


def build_grammar(kind: str, text: str):
    """The xgrammar `Grammar` of (kind, text); ValueError naming the problem when it is invalid,
    not enforceable by the backend, or over a size limit."""
    import xgrammar

    limit = MAX_GRAMMAR_BYTES.get(kind)
    if limit is not None and len(text) > limit:  # characters <= bytes: a cheap first bound
        raise ValueError(f"the {kind} is {len(text):,} characters long; the limit is {limit:,} bytes")
    if limit is not None and len(text.encode("utf-8", "surrogatepass")) > limit:
        raise ValueError(f"the {kind} is over the limit of {limit:,} bytes")
    try:
        if kind == "json_schema":
            try:
                schema = json.loads(text)
            except (json.JSONDecodeError, RecursionError) as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("json_schema must be a JSON object (a JSON Schema)")
            check_schema(schema)
            enforced = enforceable_schema(schema)
            if enforced is not schema:
                text = json.dumps(enforced)
            grammar = xgrammar.Grammar.from_json_schema(text, any_whitespace=False, separators=JSON_SEPARATORS,
                                                        strict_mode=True)
            return escape_bounded_strings(grammar)
        if kind == "regex":
            grammar = xgrammar.Grammar.from_regex(text)  # its own message for a syntax error
            check_regex(text, in_json_string=False)
            return grammar
        if kind == "ebnf":
            return xgrammar.Grammar.from_ebnf(text)
    except (SchemaRefused, RegexRefused) as e:
        raise ValueError(str(e)) from None
    except (RuntimeError, xgrammar.InvalidJSONError) as e:
        raise ValueError(f"invalid {kind}: {clean_error(e)}") from None
    raise ValueError(f"unknown grammar kind {kind!r}; one of {', '.join(GRAMMAR_KINDS)}")


def check_grammar(kind: str, text: str) -> None:
    """Raise ValueError naming the problem when (kind, text) is not a grammar xgrammar can use."""
    build_grammar(kind, text)
