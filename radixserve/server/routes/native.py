"""SGLang-native endpoints: `/generate`, `/get_model_info`, and `/tokenizer` (the served
tokenizer's files, for `radixserve.client.AsyncClient.tokenizer`)."""

from __future__ import annotations

import base64
import os
import time
from typing import Any, Optional

from fastapi import APIRouter, Request

from radixserve.grammar.spec import grammar_spec
from radixserve.sampling_params import SamplingParams
from radixserve.server.errors import CONFLICTING_FIELDS, APIError, bad_request
from radixserve.server.intake import MsgspecJSONRoute
from radixserve.server.logprob_format import TokenTexts, sglang_logprobs, sglang_prompt_logprobs
from radixserve.server.protocol import GenerateBody
from radixserve.server.responses import per_output, run_request
from radixserve.server.serving import SSE_DONE, Ctx, ServingContext, Tracker, new_id, request_label, sse
from radixserve.server.structured import check_request_grammar

router = APIRouter(route_class=MsgspecJSONRoute)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "chat_template.jinja", "chat_template.json", "added_tokens.json",
                   "tokenizer.model", "generation_config.json",
                   # AutoTokenizer picks the tokenizer class (and its pre-tokenizer) from config.json's
                   # model_type; without it a client would tokenize differently from the server.
                   "config.json")


def meta_info(t: Tracker, logprob_texts: Optional[TokenTexts] = None) -> dict[str, Any]:
    info = {"id": t.label or t.rid, "finish_reason": None if t.finish_reason is None else t.finish_reason.as_dict(),
            "prompt_tokens": t.prompt_tokens or len(t.input_ids),
            "completion_tokens": t.completion_tokens, "cached_tokens": t.cached_tokens,
            "e2e_latency": t.e2e_latency}
    if t.params.return_logprob:
        info.update(sglang_logprobs(logprob_texts, t.output_ids, t.logprobs))
    if t.params.wants_prompt_logprobs:
        info.update(sglang_prompt_logprobs(logprob_texts, t.input_ids, t.params.logprob_start_len, t.input_logprobs))
    return info


async def generate_prompts(ctx: ServingContext, body: GenerateBody) -> tuple[list[list[int]], bool, str]:
    """The prompts as token ids, whether the body held a single prompt, and the field they came from."""
    if (body.text is None) == (body.input_ids is None):
        raise bad_request("give exactly one of text or input_ids", "text")
    if body.text is not None:
        single = isinstance(body.text, str)
        texts = [body.text] if single else list(body.text)
        ctx.check_sequences(len(texts), 1, "text")
        return [await ctx.tokenize(x, "text") for x in texts], single, "text"
    ids = body.input_ids
    single = not ids or isinstance(ids[0], int)
    ctx.check_sequences(1 if single else len(ids), 1, "input_ids")
    return ([list(ids)] if single else [list(x) for x in ids]), single, "input_ids"


def generate_params(ctx: ServingContext, body: GenerateBody, prompts: list[list[int]],
                    param: str) -> list[list[SamplingParams]]:
    sp = body.sampling_params
    if isinstance(sp, list):
        if len(sp) != len(prompts):
            raise bad_request(f"{len(sp)} sampling_params for {len(prompts)} prompts", "sampling_params",
                              code=CONFLICTING_FIELDS)
        sp_list = [p.values() for p in sp]
    else:
        sp_list = [sp.values() if sp is not None else {}] * len(prompts)
    logprob_values: dict[str, Any] = {}
    start = body.logprob_start_len if body.logprob_start_len is not None else -1
    if body.return_logprob:
        logprob_values = {"return_logprob": True, "top_logprobs_num": body.top_logprobs_num or 0,
                          "logprob_start_len": start}
    elif body.top_logprobs_num:
        raise bad_request("top_logprobs_num needs return_logprob: true", "top_logprobs_num", code=CONFLICTING_FIELDS)
    elif start != -1:
        raise bad_request("logprob_start_len needs return_logprob: true", "logprob_start_len",
                          code=CONFLICTING_FIELDS)
    params_per_prompt: list[list[SamplingParams]] = []
    for ids, values in zip(prompts, sp_list):
        ctx.check_prompt(ids, param)
        if start >= len(ids):
            raise bad_request(f"logprob_start_len={start} is not a position of the prompt's {len(ids)} tokens",
                              "logprob_start_len", code=CONFLICTING_FIELDS)
        if "logit_bias" in values:
            values = {**values, "logit_bias": ctx.logit_bias(values["logit_bias"], "sampling_params.logit_bias")}
        params = ctx.sampling_params({**values, **logprob_values})
        ctx.max_new_tokens(ids, params.max_new_tokens, "sampling_params.max_new_tokens")
        params_per_prompt.append([params])
    return params_per_prompt


@router.post("/generate")
async def generate(body: GenerateBody, request: Request, ctx: Ctx):
    arrival = time.perf_counter()
    label = request_label(body.rid)
    prompts, single, param = await generate_prompts(ctx, body)
    if not prompts:
        raise bad_request("the batch is empty", param)
    params_per_prompt = generate_params(ctx, body, prompts, param)
    for params in {id(p): p for ps in params_per_prompt for p in ps}.values():
        spec = grammar_spec(params)
        if spec is not None:
            await check_request_grammar(ctx, params, f"sampling_params.{spec[0]}")
    # The engine's id is always made here: a client's rid is a label, echoed back and logged.
    trackers = ctx.new_trackers(prompts, params_per_prompt, new_id(""), arrival, label if single else None,
                                logprob_fields="top_logprobs_num, logprob_start_len, the batch, max_new_tokens",
                                cache_namespace=ctx.cache_namespace(body.cache_salt, request))
    texts = ctx.token_texts if body.return_text_in_logprobs else None

    def final(ts: list[Tracker]):
        results = [{"text": t.text, "output_ids": t.output_ids, "meta_info": meta_info(t, texts)} for t in ts]
        return results[0] if single else results

    async def stream(outputs, close):
        async for t, out, delta in per_output(ctx, outputs, trackers):
            event = {"text": t.text, "output_ids": t.output_ids, "meta_info": meta_info(t, texts)}
            if not single:  # a batch streams its prompts' events interleaved, each with its index
                event["index"] = t.index
            yield sse(event)
        close()
        yield SSE_DONE

    return await run_request(ctx, request, trackers, body.stream, final, stream)


@router.get("/get_model_info")
async def get_model_info(ctx: Ctx):
    return {"model_path": ctx.model_path, "tokenizer_path": ctx.settings.tokenizer_path or ctx.model_path,
            "served_model_name": ctx.served_model_name, "is_generation": True}


@router.get("/tokenizer")
async def tokenizer_files(ctx: Ctx):
    """The served tokenizer's files (base64), for clients that need `apply_chat_template`."""
    root = ctx.settings.tokenizer_path or ctx.model_path
    files = {}
    for name in TOKENIZER_FILES:
        path = os.path.join(root, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                files[name] = base64.b64encode(f.read()).decode()
    if not files:
        raise APIError(404, "the served model has no tokenizer files", code="tokenizer_not_found")
    return {"model": ctx.served_model_name, "files": files}
