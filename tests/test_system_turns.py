"""Where a ChatML prompt's system turn ends, read from its tokens (`chat_formats.SystemTurns`): the
same position the chat API finds by rendering the system messages alone, for both chat formats a
tiny model is built with, with tools, a developer turn, and none."""
from __future__ import annotations

import pytest
import transformers

from radixserve.chat_formats import SystemTurns
from radixserve.testing.tiny_model import build_tiny_model

SYSTEM = {"role": "system", "content": "You are terse.\n\nAnswer in French."}
DEVELOPER = {"role": "developer", "content": "Never name a city."}
USER = {"role": "user", "content": "Where should I go in spring?"}
REPLY = {"role": "assistant", "content": "Somewhere warm."}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather of a place",
                                           "parameters": {"type": "object", "properties": {"place": {"type": "string"}}}}}]


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def tokenizer(request, tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp(f"tok-{request.param}"), chat_format=request.param)
    return transformers.AutoTokenizer.from_pretrained(path)


def ids(tok, messages: list[dict], generation_prompt: bool, tools=None) -> list[int]:
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("head,tools", [([SYSTEM], None), ([SYSTEM], TOOLS), ([SYSTEM, DEVELOPER], None)])
def test_the_system_turn_ends_where_the_chat_api_finds_it(tokenizer, head, tools):
    turns = SystemTurns.of(tokenizer)
    system_alone = ids(tokenizer, head, False, tools)
    for conversation in ([USER], [USER, REPLY, {"role": "user", "content": "And in winter?"}]):
        prompt = ids(tokenizer, head + conversation, True, tools)
        assert prompt[:len(system_alone)] == system_alone
        assert turns.end_of(prompt) == len(system_alone)


def test_no_system_turn_no_mark(tokenizer):
    """Qwen2.5's template writes a default system turn into a chat without one: every such chat
    shares it, and it is marked; Qwen3's writes none."""
    turns = SystemTurns.of(tokenizer)
    prompt = ids(tokenizer, [USER], True)
    user_turn = tokenizer.encode("<|im_start|>user", add_special_tokens=False)
    default = next((i for i in range(len(prompt)) if prompt[i:i + len(user_turn)] == user_turn), 0)
    assert (tokenizer.decode(prompt[:default]).startswith("<|im_start|>system")) == (default > 0)
    assert turns.end_of(prompt) == (default or None)
    assert turns.end_of(ids(tokenizer, [SYSTEM], False)) is None  # nothing follows it
    assert turns.end_of(ids(tokenizer, [SYSTEM], False)[:-3]) is None  # unfinished
    text = tokenizer.encode("<|im_start|>system is a word here", add_special_tokens=False)
    assert turns.end_of(text) is None
    assert turns.end_of([]) is None
