"""Sampling parameters of one request: the type shared by the model's sampler, the scheduler, the
engine and the API (a leaf module: it imports only the validation rules, which import nothing).
"""

from __future__ import annotations

from typing import Optional

import msgspec

from radixserve.validation import validate_sampling


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
    # Constrained decoding (SGLang's names; at most one): a JSON Schema as text, a regular
    # expression, or an EBNF grammar (xgrammar's dialect). See radixserve.grammar.
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        """Raise ValueError (a `SamplingValueError` naming the field) for values no request can be
        served with; the HTTP API's schema has the same bounds."""
        validate_sampling(self)


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
