"""One set of rules for a request's sampling values, for the HTTP API and the offline engine.

`SamplingParams.validate()` (the engine and the offline `Engine`) and the HTTP request models
(`radixserve.server.protocol`, which are the OpenAPI schema) both take their bounds from here, so
the schema allows exactly what the engine accepts. This module imports nothing from radixserve.
"""

from __future__ import annotations

import math
from typing import Any

MAX_INT32 = 2**31 - 1
# OpenAI documents `seed` as a signed 64-bit integer; torch generators take the whole range.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# OpenAI's documented range; past 2 the distribution is close to uniform noise.
TEMPERATURE_MAX = 2.0
# -1 and 0 both mean "no top-k" (SGLang spells it -1, vLLM 0).
TOP_K_MIN = -1


class SamplingValueError(ValueError):
    """A sampling value no request can be served with; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def validate_sampling(p: Any) -> None:
    """Raise SamplingValueError for the first value of `p` (a SamplingParams) out of its range."""
    if not _is_int(p.max_new_tokens) or not 1 <= p.max_new_tokens <= MAX_INT32:
        raise SamplingValueError("max_new_tokens", f"max_new_tokens must be an integer in [1, {MAX_INT32}], "
                                                   f"got {p.max_new_tokens!r}")
    if not _is_number(p.temperature) or not 0.0 <= p.temperature <= TEMPERATURE_MAX:
        raise SamplingValueError("temperature", f"temperature must be in [0, {TEMPERATURE_MAX:g}], "
                                                f"got {p.temperature!r}")
    if not _is_number(p.top_p) or not 0.0 < p.top_p <= 1.0:
        raise SamplingValueError("top_p", f"top_p must be in (0, 1], got {p.top_p!r}")
    if not _is_int(p.top_k) or not TOP_K_MIN <= p.top_k <= MAX_INT32:
        raise SamplingValueError("top_k", f"top_k must be an integer in [-1, {MAX_INT32}] (-1 or 0: off), "
                                          f"got {p.top_k!r}")
    if not _is_number(p.min_p) or not 0.0 <= p.min_p <= 1.0:
        raise SamplingValueError("min_p", f"min_p must be in [0, 1], got {p.min_p!r}")
    if p.seed is not None and (not _is_int(p.seed) or not SEED_MIN <= p.seed <= SEED_MAX):
        raise SamplingValueError("seed", f"seed must be a signed 64-bit integer, got {p.seed!r}")
    if any(not isinstance(s, str) or s == "" for s in p.stop):
        raise SamplingValueError("stop", "stop strings must be non-empty strings")
    if any(not _is_int(t) or not 0 <= t <= MAX_INT32 for t in p.stop_token_ids):
        raise SamplingValueError("stop_token_ids", f"stop_token_ids must be integers in [0, {MAX_INT32}]")
    validate_grammar_fields(p)


GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")


def validate_grammar_fields(p: Any) -> None:
    """At most one grammar, given as text (whether it parses is checked by radixserve.grammar)."""
    given = [name for name in GRAMMAR_FIELDS if getattr(p, name, None) is not None]
    for name in given:
        if not isinstance(getattr(p, name), str) or not getattr(p, name):
            raise SamplingValueError(name, f"{name} must be a non-empty string")
    if len(given) > 1:
        raise SamplingValueError(given[1], f"give at most one of {', '.join(GRAMMAR_FIELDS)}; got {', '.join(given)}")


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a request asking for `n` choices with `seed`: each choice
    draws its own reproducible stream (`seed + choice`, folded back into the signed range)."""
    shifted = seed + choice
    return shifted if shifted <= SEED_MAX else seed - choice
