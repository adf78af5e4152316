"""Request bodies of the HTTP API: pydantic models that are also the OpenAPI schema.

Strict, so the schema allows exactly what the server accepts: no numeric strings or bools coerced
into numbers (`max_tokens: "10"`, `max_tokens: true`, `stream: "yes"` are 400), finite floats only,
ranges as OpenAI documents them and as `radixserve.validation` enforces for the engine. A field the
server does not implement is refused by name (400 `unsupported_parameter`): unknown fields are
forbidden, and a field accepted only at some values (`best_of` equal to `n`, an empty `suffix`)
says so in its schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

import msgspec
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidatorFunctionWrapHandler, \
    WrapValidator

from radixserve.cache.namespace import MAX_CACHE_SALT_CHARS
from radixserve.validation import (LOGIT_BIAS_MAX, MAX_INT32, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                                   MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, PENALTY_MAX, REPETITION_PENALTY_MIN, SEED_MAX,
                                   SEED_MIN, TEMPERATURE_MAX, TOP_K_MIN)



def _encodable(text: str) -> str:
    # A lone surrogate ("\ud800" in JSON) is valid JSON but no text: the tokenizer cannot take it.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text cannot be encoded as UTF-8 ({e.reason} at position {e.start})") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]


def _integral(value: Any) -> Any:
    # JSON Schema counts 3.0 as an integer; strict pydantic would not. Strings and bools stay refused.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def bounded_int(ge: int, le: int) -> Any:
    """An integer in [ge, le]; the bounds sit inside the type so the schema shows them."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]
# A token id; the served model's vocabulary bounds it further (`openapi_for_model` writes that bound
# into the served schema).
TOKEN_ID_SCHEMA_MARK = "x-radixserve-token-id"
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32, json_schema_extra={TOKEN_ID_SCHEMA_MARK: True}),
                    BeforeValidator(_integral)]
_PLAIN_TOKEN_IDS = list[Annotated[int, msgspec.Meta(ge=0, le=MAX_INT32)]]


def _token_ids(value: Any, validate: ValidatorFunctionWrapHandler) -> Any:
    # A prompt of thousands of ids validated id by id (a Python call each) cost ~0.3 ms a request, all
    # of it on the event loop; msgspec checks a plain non-empty list of in-range ints in C (bools and
    # floats refused). Anything else goes through the full validation, which words the error.
    if type(value) is list and value:
        try:
            return msgspec.convert(value, _PLAIN_TOKEN_IDS, strict=True)
        except msgspec.ValidationError:
            pass
    return validate(value)


TokenIds = Annotated[list[TokenId], Field(min_length=1), WrapValidator(_token_ids)]
# chat_template_kwargs: the served schema names the variables the served template lets a request set.
TEMPLATE_VARIABLES_SCHEMA_MARK = "x-radixserve-template-variables"
# An output length; the served schema bounds it by what the context leaves a one-token prompt.
OUTPUT_TOKENS_SCHEMA_MARK = "x-radixserve-output-tokens"
_OUTPUT_TOKENS = {OUTPUT_TOKENS_SCHEMA_MARK: True}
# A stop token need not be in the vocabulary (it then never matches).
StopTokenId = Annotated[int, Field(ge=0, le=MAX_INT32), BeforeValidator(_integral)]
StopTokenIds = Annotated[list[StopTokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]
# A map keyed by token ids spelled as decimal strings (OpenAI's logit_bias); the served schema
# bounds the keys by the vocabulary with a pattern.
TOKEN_ID_KEYS_SCHEMA_MARK = "x-radixserve-token-id-keys"
LogitBias = Annotated[dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX)]],
                      Field(json_schema_extra={TOKEN_ID_KEYS_SCHEMA_MARK: True,
                                               "propertyNames": {"pattern": "^(0|[1-9][0-9]{0,9})$"}})]
Penalty = Annotated[float, Field(ge=-PENALTY_MAX, le=PENALTY_MAX)]
RepetitionPenalty = Annotated[float, Field(ge=REPETITION_PENALTY_MIN, le=PENALTY_MAX)]
TopLogprobs = bounded_int(0, MAX_TOP_LOGPROBS)
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX), BeforeValidator(_integral)]
NonEmptyStr = Annotated[Text, Field(min_length=1)]
StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Stop = Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)], None]
MAX_N = 64
CacheSalt = Annotated[Text, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]
CACHE_SALT_DOC = ("vLLM's field: requests with different salts never share a cached prefix, requests with the same "
                  "salt do, so usage.prompt_tokens_details.cached_tokens only ever counts this salt's prefixes. "
                  "Make it long and random (e.g. 43 characters of base64) and keep it secret.")
# A /generate rid is a label: printable ASCII only, so it can never break a log line.
RID_PATTERN = r"^[ -~]+$"
ROLES = ("system", "user", "assistant", "tool", "developer")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(populate_by_name=True)
    name: NonEmptyStr = Field(max_length=64)
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema",
                                              description="A JSON Schema; omitted means any JSON object.")
    strict: Optional[bool] = Field(None, description="The schema is always enforced.")


class ResponseFormat(_Body):
    # The schema says what the server checks: type json_schema comes with a json_schema object, and
    # a top-level schema comes with type json_object only.
    model_config = ConfigDict(populate_by_name=True, json_schema_extra={"allOf": [
        {"if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
         "then": {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}}},
        {"if": {"properties": {"type": {"enum": ["text", "json_schema"]}}, "required": ["type"]},
         "then": {"properties": {"schema": {"type": "null"}}}}]})
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = Field(None, description="Required with type json_schema.")
    schema_: Optional[dict[str, Any]] = Field(
        None, alias="schema", description="With type json_object only: a JSON Schema the output follows, "
                                          "enforced as json_schema's is (the form several hosted APIs take, and "
                                          "instructor's JSON_SCHEMA mode sends).")


class _SamplingFields(_Body):
    model: Optional[str] = Field(None, description="Served model name; omitted means the served model.")
    temperature: Optional[float] = Field(None, ge=0.0, le=TEMPERATURE_MAX, description="0 is greedy. Default 1.")
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[bounded_int(TOP_K_MIN, MAX_INT32)] = Field(None,
                                 description="radixserve extension; -1 or 0 is off.")
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0, description="radixserve extension.")
    n: bounded_int(1, MAX_N) = 1
    stop: Stop = None
    stop_token_ids: Optional[StopTokenIds] = Field(None, description="radixserve extension.")
    seed: Optional[Seed] = Field(None, description="Each of the n choices samples with its own seed, "
                                                   "seed + its index.")
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = Field(False, description="radixserve extension.")
    skip_special_tokens: bool = Field(True, description="radixserve extension.")
    presence_penalty: Optional[Penalty] = Field(None, description="Subtracted from the logit of every token "
                                                                  "already in the output.")
    frequency_penalty: Optional[Penalty] = Field(None, description="Subtracted from a token's logit once per "
                                                                   "time it is already in the output.")
    repetition_penalty: Optional[RepetitionPenalty] = Field(
        None, description="radixserve extension (vLLM, SGLang): Hugging Face's repetition penalty over the "
                          "prompt and the output; 1 is off.")
    min_tokens: Optional[bounded_int(0, MAX_INT32)] = Field(
        None, description="radixserve extension (vLLM): EOS and stop_token_ids are masked, and stop strings "
                          "not looked for, until this many tokens are out.")
    logit_bias: Optional[LogitBias] = Field(None, description="Token id (a decimal string) -> bias added to "
                                                              "its logit, in [-100, 100].")
    user: Optional[str] = Field(None, description="Accepted for compatibility; not used.")
    response_format: Optional[ResponseFormat] = Field(
        None, description="text (default), json_object (any JSON object) or json_schema (output valid "
                          "against the schema, enforced by a grammar whether strict or not).")
    cache_salt: Optional[CacheSalt] = Field(None, description=CACHE_SALT_DOC)
    prompt_cache_key: Optional[Annotated[str, Field(max_length=1024)]] = Field(
        None, description="Accepted and not used: the radix cache finds a shared prefix by its tokens, with no key.")


class CompletionRequest(_SamplingFields):
    # Token lists first, tried in order: pydantic's default ("smart") union validated a 2,000-id
    # prompt against every member, reporting an error per element for list[str], ~1 ms a request,
    # a third of the API's time when a burst of requests arrives; in order it takes ~0.13 ms.
    prompt: Union[TokenIds, Annotated[list[TokenIds], Field(min_length=1)], NonEmptyStr,
                  Annotated[list[NonEmptyStr], Field(min_length=1)]] = Field(union_mode="left_to_right")
    max_tokens: Optional[bounded_int(0, MAX_INT32)] = Field(
        None, json_schema_extra=_OUTPUT_TOKENS,
        description="Default: min(2048, context length - prompt length). 0 only with echo: true, which scores "
                    "the prompt (the legacy API's use): the prompt's text and, with logprobs, its log "
                    "probabilities; no completion; finish_reason length.")
    echo: bool = Field(False, description="Prepend the prompt to the text; with logprobs, the prompt's tokens "
                                          "come first in the logprobs too (the first with null).")
    logprobs: Optional[TopLogprobs] = Field(None, description="Log probabilities of each output token (and "
                                                              "prompt token, with echo) and of this many most "
                                                              "likely ones.")
    best_of: Optional[bounded_int(1, MAX_N)] = Field(None, description="Only equal to n is supported.",
                                   json_schema_extra={"maximum": 1})
    suffix: Optional[str] = Field(None, description="Not supported (null or empty only).",
                                  json_schema_extra={"maxLength": 0})


def _text_part_schema(schema: dict[str, Any]) -> None:
    schema["properties"]["type"]["enum"] = ["text"]
    schema["properties"]["text"] = {"type": "string", "title": "Text"}
    schema["required"] = ["type", "text"]
    schema["additionalProperties"] = False


class ContentPart(BaseModel):
    """A part of a message's content: only `{"type": "text", "text": ...}` is served (the schema
    says so). Other part types (image_url, input_audio) carry fields of their own; they pass
    validation here so the endpoint can refuse them by type (400 unsupported_parameter)."""
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_text_part_schema)
    type: str
    text: Optional[Text] = None


# A function's name, in a tool definition and in an assistant message's call alike (the chat
# template writes the name into the prompt as it is).
FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionCall(_Body):
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    arguments: Text = Field(description="The arguments as a JSON text.")


class ToolCall(_Body):
    id: Annotated[str, Field(min_length=1)]
    type: Literal["function"] = "function"
    function: FunctionCall


# A tool message answers a call (tool_call_id); only an assistant message makes calls (tool_calls)
# or carries reasoning.
_MESSAGE_RULES = {"allOf": [
    {"if": {"properties": {"role": {"const": "tool"}}, "required": ["role"]},
     "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}},
     "else": {"properties": {"tool_call_id": {"type": "null"}}}},
    {"if": {"properties": {"tool_calls": {"type": "array"}}, "required": ["tool_calls"]},
     "then": {"properties": {"role": {"const": "assistant"}}}},
    {"if": {"properties": {"reasoning_content": {"type": "string"}}, "required": ["reasoning_content"]},
     "then": {"properties": {"role": {"const": "assistant"}}}},
    {"if": {"properties": {"reasoning": {"type": "string"}}, "required": ["reasoning"]},
     "then": {"properties": {"role": {"const": "assistant"}}}},
]}


class ChatMessage(_Body):
    model_config = ConfigDict(json_schema_extra=_MESSAGE_RULES)
    role: str = Field(description=f"One of {', '.join(ROLES)}.", json_schema_extra={"enum": list(ROLES)})
    content: Union[Text, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = Field(None, description="An assistant message's tool calls.")
    tool_call_id: Optional[Annotated[str, Field(min_length=1)]] = Field(None, description="The call a tool "
                                                                                           "message answers.")
    reasoning_content: Optional[Text] = Field(
        None, description="An assistant message's reasoning, as a reply's reasoning_content gave it; the chat "
                          "template decides whether it is shown to the model (Qwen3's drops it from turns before "
                          "the last user message unless keep_reasoning is set).")
    reasoning: Optional[Text] = Field(None, description="Another name of reasoning_content (vLLM's).")


# What the server checks of a tool's parameters (radixserve.server.tool_calls), stated in the schema.
OBJECT_SCHEMA_RULES = {"properties": {
    "type": {"const": "object"},
    "properties": {"type": "object", "additionalProperties": {"type": ["object", "boolean"]}},
    "required": {"type": "array", "items": {"type": "string"}}}}


class FunctionDef(_Body):
    name: Annotated[str, Field(pattern=FUNCTION_NAME_PATTERN)]
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(None, description="A JSON Schema of the arguments: an object's.",
                                                 json_schema_extra=OBJECT_SCHEMA_RULES)
    strict: Optional[bool] = Field(None, description="Arguments always follow the schema when the call is "
                                                     "forced (required or a named function).")


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: NonEmptyStr


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


# Values of `ChatCompletionRequest`'s compatibility fields that cannot change the output: each
# field's schema allows only these, and the endpoint refuses any other value by name.
NULL_ONLY = {"enum": [None]}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    # Fields current SDKs and agent frameworks send. Accepted where they cannot change the output
    # (null, false, the default, metadata, routing and user keys); a value that would change it is
    # refused by name (400 unsupported_parameter), never ignored.
    store: Optional[bool] = Field(None, description="Only false: completions are not stored.",
                                  json_schema_extra={"enum": [False, None]})
    metadata: Optional[Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                                 Field(max_length=16)]] = Field(
        None, description="Accepted and not used (OpenAI's bounds: 16 pairs, keys of 64 and values of 512 characters).")
    service_tier: Optional[Literal["auto", "default", "flex", "scale", "priority"]] = Field(
        None, description="Accepted; the server has one tier.")
    safety_identifier: Optional[str] = Field(None, description="Accepted for compatibility; not used.")
    verbosity: Optional[Literal["low", "medium", "high"]] = Field(
        None, description="Only medium (the default): the served model has no verbosity control.",
        json_schema_extra={"enum": ["medium", None]})
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = Field(
        None, description="Only none: without --reasoning-parser the served model does not reason; with it, none "
                          "turns thinking off (the template's enable_thinking false).",
        json_schema_extra={"enum": ["none", None]})
    modalities: Optional[list[Literal["text", "audio"]]] = Field(
        None, description="Only text.", json_schema_extra={"items": {"const": "text"}})
    audio: Optional[dict[str, Any]] = Field(None, description="Only null: no audio output.",
                                            json_schema_extra=NULL_ONLY)
    prediction: Optional[dict[str, Any]] = Field(None, description="Only null: predicted outputs are not "
                                                                   "implemented.", json_schema_extra=NULL_ONLY)
    functions: Optional[list[dict[str, Any]]] = Field(None, description="Only null (deprecated): use tools.",
                                                      json_schema_extra=NULL_ONLY)
    function_call: Union[str, dict[str, Any], None] = Field(None, description="Only null (deprecated): use "
                                                                               "tool_choice.",
                                                            json_schema_extra=NULL_ONLY)
    max_tokens: Optional[bounded_int(1, MAX_INT32)] = Field(None, json_schema_extra=_OUTPUT_TOKENS,
                                      description="Default: min(2048, context length - prompt length).")
    max_completion_tokens: Optional[bounded_int(1, MAX_INT32)] = Field(None, description="Alias of max_tokens.",
                                                                     json_schema_extra=_OUTPUT_TOKENS)
    logprobs: Optional[bool] = Field(None, description="Log probabilities of each output token.")
    top_logprobs: Optional[TopLogprobs] = Field(None, description="This many most likely tokens per position "
                                                                  "too; needs logprobs: true.")
    tools: Optional[list[Tool]] = Field(None, description="Functions the model may call; the chat template "
                                                          "renders them (Qwen2/2.5's <tool_call> format).")
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = Field(
        None, description="Default auto with tools, none without. required and a named function are "
                          "enforced by a grammar, so the arguments always parse.")
    parallel_tool_calls: Optional[bool] = Field(None, description="Default true: several calls in one reply.")
    chat_template_kwargs: Optional[dict[str, Any]] = Field(
        None, description="Variables for the chat template: only those it reads (e.g. enable_thinking, "
                          "keep_reasoning for Qwen3's format; the served schema names them), never a template "
                          "of its own.", json_schema_extra={TEMPLATE_VARIABLES_SCHEMA_MARK: True})
    separate_reasoning: bool = Field(
        True, description="radixserve extension (SGLang): with --reasoning-parser, the reasoning comes as "
                          "reasoning_content apart from content; false: content carries the whole reply as "
                          "the model wrote it, think tags included.")
    regex: Optional[NonEmptyStr] = Field(None, description="radixserve extension (SGLang): the reply matches this "
                                                           "regular expression.")
    ebnf: Optional[NonEmptyStr] = Field(None, description="radixserve extension (SGLang): the reply is in the "
                                                          "language of this EBNF grammar (xgrammar's dialect).")
    add_generation_prompt: bool = Field(True, description="radixserve extension.")


class NativeSamplingParams(_Body):
    """`/generate`'s sampling_params (SGLang's names); the same bounds as the OpenAI fields."""
    max_new_tokens: Optional[bounded_int(1, MAX_INT32)] = Field(None, description="Default 128.",
                                                              json_schema_extra=_OUTPUT_TOKENS)
    temperature: Optional[float] = Field(None, ge=0.0, le=TEMPERATURE_MAX)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[bounded_int(TOP_K_MIN, MAX_INT32)] = Field(None, description="-1 or 0 is off.")
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    seed: Optional[Seed] = None
    stop: Stop = None
    stop_token_ids: Optional[StopTokenIds] = None
    ignore_eos: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    min_new_tokens: Optional[bounded_int(0, MAX_INT32)] = None
    frequency_penalty: Optional[Penalty] = None
    presence_penalty: Optional[Penalty] = None
    repetition_penalty: Optional[RepetitionPenalty] = None
    logit_bias: Optional[LogitBias] = None
    json_schema: Optional[NonEmptyStr] = Field(None, description="Output valid against this JSON Schema (text).")
    regex: Optional[NonEmptyStr] = Field(None, description="Output matching this regular expression.")
    ebnf: Optional[NonEmptyStr] = Field(None, description="Output in the language of this EBNF grammar "
                                                          "(xgrammar's dialect).")

    def values(self) -> dict[str, Any]:
        values = self.model_dump(exclude_none=True)
        if isinstance(values.get("stop"), str):
            values["stop"] = [values["stop"]]
        return values


class GenerateBody(_Body):
    """SGLang's native /generate: exactly one of `text` and `input_ids`."""
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]})
    # Not nullable: "exactly one of" is then the schema's oneOf above.
    text: Union[NonEmptyStr, Annotated[list[NonEmptyStr], Field(min_length=1)]] = None
    input_ids: Union[TokenIds, Annotated[list[TokenIds], Field(min_length=1)]] = \
        Field(None, union_mode="left_to_right")
    sampling_params: Union[NativeSamplingParams, Annotated[list[NativeSamplingParams], Field(min_length=1)],
                           None] = None
    stream: bool = False
    rid: Optional[str] = Field(None, min_length=1, max_length=128, pattern=RID_PATTERN, description=(
        "A label for the request (printable ASCII): echoed in meta_info.id and logged. The engine's "
        "request id is always made by the server."))
    return_logprob: bool = Field(False, description="meta_info.output_token_logprobs: [logprob, token id, "
                                                    "text or null] per output token.")
    top_logprobs_num: Optional[TopLogprobs] = Field(None, description="meta_info.output_top_logprobs: this "
                                                                      "many most likely tokens per position.")
    return_text_in_logprobs: bool = Field(False, description="Fill the text of the logprob triples.")
    logprob_start_len: Optional[bounded_int(-1, MAX_INT32)] = Field(
        None, description="With return_logprob: meta_info.input_token_logprobs (and input_top_logprobs) for the "
                          "prompt tokens from this position on (the first prompt token's logprob is null); -1: "
                          "none. The cached prefix is reused only up to it.")
    cache_salt: Optional[CacheSalt] = Field(None, description=CACHE_SALT_DOC)


class TokenizeBody(_Body):
    """`/v1/tokenize` (vLLM's shape): exactly one of `prompt` and `messages`."""
    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})
    model: Optional[str] = None
    # Not nullable: "exactly one of" is then the schema's oneOf above.
    prompt: Text = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] = None
    add_special_tokens: bool = Field(False, description="Add the tokenizer's special tokens around the text "
                                                        "(default false: the completions and chat endpoints "
                                                        "add none, and count is what they count).")
    add_generation_prompt: bool = Field(True, description="For messages, as in chat completions.")
    tools: Optional[list[Tool]] = Field(None, description="For messages, as in chat completions: the chat "
                                                          "template renders them into the prompt.")
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = Field(
        None, description="For messages, as in chat completions: none leaves the tools out of the prompt.")
    chat_template_kwargs: Optional[dict[str, Any]] = Field(
        None, description="For messages, as in chat completions: variables the served chat template reads.",
        json_schema_extra={TEMPLATE_VARIABLES_SCHEMA_MARK: True})
    return_token_strs: bool = Field(False, description="Also answer the tokens' vocabulary strings.")


class DetokenizeBody(_Body):
    model: Optional[str] = None
    tokens: list[TokenId]
