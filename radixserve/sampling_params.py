"""Sampling parameters of one request: the type shared by the model's sampler, the scheduler, the
engine and the API (a leaf module: it imports only the validation rules, which import nothing).
"""

from __future__ import annotations

from typing import Literal, Optional, Union

import msgspec

from radixserve.validation import validate_sampling


# What sampling must do for a request, as bits (`SamplingParams.sampling_flags`). A step ORs its
# requests' flags once; a pass over the batch that no request needs is skipped on that basis:
# with ~1,000 requests decoding, each per-request check costs the host a few hundred microseconds.
PROCESSES_LOGITS = 1  # min_new_tokens, logit_bias or a penalty
SAMPLES = 2  # not greedy: temperature, the filters and a random draw
SEEDED = 4  # samples from its own generator
RETURNS_LOGPROBS = 8
CONSTRAINED = 16  # names a grammar (only such a request is ever given a matcher)

# The sampling parameters that name a grammar (radixserve.grammar.spec reads them).
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Logit processing, in this order on the device (see radixserve.model.logit_processing):
    # min_new_tokens masks EOS and stop_token_ids until that many tokens are out; logit_bias adds
    # to the logits of its token ids; repetition_penalty (HF: seen logits divided when positive,
    # multiplied when negative; prompt and output count as seen); frequency_penalty and
    # presence_penalty (OpenAI: minus count * frequency and minus presence for output tokens).
    min_new_tokens: int = 0
    logit_bias: dict[int, float] = {}
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # Log probabilities of each sampled token (and of the top_logprobs_num most likely ones) under
    # the model's own distribution: log_softmax of the raw logits, before logit_bias, penalties,
    # temperature and the top-k/top-p/min-p filters (vLLM's default, "raw logprobs").
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # Prompt log probabilities (SGLang's field): with return_logprob, those of the prompt tokens
    # from this position on (the first token of a prompt has none); -1: none. The prompt's cached
    # prefix is not reused past it, since logits exist only for positions the step computes.
    logprob_start_len: int = -1
    # Constrained decoding (SGLang's names; at most one): a JSON Schema as text, a regular
    # expression, or an EBNF grammar (xgrammar's dialect). See radixserve.grammar.
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    # With the engine's reasoning parser: the grammar starts after the reply's reasoning (at its
    # end-of-reasoning token), which is free text (radixserve.grammar.reasoning_gate). The chat API
    # sets it for a reply whose reasoning it splits off.
    grammar_after_reasoning: bool = False

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.logprob_start_len >= 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes the logits before temperature and the filters."""
        return self.has_penalties or bool(self.logit_bias) or self.min_new_tokens > 0

    def sampling_flags(self) -> int:
        """This request's bits of the flags above."""
        greedy = self.is_greedy
        return ((PROCESSES_LOGITS if self.processes_logits else 0) | (0 if greedy else SAMPLES)
                | (SEEDED if self.seed is not None and not greedy else 0)
                | (RETURNS_LOGPROBS if self.return_logprob else 0)
                | (CONSTRAINED if any(getattr(self, kind) is not None for kind in GRAMMAR_KINDS) else 0))

    def validate(self) -> None:
        """Raise ValueError (a `SamplingValueError` naming the field) for values no request can be
        served with; the HTTP API's schema has the same bounds."""
        validate_sampling(self)


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True):
    """What sampling reports about one sampled token when its request asked for log probabilities:
    its log probability and the `top_logprobs_num` most likely ids with theirs, most likely first."""
    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class FinishReason(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """Why a request ended: "stop" (`matched`: the stop or end-of-sequence token id, or the stop
    string, that ended it; a completed grammar's last token), "length" (`length`: the tokens it
    generated, at max_new_tokens or the context's end) or "abort" (`message`, and `code` for a
    grammar that failed: radixserve.grammar.spec's codes). Set once, by the scheduler or the
    grammar wait; the API shows it as `as_dict()` (the offline meta_info, /generate), whose keys
    are the fields set."""

    type: Literal["stop", "length", "abort"]
    matched: Union[int, str, None] = None
    length: Optional[int] = None
    message: Optional[str] = None
    code: Optional[str] = None

    def as_dict(self) -> dict:
        return {name: value for name in self.__struct_fields__ if (value := getattr(self, name)) is not None}


def sampling_params_from_dict(values: Optional[dict]) -> SamplingParams:
    """Build SamplingParams from a user dict, naming unknown or mistyped keys in a ValueError."""
    values = dict(values or {})
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    try:
        params = msgspec.convert(values, SamplingParams, strict=False)
    except msgspec.ValidationError as e:  # unknown field, wrong type
        raise ValueError(f"invalid sampling_params: {e}") from None
    params.validate()
    return params
