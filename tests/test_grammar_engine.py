"""Constrained decoding in the offline engine: the bitmask keeps a random model inside its grammar,
constrained and unconstrained requests share batches without changing each other's tokens, and
overlap scheduling (a constrained step reads the step before it during its forward pass) gives
the same tokens as none."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from radixserve.engine.engine import Engine
from radixserve.testing.tiny_model import build_tiny_model

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
REGEX = r"(yes|no), [0-9]{1,3}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("grammar-tiny"))


def mixed_batch(engine: Engine) -> list[dict]:
    prompts = ["The river", "A server answers", "Numbers matter", "Once upon a time"]
    params = [{"max_new_tokens": 120, "temperature": 1.0, "seed": 11, "json_schema": json.dumps(SCHEMA)},
              {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True},
              {"max_new_tokens": 40, "temperature": 1.0, "seed": 12, "regex": REGEX},
              {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}]
    return engine.generate(prompts, sampling_params=params)


def test_constrained_and_plain_share_batches(model_dir):
    with Engine(str(model_dir), device="cpu") as overlap, Engine(str(model_dir), device="cpu",
                                                                 disable_overlap_schedule=True) as plain:
        overlap.core.runner.warm_grammar_mask()  # what the CUDA warm-up does; the mask must stay correct after
        results = mixed_batch(overlap)
        assert [r["output_ids"] for r in results] == [r["output_ids"] for r in mixed_batch(plain)]
        alone = plain.generate(["A server answers", "Once upon a time"],
                               sampling_params={"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True})
        overlap.check_invariants()
    jsonschema.validate(json.loads(results[0]["text"], strict=False), SCHEMA)
    assert re.fullmatch(REGEX, results[2]["text"]), results[2]["text"]
    assert [results[1]["output_ids"], results[3]["output_ids"]] == [a["output_ids"] for a in alone]
    assert results[0]["meta_info"]["finish_reason"]["type"] == "stop"


def test_bad_grammar_is_a_value_error(model_dir):
    with Engine(str(model_dir), device="cpu") as engine:
        with pytest.raises(ValueError, match="parenthesis"):
            engine.generate("x", sampling_params={"regex": "a(b"})
        with pytest.raises(ValueError, match="at most one"):
            engine.generate("x", sampling_params={"regex": "a", "json_schema": "{}"})


def test_forced_parallel_tool_calls_parse(model_dir):
    """`tool_choice: required` with parallel calls: one or more <tool_call> blocks, each a call of an
    offered function with schema-valid arguments."""
    from radixserve.server.tool_calls import ToolPolicy, parse_tool_calls, tool_call_grammar

    params = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 4}}, "required": ["q"],
              "additionalProperties": False}
    policy = ToolPolicy(tools=[{"type": "function", "function": {"name": "search", "parameters": params}},
                               {"type": "function", "function": {"name": "noop"}}], mode="required")
    grammar = tool_call_grammar(policy)
    with Engine(str(model_dir), device="cpu") as engine:
        outs = engine.generate(["Find", "Look up", "Call"], sampling_params={
            "max_new_tokens": 300, "temperature": 1.0, "seed": 4, "ebnf": grammar})
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["text"]
        content, calls = parse_tool_calls(out["text"])
        assert content is None and calls, out["text"]
        assert out["text"].count("<tool_call>") == len(calls)
        for call in calls:
            arguments = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "search":
                jsonschema.validate(arguments, params)
            else:
                assert call["function"]["name"] == "noop" and isinstance(arguments, dict)


def test_constrained_rows_with_logprobs_and_penalties(model_dir):
    """A constrained request that also wants log probabilities and penalties: its log probabilities
    are of the model's own logits (Hugging Face's log_softmax, not the masked distribution), its
    penalties see every earlier token, and overlap scheduling gives the same tokens and values
    as none while requests of different lengths finish around it."""
    import torch
    import transformers

    params = [{"max_new_tokens": 60, "temperature": 0, "regex": REGEX, "return_logprob": True, "top_logprobs_num": 2,
               "repetition_penalty": 1.3, "frequency_penalty": 0.5},
              {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
              {"max_new_tokens": 30, "temperature": 1.0, "seed": 3, "json_schema": json.dumps(SCHEMA),
               "return_logprob": True},
              {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True, "return_logprob": True}]
    prompts = ["Answer", "Short one", "Describe a person", "Numbers"]
    runs = []
    for overlap in (True, False):
        with Engine(str(model_dir), device="cpu", disable_overlap_schedule=not overlap) as engine:
            runs.append(engine.generate(prompts, sampling_params=params))
            engine.check_invariants()
    with_overlap, without = runs
    assert [r["output_ids"] for r in with_overlap] == [r["output_ids"] for r in without]
    for a, b in zip(with_overlap, without):
        if "output_token_logprobs" in a["meta_info"]:
            assert [v for v, _, _ in a["meta_info"]["output_token_logprobs"]] == pytest.approx(
                [v for v, _, _ in b["meta_info"]["output_token_logprobs"]], abs=1e-5)
    assert re.fullmatch(REGEX, with_overlap[0]["text"]), with_overlap[0]["text"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = tokenizer.encode(prompts[0])
    out = with_overlap[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt_ids + out["output_ids"]])).logits[0].float(), dim=-1)
    for k, (value, token, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        row = ref[len(prompt_ids) + k - 1]
        assert value == pytest.approx(row[token].item(), abs=1e-4)
        top = out["meta_info"]["output_top_logprobs"][k]
        assert [i for _, i, _ in top] == row.topk(2).indices.tolist()  # unmasked: any token may lead


def test_grammars_behind_reasoning_give_the_same_tokens_with_and_without_overlap(tmp_path_factory):
    """With a reasoning parser, `grammar_after_reasoning` requests reason freely (sampled, of random
    lengths: logit_bias makes </think> likely) and then follow their grammar, batched with a plain
    request; overlap scheduling gives the same tokens as none. Under overlap a reasoning row whose
    last token is still on the device is masked there (all allowed unless that token ended the
    reasoning), without waiting for the step before."""
    model = build_tiny_model(tmp_path_factory.mktemp("grammar-tiny-qwen3"), family="qwen3", chat_format="qwen3")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    prompts = ["The river", "A server answers<think>\n", "Numbers matter", "Once upon a time<think>\n"]
    gated = {"grammar_after_reasoning": True, "temperature": 1.0, "logit_bias": {start: 3.0, end: 4.0}}
    params = [{**gated, "max_new_tokens": 160, "seed": 21, "json_schema": json.dumps(SCHEMA)},
              {**gated, "max_new_tokens": 100, "seed": 22, "regex": REGEX},
              {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True},
              {**gated, "max_new_tokens": 160, "seed": 23, "json_schema": json.dumps(SCHEMA)}]
    # Only rows inside their reasoning (longer: </think> less likely) beside a plain one: under
    # overlap every step of theirs until one reasoning ends is masked on the device.
    long_reasoning = [{**gated, "logit_bias": {end: 2.5}, "max_new_tokens": 200, "seed": 24 + i,
                       "json_schema": json.dumps(SCHEMA)} for i in range(2)]
    runs, alone, deferred = [], [], []
    for overlap in (True, False):
        with Engine(str(model), device="cpu", reasoning_parser="qwen3", disable_overlap_schedule=not overlap) as engine:
            runs.append(engine.generate(prompts, sampling_params=params))
            alone.append(engine.generate([prompts[1], prompts[2], prompts[3]],
                                         sampling_params=[long_reasoning[0], params[2], long_reasoning[1]]))
            engine.check_invariants()
            deferred.append(engine.core.runner._mask().deferred_rows)
    assert [r["output_ids"] for r in runs[0]] == [r["output_ids"] for r in runs[1]]
    assert [r["output_ids"] for r in alone[0]] == [r["output_ids"] for r in alone[1]]
    assert deferred[0] > 10 and deferred[1] == 0
    for out in (alone[0][0], alone[0][2]):
        ids = out["output_ids"][:-1]
        assert out["meta_info"]["finish_reason"]["type"] == "stop" and ids.index(end) > 0, out["text"]
        jsonschema.validate(json.loads(tokenizer.decode(ids[ids.index(end) + 1:]).removeprefix("\n"), strict=False),
                            SCHEMA)
    reasoned = 0
    for k in (0, 1, 3):
        out = runs[0][k]
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["text"]
        ids = out["output_ids"][:-1]  # the end of the turn
        opened = prompts[k].endswith("<think>\n")  # the reply starts inside the reasoning
        if opened or ids[0] == start:
            cut = ids.index(end)
            reasoned += cut - (0 if opened else 1) > 1
            answer = tokenizer.decode(ids[cut + 1:]).removeprefix("\n")
        else:  # the reply did not open its reasoning: the grammar holds from its first token
            answer = tokenizer.decode(ids)
        if k == 1:
            assert re.fullmatch(REGEX, answer), (out["text"], answer)
        else:
            jsonschema.validate(json.loads(answer, strict=False), SCHEMA)
    assert reasoned >= 2  # the test sees reasoning that took several tokens
