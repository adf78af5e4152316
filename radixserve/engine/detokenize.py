"""Output ids to text, shared by the offline Engine and the API process."""

from __future__ import annotations

import weakref
from typing import Callable, Optional

from radixserve.sampling_params import FinishReason, SamplingParams

Decode = Callable[..., str]  # (ids, skip_special_tokens=...) -> text
_decoders: "weakref.WeakKeyDictionary[object, Decode]" = weakref.WeakKeyDictionary()


def plain_decode(tokenizer) -> Decode:
    """`tokenizer.decode`, or the Rust tokenizer's own decode where transformers' wrapper adds
    nothing to it (no clean-up of spaces, no subclass override): the wrapper's argument
    conversion cost as much as the decoding, twice per streamed event."""
    try:
        return _decoders[tokenizer]
    except (KeyError, TypeError):
        pass
    decode = tokenizer.decode
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        cls = type(tokenizer)
        if cls.decode is PreTrainedTokenizerBase.decode and cls._decode is TokenizersBackend._decode \
                and not tokenizer.clean_up_tokenization_spaces:
            decode = tokenizer._tokenizer.decode
    except (ImportError, AttributeError):
        pass
    try:
        _decoders[tokenizer] = decode
    except TypeError:  # not weakly referable: looked up again next time
        pass
    return decode

def cut_at_stop(text: str, params: SamplingParams, finish_reason: Optional[FinishReason]) -> str:
    """Drop a matched stop string and everything after it (the stop token ids are dropped by decode)."""
    if finish_reason is not None and isinstance(finish_reason.matched, str):
        pos = text.find(finish_reason.matched)
        if pos >= 0:
            return text[:pos]
    return text


def decode_output(tokenizer, output_ids: list[int], params: SamplingParams,
                  finish_reason: Optional[FinishReason]) -> str:
    if tokenizer is None:
        return ""
    text = plain_decode(tokenizer)(output_ids, skip_special_tokens=params.skip_special_tokens)
    return cut_at_stop(text, params, finish_reason)
