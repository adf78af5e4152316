"""Benchmark workloads. Every dataset is a pure function of its arguments, the tokenizer and the seed.

- `random`: text prompts of exactly `input_len` tokens (random tokens decoded, then re-encoded and
  adjusted until the length is exact), `output_len` tokens out.
- `random-ids`: the same lengths as token ids, sent as `input_ids`; no tokenizer needed.
- `sharegpt`: a local JSON file in ShareGPT format (a list of {"conversations": [{"from", "value"}]});
  the first human turn is the prompt, the reply's token length the output length.
- `generated-shared-prefix` (SGLang's gsp): groups of prompts sharing a system prompt.
- `agent`: sessions of multi-turn conversations over a few long system prompts; each turn carries
  the whole history and a new user message; a turn is sent after the previous turn of its session
  has finished plus a think time. The history's replies are fixed text, unless the run is closed
  loop (`--agent-closed-loop`, radixserve/bench/closed_loop.py): then each turn's prompt is, in
  token ids, the previous turn's prompt + the tokens the server returned + `turn_suffix_ids`
  (the end of that reply and the new user message, as the chat template renders them).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

DATASETS = ("random", "random-ids", "sharegpt", "generated-shared-prefix", "agent")


class DatasetError(ValueError):
    """A dataset cannot be built from what was given (missing file, bad format, bad sizes)."""


@dataclass
class BenchRequest:
    prompt_ids: list[int]
    output_len: int
    prompt_text: Optional[str] = None  # None: send prompt_ids
    messages: Optional[list[dict[str, str]]] = None  # for chat backends
    session_id: Optional[int] = None
    turn: int = 0
    think_time_s: float = 0.0  # wait after the session's previous turn finished
    system_tokens: int = 0  # prompt tokens that belong to the shared system prompt
    # Closed-loop agent turns after the first: the tokens that follow the previous turn's output
    turn_suffix_ids: Optional[list[int]] = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass
class DatasetArgs:
    name: str = "random"
    num_prompts: int = 1000
    seed: int = 1
    random_input_len: int = 1024
    random_output_len: int = 512
    random_range_ratio: float = 0.0
    dataset_path: Optional[str] = None
    sharegpt_output_len: Optional[int] = None
    gsp_num_groups: int = 64
    gsp_prompts_per_group: int = 16
    gsp_system_prompt_len: int = 2048
    gsp_question_len: int = 128
    gsp_output_len: int = 256
    agent_num_sessions: int = 0  # 0: enough sessions for num_prompts
    agent_turns: int = 4
    agent_num_system_prompts: int = 3
    agent_system_prompt_len: int = 160
    agent_user_len: int = 24
    agent_assistant_len: int = 24
    agent_output_len: int = 16
    agent_think_time_s: float = 0.5
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if self.name not in DATASETS:
            raise DatasetError(f"unknown dataset {self.name!r}; choose one of {', '.join(DATASETS)}")
        positive = {"num_prompts": self.num_prompts, "random_input_len": self.random_input_len,
                    "random_output_len": self.random_output_len, "gsp_num_groups": self.gsp_num_groups,
                    "gsp_prompts_per_group": self.gsp_prompts_per_group,
                    "gsp_system_prompt_len": self.gsp_system_prompt_len,
                    "gsp_question_len": self.gsp_question_len, "gsp_output_len": self.gsp_output_len,
                    "agent_turns": self.agent_turns, "agent_num_system_prompts": self.agent_num_system_prompts,
                    "agent_system_prompt_len": self.agent_system_prompt_len, "agent_user_len": self.agent_user_len,
                    "agent_assistant_len": self.agent_assistant_len, "agent_output_len": self.agent_output_len}
        for name, value in positive.items():
            if value < 1:
                raise DatasetError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if not 0.0 <= self.random_range_ratio <= 1.0:
            raise DatasetError(f"--random-range-ratio must be in [0, 1], got {self.random_range_ratio}")
        if self.agent_think_time_s < 0:
            raise DatasetError(f"--agent-think-time must be >= 0, got {self.agent_think_time_s}")
        if self.agent_num_sessions < 0:
            raise DatasetError(f"--agent-num-sessions must be >= 0, got {self.agent_num_sessions}")


# ---------------------------------------------------------------------------- token helpers
class TokenSource:
    """Token ids that decode to clean text and encode back to themselves, for exact-length prompts."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # Long texts are encoded here only to be measured and cut; silence the model-length warning.
        tokenizer.model_max_length = 10**9
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        vocab = len(tokenizer)
        clean = []
        for t in range(vocab):
            if t in special:
                continue
            text = tokenizer.decode([t])
            if not text or "\ufffd" in text or not text.isprintable():
                continue
            if tokenizer.encode(text, add_special_tokens=False) == [t]:
                clean.append(t)
        if not clean:
            raise DatasetError("the tokenizer has no token that decodes and re-encodes to itself")
        self.clean = clean

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def exact_text(self, rng: random.Random, n: int) -> tuple[str, list[int]]:
        """Text whose encoding has exactly n tokens."""
        ids = [rng.choice(self.clean) for _ in range(n)]
        for _ in range(64):
            text = self.decode(ids)
            enc = self.encode(text)
            if len(enc) == n:
                return text, enc
            if len(enc) > n:
                ids = enc[:n]
            else:
                ids = enc + [rng.choice(self.clean) for _ in range(n - len(enc))]
        raise DatasetError(f"could not build a prompt of exactly {n} tokens with this tokenizer")

    def words_text(self, rng: random.Random, n: int) -> str:
        """Readable text of about n tokens (cut to at most n)."""
        words = []
        while True:
            words.extend(rng.choice(WORDS) for _ in range(max(8, n)))
            text = " ".join(words)
            enc = self.encode(text)
            if len(enc) >= n:
                return self.decode(enc[:n]).strip()


WORDS = ("the request cache prefix token model server answer question system prompt agent tool call "
         "result plan step memory search file read write check value table user data report error retry "
         "time queue batch score note list item order price city river mill book story letter number "
         "please explain summarize translate compare describe verify compute return update select").split()


def _lengths(rng: random.Random, n: int, mean: int, ratio: float) -> list[int]:
    lo = max(1, int(mean * (1.0 - ratio)))
    return [rng.randint(lo, mean) if lo < mean else mean for _ in range(n)]


# ---------------------------------------------------------------------------- builders
def build_dataset(args: DatasetArgs, tokenizer=None, vocab_size: Optional[int] = None) -> list[BenchRequest]:
    args.validate()
    if args.name == "random-ids":
        if vocab_size is None and tokenizer is None:
            raise DatasetError("random-ids needs the vocabulary size (from the server or --tokenizer)")
        return _random_ids(args, tokenizer, vocab_size)
    if tokenizer is None:
        raise DatasetError(f"the {args.name} dataset needs a tokenizer: the server's /tokenizer or --tokenizer")
    source = TokenSource(tokenizer)
    if args.name == "random":
        return _random(args, source)
    if args.name == "sharegpt":
        return _sharegpt(args, source)
    if args.name == "generated-shared-prefix":
        return _gsp(args, source)
    return _agent(args, source, tokenizer)


def _random_ids(args: DatasetArgs, tokenizer, vocab_size: Optional[int]) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    if tokenizer is not None:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        ids = [t for t in range(min(len(tokenizer), vocab_size or len(tokenizer))) if t not in special]
    else:
        ids = list(range(vocab_size))
    ins = _lengths(rng, args.num_prompts, args.random_input_len, args.random_range_ratio)
    outs = _lengths(rng, args.num_prompts, args.random_output_len, args.random_range_ratio)
    return [BenchRequest(prompt_ids=[rng.choice(ids) for _ in range(i)], output_len=o) for i, o in zip(ins, outs)]


def _random(args: DatasetArgs, source: TokenSource) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    ins = _lengths(rng, args.num_prompts, args.random_input_len, args.random_range_ratio)
    outs = _lengths(rng, args.num_prompts, args.random_output_len, args.random_range_ratio)
    out = []
    for i, o in zip(ins, outs):
        text, ids = source.exact_text(rng, i)
        out.append(BenchRequest(prompt_ids=ids, output_len=o, prompt_text=text,
                                messages=[{"role": "user", "content": text}]))
    return out


def _sharegpt(args: DatasetArgs, source: TokenSource) -> list[BenchRequest]:
    path = args.dataset_path
    if not path:
        raise DatasetError("the sharegpt dataset needs --dataset-path (a local ShareGPT JSON file; "
                           "nothing is downloaded)")
    if not os.path.isfile(path):
        raise DatasetError(f"--dataset-path {path!r}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(f"--dataset-path {path!r} is not valid JSON: {e}") from None
    if not isinstance(data, list):
        raise DatasetError(f"--dataset-path {path!r}: expected a JSON list of conversations, got "
                           f"{type(data).__name__}")
    pairs = []
    for i, entry in enumerate(data):
        conv = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(conv, list):
            raise DatasetError(f"--dataset-path {path!r}: entry {i} has no 'conversations' list")
        if len(conv) < 2:
            continue
        try:
            prompt, reply = str(conv[0]["value"]), str(conv[1]["value"])
        except (TypeError, KeyError):
            raise DatasetError(f"--dataset-path {path!r}: entry {i}'s turns need a 'value'") from None
        pairs.append((prompt, reply))
    if not pairs:
        raise DatasetError(f"--dataset-path {path!r}: no conversation with at least two turns")
    rng = random.Random(args.seed)
    rng.shuffle(pairs)
    out = []
    for prompt, reply in pairs:
        if len(out) == args.num_prompts:
            break
        ids = source.encode(prompt)
        out_len = args.sharegpt_output_len or len(source.encode(reply))
        if len(ids) < 2 or out_len < 2:
            continue
        out.append(BenchRequest(prompt_ids=ids, output_len=out_len, prompt_text=prompt,
                                messages=[{"role": "user", "content": prompt}]))
    if len(out) < args.num_prompts:
        raise DatasetError(f"--dataset-path {path!r} has {len(out)} usable conversations, "
                           f"--num-prompts asks for {args.num_prompts}")
    return out


def _gsp(args: DatasetArgs, source: TokenSource) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.gsp_num_groups):
        system, system_ids = source.exact_text(rng, args.gsp_system_prompt_len)
        for _ in range(args.gsp_prompts_per_group):
            question, _ = source.exact_text(rng, args.gsp_question_len)
            text = system + question
            ids = source.encode(text)
            out.append(BenchRequest(prompt_ids=ids, output_len=args.gsp_output_len, prompt_text=text,
                                    messages=[{"role": "system", "content": system},
                                              {"role": "user", "content": question}],
                                    system_tokens=_common_prefix(ids, system_ids)))
    rng.shuffle(out)
    return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def render_chat(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + "assistant: " if add_generation_prompt else text


def _agent(args: DatasetArgs, source: TokenSource, tokenizer) -> list[BenchRequest]:
    """Interleaved multi-turn sessions; requests are listed in the order they are issued."""
    rng = random.Random(args.seed)
    systems = [source.words_text(rng, args.agent_system_prompt_len) for _ in range(args.agent_num_system_prompts)]
    system_prefix_ids = []
    for s in systems:
        bare = render_chat(tokenizer, [{"role": "system", "content": s}], add_generation_prompt=False)
        system_prefix_ids.append(source.encode(bare))
    n_sessions = args.agent_num_sessions or -(-args.num_prompts // args.agent_turns)
    sessions: list[list[BenchRequest]] = []
    for sid in range(n_sessions):
        which = rng.randrange(len(systems))
        history = [{"role": "system", "content": systems[which]}]
        turns = []
        for turn in range(args.agent_turns):
            previous_text = render_chat(tokenizer, history[:-1]) if turn else ""  # the previous prompt
            history.append({"role": "user", "content": source.words_text(rng, args.agent_user_len)})
            text = render_chat(tokenizer, history)
            ids = source.encode(text)
            think = 0.0 if turn == 0 else rng.expovariate(1.0 / args.agent_think_time_s) \
                if args.agent_think_time_s > 0 else 0.0
            suffix = None
            if turn:
                suffix = source.encode(_turn_suffix(previous_text, history[-2]["content"], text,
                                                    history[-1]["content"]))
            turns.append(BenchRequest(prompt_ids=ids, output_len=args.agent_output_len, prompt_text=text,
                                      messages=[dict(m) for m in history], session_id=sid, turn=turn,
                                      think_time_s=think,
                                      system_tokens=_common_prefix(ids, system_prefix_ids[which]),
                                      turn_suffix_ids=suffix))
            # The history carries a fixed reply, so the workload does not depend on the model's output.
            history.append({"role": "assistant", "content": source.words_text(rng, args.agent_assistant_len)})
        sessions.append(turns)
    # Interleave: sessions start in order, and each round issues the next turn of every live session.
    ordered: list[BenchRequest] = []
    for turn in range(args.agent_turns):
        for s in sessions:
            ordered.append(s[turn])
    if args.agent_num_sessions == 0:
        ordered = _first_n_keep_sessions(ordered, args.num_prompts)
    return ordered


def _turn_suffix(previous_prompt: str, reply: str, prompt: str, user: str) -> str:
    """What the chat template puts after a reply: the end of that turn and the next user message."""
    head = previous_prompt + reply
    if prompt.startswith(head):
        return prompt[len(head):]
    return "\n" + user + "\n"  # a template that re-renders the history differently: the message alone


def _first_n_keep_sessions(requests: list[BenchRequest], n: int) -> list[BenchRequest]:
    """n requests, never a turn without its earlier turns."""
    done_turns: dict[int, int] = {}
    out = []
    for r in requests:
        if len(out) == n:
            break
        if done_turns.get(r.session_id, 0) == r.turn:
            out.append(r)
            done_turns[r.session_id] = r.turn + 1
    return out


def shared_system_fraction(requests: Sequence[BenchRequest]) -> float:
    """Share of all prompt tokens that are system-prompt tokens."""
    total = sum(r.prompt_len for r in requests)
    return sum(r.system_tokens for r in requests) / total if total else 0.0


def dataset_summary(requests: Sequence[BenchRequest]) -> dict[str, Any]:
    return {"num_requests": len(requests),
            "prompt_tokens": sum(r.prompt_len for r in requests),
            "expected_output_tokens": sum(r.output_len for r in requests),
            "sessions": len({r.session_id for r in requests if r.session_id is not None}),
            "system_prompt_fraction": round(shared_system_fraction(requests), 4)}
