"""Benchmark datasets: exact lengths, determinism per seed, the agent workload's shared share, bad files."""

from __future__ import annotations

import json

import pytest

from radixserve.bench.datasets import (DatasetArgs, DatasetError, build_dataset, dataset_summary,
                                       shared_system_fraction)


@pytest.fixture(scope="module")
def tokenizer(server_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server_model_dir)


def _key(reqs):
    return [(r.prompt_ids, r.output_len, r.prompt_text, r.session_id, r.turn, r.think_time_s) for r in reqs]


@pytest.mark.parametrize("name", ["random", "random-ids", "generated-shared-prefix", "agent"])
def test_datasets_are_deterministic_per_seed(tokenizer, name):
    args = dict(name=name, num_prompts=12, random_input_len=40, random_output_len=8, random_range_ratio=0.5,
                gsp_num_groups=3, gsp_prompts_per_group=4, gsp_system_prompt_len=50, gsp_question_len=10,
                gsp_output_len=4)
    a = build_dataset(DatasetArgs(seed=3, **args), tokenizer)
    b = build_dataset(DatasetArgs(seed=3, **args), tokenizer)
    c = build_dataset(DatasetArgs(seed=4, **args), tokenizer)
    assert _key(a) == _key(b)
    assert _key(a) != _key(c)
    assert len(a) == 12


def test_random_text_prompts_have_exact_token_lengths(tokenizer):
    reqs = build_dataset(DatasetArgs(name="random", num_prompts=20, random_input_len=64, random_output_len=5,
                                     seed=1), tokenizer)
    for r in reqs:
        assert r.prompt_len == 64
        assert tokenizer.encode(r.prompt_text, add_special_tokens=False) == r.prompt_ids
        assert r.output_len == 5
    ranged = build_dataset(DatasetArgs(name="random", num_prompts=20, random_input_len=64, random_output_len=8,
                                       random_range_ratio=0.5, seed=1), tokenizer)
    assert all(32 <= r.prompt_len <= 64 and 4 <= r.output_len <= 8 for r in ranged)
    assert len({r.prompt_len for r in ranged}) > 1


def test_random_ids_need_only_a_vocabulary():
    reqs = build_dataset(DatasetArgs(name="random-ids", num_prompts=5, random_input_len=30, random_output_len=3),
                         None, vocab_size=100)
    assert all(r.prompt_len == 30 and r.prompt_text is None and max(r.prompt_ids) < 100 for r in reqs)


def test_agent_dataset_system_prompts_are_at_least_40_percent(tokenizer):
    reqs = build_dataset(DatasetArgs(name="agent", num_prompts=120, seed=1), tokenizer)
    frac = shared_system_fraction(reqs)
    assert frac >= 0.40, frac
    # measured independently: the system prompt's own chat-rendered tokens start every prompt
    for r in reqs[:10]:
        system = tokenizer.apply_chat_template(r.messages[:1], tokenize=False, add_generation_prompt=False)
        sys_ids = tokenizer.encode(system, add_special_tokens=False)
        assert r.system_tokens == len(sys_ids) > 100
        assert r.prompt_ids[: r.system_tokens] == sys_ids
    # sessions: each turn extends the previous turn's prompt, turns in order
    by_session = {}
    for r in reqs:
        by_session.setdefault(r.session_id, []).append(r)
    assert len(by_session) == 30 and dataset_summary(reqs)["sessions"] == 30
    few = len({r.messages[0]["content"] for r in reqs})
    assert few == 3
    for turns in by_session.values():
        assert [t.turn for t in turns] == list(range(len(turns)))
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.prompt_ids[: prev.prompt_len - 3] == prev.prompt_ids[: prev.prompt_len - 3]
            assert nxt.think_time_s > 0
    assert all(r.prompt_len + r.output_len < 512 for r in reqs)  # fits the tiny model's context


def test_gsp_shares_a_system_prompt_within_a_group(tokenizer):
    reqs = build_dataset(DatasetArgs(name="generated-shared-prefix", gsp_num_groups=2, gsp_prompts_per_group=3,
                                     gsp_system_prompt_len=40, gsp_question_len=8, gsp_output_len=4), tokenizer)
    assert len(reqs) == 6
    assert len({tuple(r.prompt_ids[:30]) for r in reqs}) == 2
    assert shared_system_fraction(reqs) > 0.7


def test_sharegpt_local_file(tokenizer, tmp_path):
    data = [{"conversations": [{"from": "human", "value": f"Question number {i} about the river?"},
                               {"from": "gpt", "value": "The miller listened to the water " * (i + 1)}]}
            for i in range(6)]
    data.append({"conversations": [{"from": "human", "value": "only one turn"}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = build_dataset(DatasetArgs(name="sharegpt", num_prompts=4, dataset_path=str(path)), tokenizer)
    assert len(reqs) == 4 and all(r.prompt_text.startswith("Question") for r in reqs)
    fixed = build_dataset(DatasetArgs(name="sharegpt", num_prompts=4, dataset_path=str(path),
                                      sharegpt_output_len=7), tokenizer)
    assert all(r.output_len == 7 for r in fixed)
    with pytest.raises(DatasetError, match="usable conversations"):
        build_dataset(DatasetArgs(name="sharegpt", num_prompts=50, dataset_path=str(path)), tokenizer)


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{not json", "not valid JSON"),
    ('{"a": 1}', "expected a JSON list"),
    ('[{"x": 1}]', "no 'conversations' list"),
    ('[{"conversations": [{"from": "human"}, {"from": "gpt"}]}]', "need a 'value'"),
])
def test_sharegpt_bad_files(tokenizer, tmp_path, content, message):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        build_dataset(DatasetArgs(name="sharegpt", num_prompts=1, dataset_path=str(path)), tokenizer)


def test_bad_sizes_are_refused(tokenizer):
    with pytest.raises(DatasetError, match="num-prompts"):
        build_dataset(DatasetArgs(name="random", num_prompts=0), tokenizer)
    with pytest.raises(DatasetError, match="range-ratio"):
        build_dataset(DatasetArgs(name="random", random_range_ratio=2.0), tokenizer)
    with pytest.raises(DatasetError, match="needs a tokenizer"):
        build_dataset(DatasetArgs(name="agent"), None)


def test_agent_turn_suffix_is_what_the_template_puts_after_the_reply(tokenizer):
    """A closed-loop turn = previous prompt + reply + turn_suffix_ids; with the dataset's own fixed
    reply that is (in text) exactly the open-loop prompt of the turn."""
    reqs = build_dataset(DatasetArgs(name="agent", num_prompts=6, agent_turns=3, agent_num_system_prompts=1,
                                     agent_system_prompt_len=30, seed=2), tokenizer)
    by_turn = {(r.session_id, r.turn): r for r in reqs}
    for r in reqs:
        if r.turn == 0:
            assert r.turn_suffix_ids is None
            continue
        prev = by_turn[(r.session_id, r.turn - 1)]
        reply = r.messages[-2]["content"]
        assert r.messages[-2]["role"] == "assistant" and r.messages[-1]["role"] == "user"
        text = prev.prompt_text + reply + tokenizer.decode(r.turn_suffix_ids)
        assert text == r.prompt_text
        assert r.messages[-1]["content"] in tokenizer.decode(r.turn_suffix_ids)
