"""Closed-loop multi-turn sessions: each turn extends what the server really returned.

With `--agent-closed-loop`, turn k of a session (k >= 1) is sent, as token ids, as

    prompt of turn k-1 (as sent) + the output tokens the server returned for it + turn_suffix_ids

where `turn_suffix_ids` is the end of that reply and the new user message as the chat template
renders them (radixserve/bench/datasets.py). The prompt is then an exact token extension of what
the server just computed, so a server that caches decoded tokens can match the whole previous turn
(all but its last output token, whose KV was never computed), as a real multi-turn client would get.
The oracles are computed over these prompts, the ones actually sent.

Output tokens come from the response's `output_ids` (`/generate`); a backend that returns only
text has it re-encoded with the benchmark's tokenizer (exact only where the text round-trips). A
turn whose previous turn failed extends the previous prompt with no output.
"""

from __future__ import annotations

from typing import Optional

from radixserve.bench.client import RequestResult
from radixserve.bench.datasets import BenchRequest


def returned_tokens(result: Optional[RequestResult], tokenizer=None) -> list[int]:
    if result is None or not result.success:
        return []
    if result.output_ids is not None:
        return list(result.output_ids)
    if tokenizer is not None and result.output_text:
        return list(tokenizer.encode(result.output_text, add_special_tokens=False))
    return []


def extend_turn(req: BenchRequest, previous: BenchRequest, previous_result: Optional[RequestResult],
                tokenizer=None) -> None:
    """Make `req`'s prompt the previous turn's prompt + its returned output + the new user turn."""
    if req.turn_suffix_ids is None:
        raise ValueError("a closed-loop turn needs turn_suffix_ids (the agent dataset sets them)")
    req.prompt_ids = list(previous.prompt_ids) + returned_tokens(previous_result, tokenizer) + req.turn_suffix_ids
    req.prompt_text = None  # sent as token ids
