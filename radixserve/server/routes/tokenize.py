"""Tokenizer endpoints, so clients count tokens the way the server does: vLLM's `/v1/tokenize` and
`/v1/detokenize`, and SGLang's `/tokenize` and `/detokenize` (the same tokenize answer; SGLang's
detokenize answers `text` where vLLM's answers `prompt`).

A `prompt` is tokenized as the completions endpoints tokenize it and `messages` as the chat
endpoint renders and tokenizes them (with `tools`, `tool_choice` and `chat_template_kwargs` as chat
takes them), so `count` equals the `usage.prompt_tokens` those would report. Long texts are
tokenized and decoded in the tokenizer thread pool, like everywhere else.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from fastapi import APIRouter

from radixserve.server.errors import CONFLICTING_FIELDS, bad_request
from radixserve.server.intake import MsgspecJSONRoute
from radixserve.server.protocol import DetokenizeBody, TokenizeBody
from radixserve.server.chat_prompt import chat_prompt_ids
from radixserve.server.serving import INLINE_TOKENIZE_CHARS, Ctx, ServingContext
from radixserve.server.tool_calls import tool_policy

router = APIRouter(route_class=MsgspecJSONRoute)
# Fields that shape a chat prompt: with `messages` only.
CHAT_ONLY_FIELDS = ("tools", "tool_choice", "chat_template_kwargs")


async def _tokens(ctx: ServingContext, body: TokenizeBody) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if body.messages is not None:  # as the chat endpoint tokenizes them: message text stays text
        # The tools (unless tool_choice is none) and template variables render as chat renders them.
        policy = tool_policy(body) if body.tools is not None or body.tool_choice is not None else None
        return await chat_prompt_ids(ctx, body, policy, add_special_tokens=body.add_special_tokens)
    for name in CHAT_ONLY_FIELDS:
        if getattr(body, name) is not None:
            raise bad_request(f"{name} shapes a chat prompt: it goes with messages, not prompt", name,
                              code=CONFLICTING_FIELDS)
    ids = await ctx.tokenize(body.prompt, "prompt")  # checks the length and that there is a tokenizer
    if body.add_special_tokens:  # the tokenizer's own additions (a BOS, for tokenizers with one)
        ids = await ctx.run_blocking(partial(ctx.tokenizer.encode, body.prompt, add_special_tokens=True))
    return ids


async def tokenize(body: TokenizeBody, ctx: Ctx) -> dict[str, Any]:
    ctx.check_model(body.model)
    ids = await _tokens(ctx, body)
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.context_len, "tokens": ids}
    if body.return_token_strs:
        answer["token_strs"] = ctx.tokenizer.convert_ids_to_tokens(ids)
    return answer


async def _detokenize(body: DetokenizeBody, ctx: ServingContext) -> str:
    ctx.check_model(body.model)
    if ctx.tokenizer is None:
        raise bad_request("the served model has no tokenizer", "tokens")
    if len(body.tokens) > ctx.context_len:  # no prompt or answer of this model is longer
        raise bad_request(f"{len(body.tokens)} tokens; detokenize takes at most this model's context length, "
                          f"{ctx.context_len}", "tokens", code="context_length_exceeded")
    vocab = ctx.engine.ready.vocab_size
    if body.tokens and max(body.tokens) >= vocab:
        raise bad_request(f"token id {max(body.tokens)} is outside the vocabulary [0, {vocab})", "tokens")
    if len(body.tokens) * 4 <= INLINE_TOKENIZE_CHARS:
        return ctx.tokenizer.decode(body.tokens)
    return await ctx.run_blocking(ctx.tokenizer.decode, body.tokens)


router.add_api_route("/v1/tokenize", tokenize, methods=["POST"])
router.add_api_route("/tokenize", tokenize, methods=["POST"])


@router.post("/v1/detokenize")
async def detokenize(body: DetokenizeBody, ctx: Ctx) -> dict[str, Any]:
    return {"prompt": await _detokenize(body, ctx)}


@router.post("/detokenize")
async def sglang_detokenize(body: DetokenizeBody, ctx: Ctx) -> dict[str, Any]:
    return {"text": await _detokenize(body, ctx)}
