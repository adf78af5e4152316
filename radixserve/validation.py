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
# Most log probabilities a request may ask for per position (OpenAI's chat limit; vLLM's default).
MAX_TOP_LOGPROBS = 20
# OpenAI's ranges for presence/frequency penalties and logit_bias values.
PENALTY_MAX = 2.0
# repetition_penalty divides (or multiplies) logits: at 1e-300 they overflow to inf and softmax
# gives NaN (an empty answer); at this floor a logit grows at most 100x.
REPETITION_PENALTY_MIN = 0.01
LOGIT_BIAS_MAX = 100.0
# Stop conditions are checked on the engine's loop for every sampled token: each stop string
# against a decoded tail as long as the longest one, each stop token id in a list. Unbounded,
# one request (10,000 stop strings, or 30,000 ids, at n=16) made every step 3.5-5.5x slower for
# everyone; at these bounds the worst request costs a step ~1.7x.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


class SamplingValueError(ValueError):
    """A sampling value no request can be served with; `field` names it."""

    def __init__(self, field: str, message: str, *, conflicting: bool = False):
        super().__init__(message)
        self.field = field
        # Each value is in range, but it contradicts another one (max_new_tokens).
        self.conflicting = conflicting


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
    if len(p.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in p.stop):
        raise SamplingValueError("stop", f"at most {MAX_STOP_STRINGS} stop strings of at most "
                                         f"{MAX_STOP_STRING_CHARS} characters each, got {len(p.stop)} of up to "
                                         f"{max(map(len, p.stop))}")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise SamplingValueError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, "
                                                   f"got {len(p.stop_token_ids)}")
    if any(not _is_int(t) or not 0 <= t <= MAX_INT32 for t in p.stop_token_ids):
        raise SamplingValueError("stop_token_ids", f"stop_token_ids must be integers in [0, {MAX_INT32}]")
    _validate_logit_processing(p)
    validate_grammar_fields(p)


def _validate_logit_processing(p: Any) -> None:
    """Bounds of the penalties, logit_bias, min_new_tokens and the log probability fields."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not _is_number(value) or not -PENALTY_MAX <= value <= PENALTY_MAX:
            raise SamplingValueError(name, f"{name} must be in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}], got {value!r}")
    if not _is_number(p.repetition_penalty) or not REPETITION_PENALTY_MIN <= p.repetition_penalty <= PENALTY_MAX:
        raise SamplingValueError("repetition_penalty", f"repetition_penalty must be in [{REPETITION_PENALTY_MIN:g}, "
                                                       f"{PENALTY_MAX:g}], got {p.repetition_penalty!r}")
    if not _is_int(p.min_new_tokens) or not 0 <= p.min_new_tokens <= MAX_INT32:
        raise SamplingValueError("min_new_tokens", f"min_new_tokens must be an integer in [0, {MAX_INT32}], "
                                                   f"got {p.min_new_tokens!r}")
    if p.min_new_tokens > p.max_new_tokens:
        raise SamplingValueError("min_new_tokens", f"min_new_tokens={p.min_new_tokens} is more than "
                                                   f"max_new_tokens={p.max_new_tokens}", conflicting=True)
    for token, bias in p.logit_bias.items():
        if not _is_int(token) or not 0 <= token <= MAX_INT32:
            raise SamplingValueError("logit_bias", f"logit_bias keys must be token ids, got {token!r}")
        if not _is_number(bias) or not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX:
            raise SamplingValueError("logit_bias", f"logit_bias values must be in [-{LOGIT_BIAS_MAX:g}, "
                                                   f"{LOGIT_BIAS_MAX:g}], got {bias!r} for token {token}")
    if not isinstance(p.return_logprob, bool):
        raise SamplingValueError("return_logprob", f"return_logprob must be a boolean, got {p.return_logprob!r}")
    if not _is_int(p.top_logprobs_num) or not 0 <= p.top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise SamplingValueError("top_logprobs_num", f"top_logprobs_num must be an integer in "
                                                     f"[0, {MAX_TOP_LOGPROBS}], got {p.top_logprobs_num!r}")
    if p.top_logprobs_num and not p.return_logprob:
        raise SamplingValueError("top_logprobs_num", "top_logprobs_num needs return_logprob")
    if not _is_int(p.logprob_start_len) or p.logprob_start_len < -1:
        raise SamplingValueError("logprob_start_len", f"logprob_start_len must be an integer >= -1, "
                                                      f"got {p.logprob_start_len!r}")
    if p.logprob_start_len >= 0 and not p.return_logprob:
        raise SamplingValueError("logprob_start_len", "logprob_start_len needs return_logprob")


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
