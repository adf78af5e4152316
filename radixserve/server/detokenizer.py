"""Incremental detokenization for streaming, in the API process.

Each step decodes only a short window of recent tokens (the window starts at the last point where
text was emitted), so a long output costs linear, not quadratic, time. Text that ends in a partial
UTF-8 character is held back until the character completes, and so is a tail that could still
become a stop string. At the end the full text is decoded the same way as the offline engine does
(`decode_output`), so the streamed pieces add up to the non-streamed answer.
"""

from __future__ import annotations

from typing import Optional

from radixserve.engine.detokenize import decode_output, plain_decode
from radixserve.sampling_params import FinishReason, SamplingParams

REPLACEMENT_CHAR = "\ufffd"

class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self._plain_decode = plain_decode(tokenizer) if tokenizer is not None else None
        self.ids: list[int] = []
        self.text = ""  # decoded so far (before the stop-string hold-back)
        self.sent = ""  # handed to the caller so far
        self._prefix_offset = 0
        self._read_offset = 0
        self._holdback = max((len(s) for s in params.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self._plain_decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        """Take new token ids; return the text that can be shown now (may be empty)."""
        if self.tokenizer is None or not new_ids:
            self.ids.extend(new_ids)
            return ""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
            self.text += full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
        visible = self.text[:len(self.text) - self._holdback] if self._holdback else self.text
        if len(visible) <= len(self.sent) or not visible.startswith(self.sent):
            return ""
        delta = visible[len(self.sent):]
        self.sent = visible
        return delta

    def finish(self, finish_reason: Optional[FinishReason]) -> str:
        """The rest of the text once the request finished; `self.sent` is then the whole answer."""
        final = decode_output(self.tokenizer, self.ids, self.params, finish_reason)
        delta = final[len(self.sent):] if final.startswith(self.sent) else final[len(self.sent):]
        self.sent = final
        return delta
