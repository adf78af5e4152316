"""Log probabilities in each API's response shape.

The engine reports, per output token, its log probability and its request's `top_logprobs_num`
most likely ids with theirs (`TokenLogprob`); these functions spell them the way OpenAI's
completions and chat APIs and SGLang's `/generate` do. Token text is each id decoded on its own
(a token that is part of a multi-byte character decodes to U+FFFD, as in vLLM); with no tokenizer
a token is spelled `token_id:N`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from radixserve.sampling_params import TokenLogprob

# Decoded single tokens kept per process (a vocabulary's worth at most).
_TOKEN_TEXT_CACHE_MAX = 1 << 18


class TokenTexts:
    """Each token id's text on its own, decoded once."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < _TOKEN_TEXT_CACHE_MAX:
                self._cache[token_id] = text
        return text


def _finite(value: float) -> float:
    # JSON has no -Infinity: a token the model gives no chance at all gets the lowest float.
    return value if value > -1e38 else -9999.0


def completion_logprobs(texts: TokenTexts, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob],
                        text_offset: int) -> dict[str, Any]:
    """The completions API's `logprobs` object for these tokens; offsets start at `text_offset`."""
    tokens = [texts(t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
            "top_logprobs": [_top_by_text(texts, lp) for lp in logprobs], "text_offset": offsets}


def _top_by_text(texts: TokenTexts, lp: TokenLogprob) -> dict[str, float]:
    # Keyed by text: ids that decode alike (pieces of multi-byte characters) keep the likeliest.
    top: dict[str, float] = {}
    for token_id, value in zip(lp.top_ids, lp.top_logprobs):
        top.setdefault(texts(token_id), _finite(value))
    return top


def _chat_entry(texts: TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    text = texts(token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}


def chat_logprobs(texts: TokenTexts, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat API's `choices[].logprobs` object for these tokens."""
    content = []
    for token_id, lp in zip(token_ids, logprobs):
        entry = _chat_entry(texts, token_id, lp.logprob)
        entry["top_logprobs"] = [_chat_entry(texts, i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)]
        content.append(entry)
    return {"content": content, "refusal": None}


def sglang_logprobs(texts: Optional[TokenTexts], token_ids: Sequence[int],
                    logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """`/generate`'s meta_info fields: [logprob, token id, text or None] triples per output token,
    and per position the list of its top entries; texts only when `texts` is given."""
    def triple(value: float, token_id: int) -> list:
        return [_finite(value), token_id, texts(token_id) if texts is not None else None]

    return {"output_token_logprobs": [triple(lp.logprob, t) for t, lp in zip(token_ids, logprobs)],
            "output_top_logprobs": [[triple(v, i) for v, i in zip(lp.top_logprobs, lp.top_ids)] for lp in logprobs]}


def sglang_prompt_logprobs(texts: Optional[TokenTexts], prompt_ids: Sequence[int], start: int,
                           logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """`/generate`'s prompt fields: a triple per prompt token from `start` on, the first token of
    the prompt with a null log probability (nothing comes before it), and per token its top
    entries (null for the first)."""
    def triple(value: Optional[float], token_id: int) -> list:
        return [None if value is None else _finite(value), token_id, texts(token_id) if texts is not None else None]

    head = [triple(None, prompt_ids[0])] if start == 0 else []
    top_head: list = [None] if start == 0 else []
    scored = prompt_ids[max(start, 1):]
    return {"input_token_logprobs": head + [triple(lp.logprob, t) for t, lp in zip(scored, logprobs)],
            "input_top_logprobs": top_head + [[triple(v, i) for v, i in zip(lp.top_logprobs, lp.top_ids)]
                                              for lp in logprobs]}


def completion_prompt_logprobs(texts: TokenTexts, prompt_ids: Sequence[int],
                               logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The completions API's `logprobs` object for an echoed prompt (offsets from 0): the first
    token's log probability and top entries are null."""
    result = completion_logprobs(texts, prompt_ids, [], 0)
    result["token_logprobs"] = [None] + [_finite(lp.logprob) for lp in logprobs]
    result["top_logprobs"] = [None] + [_top_by_text(texts, lp) for lp in logprobs]
    return result
