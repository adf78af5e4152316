"""Structured outputs in the API: `response_format` and SGLang's grammar fields become a request's
grammar, checked here (in a worker thread) so a bad schema, regex or EBNF is a 400 naming the
problem before anything reaches the engine."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Optional

from radixserve.grammar.spec import (ANY_OBJECT_SCHEMA, GRAMMAR_COMPILE_TIMEOUT, INVALID_GRAMMAR, check_grammar,
                                     grammar_spec)
from radixserve.sampling_params import FinishReason
from radixserve.server.errors import CONFLICTING_FIELDS, APIError, bad_request

# Engine-side grammar failures a request can end with before its first token.
GRAMMAR_FAILURE_CODES = (GRAMMAR_COMPILE_TIMEOUT, INVALID_GRAMMAR)


def response_format_constrains(response_format: Any) -> bool:
    """Whether a `response_format` asks for anything beyond plain text (a schema beside type text
    does, and is refused by `response_format_grammar`)."""
    return response_format is not None and (response_format.type != "text" or response_format.schema_ is not None)


def response_format_grammar(response_format: Any) -> Optional[tuple[str, str]]:
    """(kind, text) of an OpenAI `response_format`, or None for plain text."""
    if not response_format_constrains(response_format):
        return None
    if response_format.schema_ is not None and response_format.type != "json_object":
        hint = "; type json_schema takes its schema in json_schema.schema" if response_format.type == "json_schema" \
            else ""
        raise bad_request(f"response_format.schema goes with type json_object only, not {response_format.type}{hint}",
                          "response_format.schema", code=CONFLICTING_FIELDS)
    if response_format.type == "json_object":
        # {"type": "json_object", "schema": {...}}: the form several hosted APIs (and instructor's
        # JSON_SCHEMA mode) send; the schema is enforced as json_schema's is.
        if response_format.schema_ is not None:
            return "json_schema", json.dumps(response_format.schema_)
        return "json_schema", ANY_OBJECT_SCHEMA
    spec = response_format.json_schema
    if spec is None:
        raise bad_request("response_format type json_schema needs a json_schema object",
                          "response_format.json_schema")
    if spec.schema_ is None:
        return "json_schema", ANY_OBJECT_SCHEMA
    return "json_schema", json.dumps(spec.schema_)


@lru_cache(maxsize=256)
def _grammar_error(kind: str, text: str) -> Optional[str]:
    """Why (kind, text) is not a usable grammar, or None; cached, since clients repeat schemas."""
    try:
        check_grammar(kind, text)
    except ValueError as e:
        return str(e)
    return None


async def check_request_grammar(ctx, params: Any, param: str) -> None:
    """400 naming the problem when the grammar of `params` (a SamplingParams) does not compile."""
    spec = grammar_spec(params)
    if spec is None:
        return
    if ctx.tokenizer is None:
        raise bad_request("constrained decoding needs the served model's tokenizer", param)
    error = await ctx.run_blocking(_grammar_error, *spec)
    if error is not None:
        raise bad_request(error, param, code=INVALID_GRAMMAR)


def grammar_failure(finish_reasons: list[Optional[FinishReason]]) -> Optional[APIError]:
    """The 400 of a request whose grammar failed in the engine (it did not compile within the
    timeout, or at all), or None. Every choice of a request has the same grammar."""
    for reason in finish_reasons:
        if reason is not None and reason.type == "abort" and reason.code in GRAMMAR_FAILURE_CODES:
            return bad_request(reason.message or "the grammar failed", None, code=reason.code)
    return None
