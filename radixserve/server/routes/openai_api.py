"""OpenAI-compatible endpoints: `/v1/completions`, `/v1/chat/completions`, `/v1/models`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

from fastapi import APIRouter, Request

from radixserve.sampling_params import SamplingParams
from radixserve.server.chat_prompt import chat_prompt_ids, system_turn_end, template_reads
from radixserve.server.errors import CONFLICTING_FIELDS, APIError, bad_request
from radixserve.server.intake import MsgspecJSONRoute
from radixserve.server.logprob_format import chat_logprobs, completion_logprobs, completion_prompt_logprobs
from radixserve.server.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.server.reasoning import ReasoningFormat, ReasoningStream, split_reasoning
from radixserve.server.responses import per_output, run_request, usage
from radixserve.server.serving import SSE_DONE, Ctx, ServingContext, Tracker, finish_reason_name, new_id, sse
from radixserve.server.structured import check_request_grammar, response_format_constrains, response_format_grammar
from radixserve.server.tool_calls import ToolCallStream, ToolPolicy, forced_call_grammar, parse_tool_calls, tool_policy
from radixserve.validation import choice_seed

router = APIRouter(route_class=MsgspecJSONRoute)


def check_neutral(body, name: str, ok: Callable[[Any], bool], why: str) -> None:
    value = getattr(body, name, None)
    if value is not None and not ok(value):
        raise APIError(400, f"{name}={value!r} is not supported: {why}", param=name, code="unsupported_parameter")


def _never(value: Any) -> bool:
    return False


# (field, accepted values, why others are refused) of the chat fields SDKs send that the server
# accepts only where they cannot change the output; the schema of each field says the same.
CHAT_NEUTRAL_VALUES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("store", lambda v: v is False, "completions are not stored by this server"),
    ("verbosity", lambda v: v == "medium", "the served model has no verbosity control (only medium)"),
    ("reasoning_effort", lambda v: v == "none", "the served model does not reason (only none)"),
    ("modalities", lambda v: all(m == "text" for m in v), "only text output is served"),
    ("audio", _never, "audio output is not implemented"),
    ("prediction", _never, "predicted outputs are not implemented"),
    ("functions", _never, "the deprecated functions field is not served; use tools"),
    ("function_call", _never, "the deprecated function_call field is not served; use tool_choice"),
)


def openai_params(body, max_tokens: int, seed_offset: int, top_logprobs: Optional[int] = None,
                  logit_bias: Optional[dict[int, float]] = None, prompt_logprobs: bool = False) -> dict[str, Any]:
    """The engine's sampling values of one choice; top_logprobs None: no log probabilities;
    logit_bias: the body's, its keys already checked as token ids; prompt_logprobs: those of the
    whole prompt too (echo)."""
    values: dict[str, Any] = {"max_new_tokens": max_tokens,
                              "temperature": 1.0 if body.temperature is None else body.temperature,
                              "ignore_eos": body.ignore_eos, "skip_special_tokens": body.skip_special_tokens,
                              "logit_bias": logit_bias or {}}
    for name in ("top_p", "top_k", "min_p", "stop_token_ids", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if getattr(body, name) is not None:
            values[name] = getattr(body, name)
    if body.min_tokens is not None:
        if body.min_tokens > max_tokens:
            raise bad_request(f"min_tokens={body.min_tokens} is more than the {max_tokens} tokens this request "
                              f"may generate", "min_tokens", code=CONFLICTING_FIELDS)
        values["min_new_tokens"] = body.min_tokens
    if top_logprobs is not None:
        values["return_logprob"] = True
        values["top_logprobs_num"] = top_logprobs
        if prompt_logprobs:
            values["logprob_start_len"] = 0
    if body.stop is not None:
        values["stop"] = [body.stop] if isinstance(body.stop, str) else list(body.stop)
    if body.seed is not None:
        # Each of the n choices gets its own stream of random numbers, reproducibly.
        values["seed"] = choice_seed(body.seed, seed_offset)
    return values


def build_choices(ctx: ServingContext, body, prompts: list[list[int]], param: str, max_tokens: Optional[int],
                  max_param: str, top_logprobs: Optional[int],
                  grammar: Optional[tuple[str, str]] = None, prompt_logprobs: bool = False,
                  grammar_after_reasoning: bool = False) -> list[list[SamplingParams]]:
    """grammar: (kind, text) every choice's output is constrained by (see radixserve.grammar), from
    the end of the reply's reasoning on with grammar_after_reasoning; prompt_logprobs: the
    prompt's log probabilities too (completions' echo with logprobs)."""
    extra: dict[str, Any] = {grammar[0]: grammar[1]} if grammar is not None else {}
    if grammar is not None and grammar_after_reasoning:
        extra["grammar_after_reasoning"] = True
    out = []
    bias = ctx.logit_bias(body.logit_bias, "logit_bias")
    for ids in prompts:
        ctx.check_prompt(ids, param)
        mnt = ctx.max_new_tokens(ids, max_tokens, max_param)
        out.append([ctx.sampling_params({**openai_params(body, mnt, j, top_logprobs, bias, prompt_logprobs), **extra},
                                        "")
                    for j in range(body.n)])
    return out


async def checked_grammar(ctx: ServingContext, grammar: Optional[tuple[str, str]], param: str) -> None:
    """400 naming the problem when the request's grammar does not compile."""
    if grammar is not None:
        await check_request_grammar(ctx, SamplingParams(**{grammar[0]: grammar[1]}), param)


async def completion_prompts(ctx: ServingContext, body: CompletionRequest) -> tuple[list[Optional[str]], list[list[int]]]:
    """The prompts' texts (None for token-id prompts) and token ids."""
    p = body.prompt
    if isinstance(p, str):
        return [p], [await ctx.tokenize(p, "prompt")]
    if not p:
        raise bad_request("the prompt is empty", "prompt")
    ctx.check_sequences(1 if isinstance(p[0], int) else len(p), body.n, "prompt")
    if isinstance(p[0], str):
        return list(p), [await ctx.tokenize(x, "prompt") for x in p]
    if isinstance(p[0], int):
        return [None], [list(p)]
    return [None] * len(p), [list(x) for x in p]


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, ctx: Ctx):
    arrival = time.perf_counter()
    ctx.check_model(body.model)
    check_neutral(body, "suffix", lambda v: v == "", "insertion is not implemented")
    check_neutral(body, "best_of", lambda v: v in (1, body.n), "only best_of == n")
    grammar = response_format_grammar(body.response_format)
    await checked_grammar(ctx, grammar, "response_format")
    # max_tokens 0 with echo scores the prompt: the engine generates one token (it runs a prompt
    # to produce one), which the answer leaves out.
    scoring = body.max_tokens == 0
    if scoring and not body.echo:
        raise bad_request("max_tokens=0 generates nothing; it is allowed only with echo: true (scoring the prompt)",
                          "max_tokens", code=CONFLICTING_FIELDS)
    if scoring and body.min_tokens:
        raise bad_request(f"min_tokens={body.min_tokens} is more than the 0 tokens this request may generate",
                          "min_tokens", code=CONFLICTING_FIELDS)
    texts, prompts = await completion_prompts(ctx, body)
    echo_logprobs = body.echo and body.logprobs is not None
    choices = build_choices(ctx, body, prompts, "prompt", 1 if scoring else body.max_tokens, "max_tokens",
                            body.logprobs, grammar, prompt_logprobs=echo_logprobs)
    if body.echo and ctx.tokenizer is not None:  # token-id prompts echo as their text
        texts = [t if t is not None else await ctx.run_blocking(ctx.tokenizer.decode, ids)
                 for t, ids in zip(texts, prompts)]
    cid = new_id("cmpl-")
    trackers = ctx.new_trackers(prompts, choices, cid, arrival, logprob_fields="logprobs, n, max_tokens, echo",
                                cache_namespace=ctx.cache_namespace(body.cache_salt, request))
    model = ctx.served_model_name

    def echo_text(t: Tracker) -> str:
        return (texts[t.prompt_index] or "") if body.echo else ""

    def logprobs_of(t: Tracker, token_ids: list[int], logprobs: list, with_prompt: bool) -> Optional[dict]:
        """with_prompt: the echoed prompt's entries come first (the first chunk or the whole reply)."""
        if body.logprobs is None:
            return None
        result = completion_logprobs(ctx.token_texts, token_ids, logprobs, t.logprob_text_offset)
        if echo_logprobs and with_prompt:
            head = completion_prompt_logprobs(ctx.token_texts, t.input_ids, t.input_logprobs)
            shift = sum(len(token) for token in head["tokens"])
            result = {key: head[key] + (result[key] if key != "text_offset" else [o + shift for o in result[key]])
                      for key in result}
        t.logprob_text_offset += sum(len(token) for token in result["tokens"])
        return result

    def finish_name(t: Tracker) -> Optional[str]:
        return "length" if scoring and t.finished else finish_reason_name(t.finish_reason)

    def usage_of(ts: list[Tracker]) -> dict[str, Any]:
        counts = usage(ts)
        if scoring:
            counts["completion_tokens"], counts["total_tokens"] = 0, counts["prompt_tokens"]
        return counts

    def final(ts: list[Tracker]):
        return {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": [{"index": t.index, "text": echo_text(t) + ("" if scoring else t.text),
                             "logprobs": logprobs_of(t, [] if scoring else t.output_ids,
                                                     [] if scoring else t.logprobs, True),
                             "finish_reason": finish_name(t)} for t in ts],
                "usage": usage_of(ts)}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(choices_: list[dict]) -> bytes:
        data = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices_}
        if include_usage:
            data["usage"] = None
        return sse(data)

    async def stream(outputs, close):
        echoed: set[str] = set()
        async for t, out, delta in per_output(ctx, outputs, trackers):
            new_ids, new_logprobs = out.new_token_ids, out.new_logprobs
            if scoring:
                delta, new_ids, new_logprobs = "", [], []
            first = t.rid not in echoed
            if first:
                echoed.add(t.rid)
                delta = echo_text(t) + delta
            if delta or t.finished or new_logprobs or (first and echo_logprobs):
                yield chunk([{"index": t.index, "text": delta,
                              "logprobs": logprobs_of(t, new_ids, new_logprobs, first),
                              "finish_reason": finish_name(t)}])
        close()
        if include_usage:
            yield sse({"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
                       "choices": [], "usage": usage_of(trackers)})
        yield SSE_DONE

    return await run_request(ctx, request, trackers, body.stream, final, stream)


def chat_top_logprobs(body: ChatCompletionRequest) -> Optional[int]:
    """How many top entries per position to report, or None for no log probabilities."""
    if not body.logprobs:
        if body.top_logprobs:  # 0 asks for nothing either way
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs", code=CONFLICTING_FIELDS)
        return None
    return body.top_logprobs or 0


def thinking_off(ctx: ServingContext, body: ChatCompletionRequest) -> None:
    """reasoning_effort on a reasoning model: Qwen3 has no effort levels, only thinking on or off,
    so "none" is the template's enable_thinking false and any other value is refused by name."""
    if body.reasoning_effort != "none":
        raise APIError(400, f"reasoning_effort={body.reasoning_effort!r} is not supported: the served model "
                            "reasons or does not (leave reasoning_effort out, or give none), with no effort levels",
                       param="reasoning_effort", code="unsupported_parameter")
    if not template_reads(ctx.tokenizer, "enable_thinking"):
        raise APIError(400, "reasoning_effort=none is not supported: the served chat template has no "
                            "enable_thinking switch", param="reasoning_effort", code="unsupported_parameter")
    kwargs = dict(body.chat_template_kwargs or {})
    if kwargs.setdefault("enable_thinking", False) is not False:
        raise bad_request("reasoning_effort none and chat_template_kwargs.enable_thinking true disagree",
                          "reasoning_effort", code=CONFLICTING_FIELDS)
    body.chat_template_kwargs = kwargs


def chat_grammar_field(body: ChatCompletionRequest, policy: ToolPolicy) -> Optional[str]:
    """The field whose grammar constrains the reply, or None; 400 when two would."""
    fields = [name for name, on in (("tools", policy.forced),
                                    ("response_format", response_format_constrains(body.response_format)),
                                    ("regex", body.regex is not None), ("ebnf", body.ebnf is not None)) if on]
    if len(fields) > 1:
        raise bad_request(f"{fields[0]} and {fields[1]} both constrain the reply; give one", fields[1],
                          code=CONFLICTING_FIELDS)
    return fields[0] if fields else None


def chat_grammar(body: ChatCompletionRequest, policy: ToolPolicy) -> Optional[tuple[str, str]]:
    """The grammar of the reply: a forced tool call's, SGLang's regex or ebnf, the response_format's,
    or None."""
    if policy.forced:
        return forced_call_grammar(policy)
    if body.regex is not None:
        return "regex", body.regex
    if body.ebnf is not None:
        return "ebnf", body.ebnf
    return response_format_grammar(body.response_format)


@dataclass(frozen=True)
class ReplyFormat:
    """How a chat reply's text becomes its message: the reasoning split off (its format, and
    whether the reply starts inside it), then tool calls parsed from the content."""

    policy: ToolPolicy
    reasoning: Optional[ReasoningFormat] = None  # None: no reasoning split (no parser, or separate_reasoning false)
    in_reasoning: bool = False  # the prompt opened <think>: the reply starts inside the reasoning


def chat_message(t: Tracker, reply: ReplyFormat) -> tuple[dict[str, Any], Optional[str]]:
    """The reply of a finished choice and its finish_reason (reasoning split off and tool calls
    parsed when those are on)."""
    reason = finish_reason_name(t.finish_reason)
    policy = reply.policy
    message: dict[str, Any] = {"role": "assistant"}
    text = t.text
    if reply.reasoning is not None:
        message["reasoning_content"], text = split_reasoning(text, reply.reasoning, reply.in_reasoning)
    if not policy.parses:
        # A reply that is all reasoning (cut off inside it, or a grammar's) has no content: null.
        message["content"] = text if text or message.get("reasoning_content") is None else None
        return message, reason
    content, calls = parse_tool_calls(text, policy.parallel, names=policy.names, forced=policy.forced,
                                      cut_off=reason == "length")
    message["content"] = content
    if calls:
        message["tool_calls"] = calls
        reason = "tool_calls" if reason == "stop" else reason
    return message, reason


def chat_usage(ctx: ServingContext, ts: list[Tracker], in_reasoning: bool) -> dict[str, Any]:
    """usage, with the reasoning tokens among the completion tokens when a reasoning parser runs
    (OpenAI's and vLLM's completion_tokens_details.reasoning_tokens)."""
    counts = usage(ts)
    if ctx.reasoning is not None:
        counts["completion_tokens_details"] = {
            "reasoning_tokens": sum(ctx.reasoning.reasoning_tokens(t.output_ids, in_reasoning) for t in ts)}
    return counts


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, ctx: Ctx):
    arrival = time.perf_counter()
    ctx.check_model(body.model)
    for name, ok, why in CHAT_NEUTRAL_VALUES:
        if name != "reasoning_effort" or ctx.reasoning is None:
            check_neutral(body, name, ok, why)
    if ctx.reasoning is not None and body.reasoning_effort is not None:
        thinking_off(ctx, body)
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise bad_request("max_tokens and max_completion_tokens disagree", "max_completion_tokens",
                          code=CONFLICTING_FIELDS)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    policy = tool_policy(body)
    grammar_field = chat_grammar_field(body, policy)
    # A forced call's grammar is built from every tool's schema (up to the schema size limit, ~50 ms):
    # off the event loop, as the grammar check after it is.
    grammar = await ctx.run_blocking(chat_grammar, body, policy) if policy.forced else chat_grammar(body, policy)
    await checked_grammar(ctx, grammar, grammar_field or "response_format")
    ids = await chat_prompt_ids(ctx, body, policy)
    hints: tuple[int, ...] = ()
    if ctx.engine.ready is not None and ctx.engine.ready.keeps_branch_states:
        # A ChatML prompt's system turn is read from its tokens; another template's system
        # messages are rendered alone to find where it ends.
        end = ctx.system_turns.end_of(ids) if ctx.system_turns is not None else None
        if end is None:
            end = await system_turn_end(ctx, body, ids, policy)
        hints = (end,) if end is not None else ()
    in_reasoning = ctx.reasoning is not None and ctx.reasoning.starts_in_reasoning(ids)
    reply = ReplyFormat(policy, ctx.reasoning if body.separate_reasoning else None, in_reasoning)
    top_logprobs = chat_top_logprobs(body)
    # The grammar holds the content: behind the reasoning when the reply's reasoning is split off
    # from it (radixserve.grammar.reasoning_gate), over the whole reply when it is not.
    after_reasoning = reply.reasoning is not None and not ctx.settings.grammar_in_reasoning
    choices = build_choices(ctx, body, [ids], "messages", max_tokens,
                            "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
                            top_logprobs, grammar, grammar_after_reasoning=after_reasoning)
    cid = new_id("chatcmpl-")
    trackers = ctx.new_trackers([ids], choices, cid, arrival, logprob_fields="top_logprobs, n, max_tokens",
                                cache_namespace=ctx.cache_namespace(body.cache_salt, request), branch_hints=hints)
    model = ctx.served_model_name

    def logprobs_of(token_ids: list[int], logprobs: list) -> Optional[dict]:
        return None if top_logprobs is None else chat_logprobs(ctx.token_texts, token_ids, logprobs)

    def final(ts: list[Tracker]):
        replies = [chat_message(t, reply) for t in ts]
        return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": [{"index": t.index, "message": message,
                             "logprobs": logprobs_of(t.output_ids, t.logprobs), "finish_reason": reason}
                            for t, (message, reason) in zip(ts, replies)],
                "usage": chat_usage(ctx, ts, in_reasoning)}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(index: int, delta: dict, finish: Optional[str], logprobs: Optional[dict] = None) -> bytes:
        data = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            data["usage"] = None
        return sse(data)

    async def stream(outputs, close):
        tool_streams = {t.rid: ToolCallStream(policy.parallel, policy.forced, policy.names)
                        for t in trackers} if policy.parses else {}
        reasoning_streams = {t.rid: ReasoningStream(reply.reasoning, in_reasoning)
                             for t in trackers} if reply.reasoning is not None else {}
        for t in trackers:
            yield chunk(t.index, {"role": "assistant", "content": ""}, None)
        async for t, out, delta in per_output(ctx, outputs, trackers):
            thought = ""
            thinking = reasoning_streams.get(t.rid)
            if thinking is not None:
                thought, delta = thinking.feed(delta)
                if t.finished:  # what it held back (a partial tag, trailing newlines) is decided now
                    rest_thought, rest = thinking.finish()
                    thought, delta = thought + rest_thought, delta + rest
            tools = tool_streams.get(t.rid)
            calls: list[dict] = []
            if tools is not None:
                delta, calls = tools.feed(delta)
            logprobs = logprobs_of(out.new_token_ids, out.new_logprobs) if out.new_logprobs else None
            if thought:
                yield chunk(t.index, {"reasoning_content": thought}, None, logprobs)
                logprobs = None
            if delta or logprobs is not None:
                yield chunk(t.index, {"content": delta}, None, logprobs)
            first = tools.num_calls - len(calls) if tools is not None else 0
            for i, call in enumerate(calls):  # each call as its block closes: id, name, arguments at once
                yield chunk(t.index, {"tool_calls": [{"index": first + i, **call}]}, None)
            if t.finished:
                for event in finish_chunks(t, tools):
                    yield chunk(t.index, *event)
        close()
        if include_usage:
            yield sse({"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                       "model": model, "choices": [], "usage": chat_usage(ctx, trackers, in_reasoning)})
        yield SSE_DONE

    return await run_request(ctx, request, trackers, body.stream, final, stream)


def finish_chunks(t: Tracker, tools: Optional[ToolCallStream]) -> list[tuple[dict, Optional[str]]]:
    """The last deltas of a streamed choice: text held back, a call that max_tokens cut off after
    its JSON was complete (as the whole reply has it), then the finish reason."""
    reason = finish_reason_name(t.finish_reason)
    if tools is None:
        return [({}, reason)]
    cut_off = reason == "length"
    calls = tools.finish_calls(cut_off)
    rest = tools.finish(cut_off)
    events: list[tuple[dict, Optional[str]]] = [({"content": rest}, None)] if rest else []
    first = tools.num_calls - len(calls)
    events += [({"tool_calls": [{"index": first + i, **call}]}, None) for i, call in enumerate(calls)]
    return events + [({}, "tool_calls" if tools.num_calls and reason == "stop" else reason)]


@router.get("/v1/models")
async def models(ctx: Ctx):
    ready = ctx.engine.ready
    return {"object": "list", "data": [{"id": ctx.served_model_name, "object": "model", "created": ctx.created,
                                        "owned_by": "radixserve", "root": ctx.model_path,
                                        "max_model_len": ready.context_len if ready else None}]}
