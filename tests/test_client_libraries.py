"""Third-party clients as a new user runs them, against the real server over the tiny random model:
the openai SDK's `chat.completions.parse`, LangChain's `with_structured_output` (its default,
json_schema and function calling) and instructor's default mode (TOOLS: a forced call of the
model's schema). The model is random, so each call checks what the server guarantees: the reply
parses and validates as the pydantic model, the schema being enforced by a grammar.

The models bound every value (enums, integer ranges, a string pattern), so a random model's reply
ends within a few dozen tokens; a `maxLength` string is left out (bounded strings are the grammar
layer's to get right, tested there).
"""

from __future__ import annotations

from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 128
QUESTION = "Who lives where?"


class Address(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    floor: int = Field(ge=0, le=9)


class Person(BaseModel):
    """Nested: the JSON Schema refers to Address through "#/$defs/Address"."""
    name: str = Field(pattern=r"^[A-Z][a-z]{1,7}$")
    age: int = Field(ge=0, le=120)
    address: Address


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return f"{server.base_url}/v1"


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"]


def test_openai_sdk_parse(base_url, model):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    reply = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": QUESTION}],
                                          response_format=Person, max_tokens=MAX_TOKENS, seed=1)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)


@pytest.mark.parametrize("method", ["default", "json_schema", "function_calling"])
def test_langchain_with_structured_output(base_url, model, method):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base_url, api_key="unused", model=model, max_tokens=MAX_TOKENS, max_retries=0, seed=1)
    structured = llm.with_structured_output(Person) if method == "default" else \
        llm.with_structured_output(Person, method=method)
    assert isinstance(structured.invoke(QUESTION), Person)


def test_instructor_default_mode(base_url, model):
    import instructor

    client = instructor.from_openai(openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0))
    assert client.mode == instructor.Mode.TOOLS  # a call forced to the model's (nested) schema
    person = client.chat.completions.create(model=model, response_model=Person, max_tokens=MAX_TOKENS, seed=1,
                                            messages=[{"role": "user", "content": QUESTION}], max_retries=1)
    assert isinstance(person, Person)


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_with_a_schema_as_instructor_json_schema_mode_sends_it(base_url, model, stream):
    """instructor 1.3.x's Mode.JSON_SCHEMA (and several hosted APIs) put the schema beside type
    json_object: it is enforced as a json_schema's is, so the reply validates as the model."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    response_format = {"type": "json_object", "schema": Person.model_json_schema()}
    args = dict(model=model, messages=[{"role": "user", "content": QUESTION}], response_format=response_format,
                max_tokens=MAX_TOKENS, seed=1)
    if stream:
        text, finish = "", None
        for chunk in client.chat.completions.create(stream=True, **args):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
    else:
        choice = client.chat.completions.create(**args).choices[0]
        text, finish = choice.message.content, choice.finish_reason
    assert finish == "stop", text
    Person.model_validate_json(text)
    done = client.completions.create(model=model, prompt=QUESTION, max_tokens=MAX_TOKENS, seed=1,
                                     extra_body={"response_format": response_format})
    assert done.choices[0].finish_reason == "stop"
    Person.model_validate_json(done.choices[0].text)


@pytest.mark.parametrize("response_format", [
    {"type": "text", "schema": {"type": "object"}},
    {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}, "schema": {"type": "object"}},
])
def test_a_schema_beside_another_type_is_refused_by_name(base_url, model, response_format):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=4,
                                       response_format=response_format)
    assert e.value.body["param"] == "response_format.schema", e.value.body
