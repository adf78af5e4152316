"""Output ids to text, shared by the offline Engine and the API process."""

from __future__ import annotations

from typing import Optional

from radixserve.sampling_params import SamplingParams


def cut_at_stop(text: str, params: SamplingParams, finish_reason: Optional[dict]) -> str:
    """Drop a matched stop string and everything after it (the stop token ids are dropped by decode)."""
    if finish_reason and isinstance(finish_reason.get("matched"), str):
        pos = text.find(finish_reason["matched"])
        if pos >= 0:
            return text[:pos]
    return text


def decode_output(tokenizer, output_ids: list[int], params: SamplingParams, finish_reason: Optional[dict]) -> str:
    if tokenizer is None:
        return ""
    text = tokenizer.decode(output_ids, skip_special_tokens=params.skip_special_tokens)
    return cut_at_stop(text, params, finish_reason)
