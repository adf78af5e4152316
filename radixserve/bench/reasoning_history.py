"""What dropping a reasoning model's earlier reasoning costs the prefix cache, measured on a real
server: `python -m radixserve.bench.reasoning_history`.

Qwen3's chat template writes an earlier assistant turn without its `<think>` block, so each
request's prompt stops matching the cached conversation where the previous reply's reasoning
began, and everything after it (the reply's answer or tool call, and with tools the whole
tool-calling loop since the last user message) is computed again. `keep_reasoning` (the
`qwen3` template's variable, `--keep-reasoning-history` server-wide) renders the history as
generated instead. This runs one agent conversation both ways and reports, per request, the
prompt tokens, the cached tokens (`usage.prompt_tokens_details.cached_tokens`) and the tokens
computed (prompt - cached).

The replies are scripted, so the counts do not depend on the model: each is forced by an EBNF
grammar of its text (SGLang's `ebnf` field, over the whole reply: `--grammar-in-reasoning`) with
`logit_bias` on the text's own tokens, longer ones favoured, so the model writes the tokens the
tokenizer gives the text (`forced_reply` checks that this holds before sending). By default the script starts a CPU server over the tiny
random Qwen3 built with Qwen3's chat format and tokenizer tags; `--tokenizer DIR` counts in
Qwen3's own tokens instead (the tokenizer from `scripts/qwen2_tokenizer.py --qwen3`, dummy
weights); `--base-url` measures a running server (it needs `--reasoning-parser qwen3` and a
template that reads keep_reasoning, `--grammar-in-reasoning` so the grammars hold the reasoning
too, and `--tokenizer-path` the served tokenizer).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import httpx

from radixserve.chat_formats import KEEP_REASONING

# Bias of the scripted tokens: the longest ones highest, so where two of them fit the text the
# longer wins (the tokenizer's own choice for these scripts; forced_reply checks it), all far
# above any other token the grammar still allows.
BIAS_LOW, BIAS_HIGH = 40.0, 100.0
# Words of the tiny tokenizer that are one token each (with their leading space).
WORDS = ("the", "mill", "every", "about", "answers", "book", "capital", "each", "keep", "like", "many",
         "next", "once", "one", "question", "read", "request", "small", "sun", "time", "told", "turn", "with",
         "words", "work", "and", "into", "done", "cat", "was")
SYSTEM = ("You are a careful assistant. Answer the question as clearly and briefly as you can, and use the "
          "tools when a question needs facts.")
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a fact up.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]


def ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal (xgrammar's dialect)."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def forced_reply(tokenizer, text: str) -> dict[str, Any]:
    """Request fields that make any model write exactly `text` in the tokens the tokenizer gives
    it: an EBNF grammar of the text and logit_bias on those tokens, longer ones higher (a reply
    with reasoning needs a server whose grammars hold the reasoning: --grammar-in-reasoning). ValueError
    when the bias would not pick those tokens (two of them of the same length fit one place)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = {i: tokenizer.decode([i]) for i in set(ids)}
    lengths = sorted({len(p) for p in pieces.values()})
    step = (BIAS_HIGH - BIAS_LOW) / max(1, len(lengths) - 1)
    bias = {i: BIAS_LOW + step * lengths.index(len(p)) for i, p in pieces.items()}
    chosen, at = [], 0
    while at < len(text):  # what the biased tokens spell, the highest bias first wherever several fit
        fits = sorted(((bias[i], i) for i, p in pieces.items() if text.startswith(p, at)), reverse=True)
        if not fits or (len(fits) > 1 and fits[0][0] == fits[1][0]):
            raise ValueError(f"the bias cannot force the tokens of {text!r} at character {at}")
        chosen.append(fits[0][1])
        at += len(pieces[fits[0][1]])
    if chosen != ids:
        raise ValueError(f"the bias would write {text!r} in other tokens than the tokenizer's")
    return {"ebnf": f"root ::= {ebnf_literal(text)}", "logit_bias": {str(i): b for i, b in bias.items()},
            "temperature": 0.0, "max_tokens": len(ids) + 1}


def reply_text(reasoning: str, answer: Optional[str] = None, call: Optional[dict[str, Any]] = None) -> str:
    """A Qwen3 reply: the reasoning block, then the answer or a tool call."""
    head = f"<think>\n{reasoning}\n</think>\n\n"
    if call is not None:
        return head + f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"
    return head + (answer or "")


@dataclass
class Conversation:
    """A scripted agent conversation: per user turn, tool steps, then an answer."""

    turns: int = 3
    tool_steps: int = 2
    reasoning_words: int = 60
    answer_words: int = 20
    tool_result_words: int = 40
    seed: int = 0
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def script(self) -> list[dict[str, Any]]:
        """The conversation's events in order: user messages, replies to force, tool results."""
        events = []
        for turn in range(self.turns):
            events.append({"user": f"Question {turn + 1}: {self.words(12)}?"})
            for step in range(self.tool_steps):
                call = {"name": "lookup", "arguments": {"query": self.words(3)}}
                events.append({"reply": reply_text(self.words(self.reasoning_words), call=call),
                               "turn": turn + 1, "step": step + 1})
                events.append({"tool": self.words(self.tool_result_words)})
            events.append({"reply": reply_text(self.words(self.reasoning_words), self.words(self.answer_words)),
                           "turn": turn + 1, "step": self.tool_steps + 1})
        return events


def run_conversation(http: httpx.Client, tokenizer, conversation: Conversation, keep: bool,
                     model: Optional[str] = None) -> list[dict[str, Any]]:
    """Send the conversation's requests one after another; a row per request."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    rows = []
    calls = 0
    for event in conversation.script():
        if "user" in event:
            messages.append({"role": "user", "content": event["user"]})
            continue
        if "tool" in event:
            messages.append({"role": "tool", "tool_call_id": f"call_{calls}", "content": event["tool"]})
            continue
        body = {"messages": messages, "tools": TOOLS, "chat_template_kwargs": {KEEP_REASONING: keep},
                **forced_reply(tokenizer, event["reply"])}
        if model is not None:
            body["model"] = model
        r = http.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")
        answer = r.json()
        message, usage = answer["choices"][0]["message"], answer["usage"]
        rows.append({"turn": event["turn"], "step": event["step"], "prompt": usage["prompt_tokens"],
                     "cached": usage["prompt_tokens_details"]["cached_tokens"],
                     "completion": usage["completion_tokens"],
                     "reasoning": usage.get("completion_tokens_details", {}).get("reasoning_tokens")})
        sent: dict[str, Any] = {"role": "assistant", "content": message.get("content"),
                                "reasoning_content": message.get("reasoning_content")}
        if message.get("tool_calls"):
            calls += 1
            sent["tool_calls"] = [{**c, "id": f"call_{calls}"} for c in message["tool_calls"]]
        messages.append(sent)
    return rows


def table(default: list[dict[str, Any]], keep: list[dict[str, Any]]) -> str:
    """Markdown: per request, both templates side by side, and the totals."""
    lines = ["| turn.step | default: prompt | cached | computed | keep_reasoning: prompt | cached | computed |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for a, b in zip(default, keep):
        lines.append(f"| {a['turn']}.{a['step']} | {a['prompt']} | {a['cached']} | {a['prompt'] - a['cached']} | "
                     f"{b['prompt']} | {b['cached']} | {b['prompt'] - b['cached']} |")
    total = {name: (sum(r["prompt"] for r in rows), sum(r["cached"] for r in rows))
             for name, rows in (("default", default), ("keep", keep))}
    (pa, ca), (pb, cb) = total["default"], total["keep"]
    lines.append(f"| total | {pa} | {ca} | {pa - ca} | {pb} | {cb} | {pb - cb} |")
    return "\n".join(lines)


def build_model(workdir: Path, tokenizer_dir: Optional[str] = None) -> tuple[Path, list[str]]:
    """The model directory to serve and the flags it needs: the tiny random Qwen3 with Qwen3's chat
    format, or with `tokenizer_dir`'s tokenizer (Qwen3's, from scripts/qwen2_tokenizer.py --qwen3)
    and dummy weights of the tiny shape over its vocabulary."""
    import shutil

    from radixserve.testing.tiny_model import build_tiny_model

    model = build_tiny_model(workdir / "tiny-qwen3", family="qwen3", chat_format="qwen3")
    if tokenizer_dir is None:
        return model, []
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    for path in model.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template")) or path.suffix == ".safetensors":
            path.unlink()
    for path in Path(tokenizer_dir).iterdir():
        shutil.copy(path, model / path.name)
    config = json.loads((model / "config.json").read_text())
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    config.update(vocab_size=-(-len(tokenizer) // 128) * 128, eos_token_id=eos, bos_token_id=eos, pad_token_id=eos)
    (model / "config.json").write_text(json.dumps(config, indent=2))
    return model, ["--load-format", "dummy"]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m radixserve.bench.reasoning_history",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="a running server (default: start a CPU server over the tiny model)")
    parser.add_argument("--tokenizer-path", help="the served tokenizer, with --base-url")
    parser.add_argument("--tokenizer", help="measure with this tokenizer directory (Qwen3's, from "
                                            "scripts/qwen2_tokenizer.py --qwen3): the started server runs the tiny "
                                            "shape over its vocabulary with dummy weights")
    parser.add_argument("--turns", type=int, default=3, help="user turns (default: 3)")
    parser.add_argument("--tool-steps", type=int, default=2, help="tool calls before each answer (default: 2)")
    parser.add_argument("--reasoning-words", type=int, default=60, help="words of each reply's reasoning (default: 60)")
    parser.add_argument("--answer-words", type=int, default=20, help="words of each answer (default: 20)")
    parser.add_argument("--tool-result-words", type=int, default=40, help="words of each tool result (default: 40)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    conversation = dict(turns=args.turns, tool_steps=args.tool_steps, reasoning_words=args.reasoning_words,
                        answer_words=args.answer_words, tool_result_words=args.tool_result_words)
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        server = None
        if args.base_url is None:
            from radixserve.experiment.processes import Server

            model, flags = build_model(Path(tmp), args.tokenizer)
            server = Server(["--model-path", str(model), "--device", "cpu", "--reasoning-parser", "qwen3",
                             "--grammar-in-reasoning", *flags], Path(tmp) / "server.log")
            server.wait_ready(300)
            base_url, tokenizer_path = server.base_url, str(model)
        else:
            if args.tokenizer_path is None:
                parser.error("--base-url needs --tokenizer-path")
            base_url, tokenizer_path = args.base_url, args.tokenizer_path
        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
            rows = {}
            with httpx.Client(base_url=base_url, timeout=300) as http:
                for keep in (False, True):
                    http.post("/flush_cache").raise_for_status()  # each run starts from an empty cache
                    rows[keep] = run_conversation(http, tokenizer, Conversation(**conversation), keep)
        finally:
            if server is not None:
                server.stop()
    print(table(rows[False], rows[True]))
    if args.json:
        Path(args.json).write_text(json.dumps({"default": rows[False], "keep_reasoning": rows[True]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
