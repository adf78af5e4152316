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
from radixserve.server.errors import APIError, bad_request

# Engine-side grammar failures a request can end with before its first token.
GRAMMAR_FAILURE_CODES = (GRAMMAR_COMPILE_TIMEOUT, INVALID_GRAMMAR)


def response_format_grammar(response_format: Any) -> Optional[tuple[str, str]]:
    """(kind, text) of an OpenAI `response_format`, or None for plain text."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
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
