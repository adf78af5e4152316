"""Request bodies of the HTTP API (pydantic, so /openapi.json describes them).

Numbers are bounded here, so nothing out of range reaches the engine (a seed past 64 bits, a
token id past 2**31). Fields of the OpenAI schema that radixserve does not implement are accepted
at their neutral values and refused (400) otherwise; unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_INT32 = 2**31 - 1
# Strict: a JSON number, never a numeric string or a bool coerced into a token id. It also lets
# the prompt unions below be tried left to right: a list of token ids matches its member first.
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32, strict=True)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
MAX_N = 64


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: Optional[str] = Field(None, description="Served model name; omitted means the served model.")
    temperature: Optional[float] = Field(None, ge=0.0, description="0 is greedy. Default 1.")
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1, le=MAX_INT32, description="radixserve extension; -1 is off.")
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0, description="radixserve extension.")
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[TokenId]] = Field(None, description="radixserve extension.")
    seed: Optional[Seed] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = Field(False, description="radixserve extension.")
    skip_special_tokens: bool = Field(True, description="radixserve extension.")
    presence_penalty: Optional[float] = Field(None, description="Only 0 is supported.")
    frequency_penalty: Optional[float] = Field(None, description="Only 0 is supported.")
    logit_bias: Optional[dict[str, float]] = Field(None, description="Only an empty map is supported.")
    user: Optional[str] = None


class CompletionRequest(_SamplingFields):
    # Token lists first, tried in order: pydantic's default ("smart") union validated a 2,000-id
    # prompt against every member, reporting an error per element for list[str], ~1 ms a request,
    # a third of the API's time when a burst of requests arrives; in order it takes ~0.13 ms.
    prompt: Union[list[TokenId], list[list[TokenId]], str, list[str]] = Field(union_mode="left_to_right")
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT32,
                                      description="Default: min(2048, context length - prompt length).")
    echo: bool = False
    logprobs: Optional[int] = Field(None, description="Not supported (null only).")
    best_of: Optional[int] = Field(None, description="Only equal to n is supported.")
    suffix: Optional[str] = Field(None, description="Not supported (null only).")


class ContentPart(_Body):
    type: str
    text: Optional[str] = None


class ChatMessage(_Body):
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None


class ResponseFormat(_Body):
    type: str


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT32,
                                      description="Default: min(2048, context length - prompt length).")
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT32, description="Alias of max_tokens.")
    logprobs: Optional[bool] = Field(None, description="Not supported (false only).")
    top_logprobs: Optional[int] = Field(None, description="Not supported (null only).")
    tools: Optional[list[Any]] = Field(None, description="Not supported (empty only).")
    tool_choice: Optional[Any] = None
    response_format: Optional[ResponseFormat] = Field(None, description="Only type 'text' is supported.")
    add_generation_prompt: bool = Field(True, description="radixserve extension.")


class GenerateBody(_Body):
    """SGLang's native /generate."""
    text: Union[str, list[str], None] = None
    input_ids: Union[list[TokenId], list[list[TokenId]], None] = Field(None, union_mode="left_to_right")
    sampling_params: Union[dict[str, Any], list[dict[str, Any]], None] = None
    stream: bool = False
    rid: Optional[str] = Field(None, max_length=256, description="Request id (default: a random one).")


ROLES = ("system", "user", "assistant", "tool", "developer")
