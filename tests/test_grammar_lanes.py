"""The engine's compile lanes against the tiny model's real vocabulary: a compile nobody waits for
is dropped before it starts, a small grammar does not queue behind large ones, and the cache of
compiled grammars stays within its memory bound."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from radixserve.grammar import backend
from radixserve.grammar.backend import GENERAL_LANES, GrammarCompilers
from radixserve.testing.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def compilers(tmp_path_factory):
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("lanes-tiny")))
    c = GrammarCompilers(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    yield c
    c.shutdown()


def slow_schema(tag: int) -> str:
    """Within every limit, ~0.3 s to compile on one core (larger than the small-lane bound)."""
    return json.dumps({"title": f"slow {tag}", "type": "object", "properties": {
        f"o{j}": {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 5} for i in range(128)}}
        for j in range(8)}})


def test_unwaited_compile_is_skipped_and_small_one_overtakes(compilers):
    running = [compilers.compile("json_schema", slow_schema(i)) for i in range(GENERAL_LANES)]
    queued = compilers.compile("json_schema", slow_schema(99))
    behind = compilers.compile("json_schema", slow_schema(100))  # starts only after a running one ends
    skipped = compilers.skipped
    compilers.release(queued)  # its only waiter went away (aborted, disconnected, timed out)
    assert queued.cancelled() and compilers.skipped == skipped + 1
    small = compilers.compile("regex", "(yes|no)")
    assert small.result(timeout=30) is not None
    # The small grammar ran on its own lane: a queue in arrival order would have put it after
    # `behind`, which needs a running compile to end and then ~0.5 s of its own.
    assert not behind.done()
    for f in [*running, behind]:
        assert f.result(timeout=120) is not None
    again = compilers.compile("json_schema", slow_schema(99))  # a new waiter compiles it anew
    assert again is not queued
    compilers.release(again)


def test_cache_is_bounded_by_memory(compilers, monkeypatch):
    compiled = compilers.compile("json_schema", json.dumps({"enum": [f"value {i}" for i in range(1000)]})).result(60)
    one = int(compiled.memory_size_bytes)
    monkeypatch.setattr(compilers, "cache_bytes", 3 * one)
    for i in range(8):
        compilers.compile("json_schema", json.dumps({"enum": [f"value {i} {j}" for j in range(1000)]})).result(60)
        assert compilers.cache_stats()["bytes"] <= 3 * one + one  # evicted as soon as it goes over
    assert compilers.cache_stats()["bytes"] <= 3 * one
