"""Reasoning in chat replies (`--reasoning-parser qwen3`): a reply that opens with `<think>` is
split into `reasoning_content` (the text up to `</think>`) and `content` (what follows), streamed
as `delta.reasoning_content` chunks and then `delta.content`, as vLLM and SGLang serve it.

- **Where the reasoning starts.** Qwen3's own template leaves `<think>` to the model; a template
  may write it into the prompt instead (Qwen3's thinking-only releases do), so the reply starts
  inside the reasoning and only `</think>` appears; `enable_thinking=false` writes a closed
  `<think>\\n\\n</think>\\n\\n`, so the reply is all content. The prompt's last think tag, among its
  last `PROMPT_TAIL_TOKENS` tokens, says which: an opening one means the reply starts inside.
  Otherwise only a `<think>` at the very start of the reply (after whitespace) opens reasoning:
  one later in an answer is text.
- **What is kept.** Qwen3 writes `<think>\\n` reasoning `\\n</think>\\n\\n` answer, and its template
  writes a turn back the same way from `reasoning_content.strip('\\n')` and
  `content.lstrip('\\n')`: so the newlines at both ends of the reasoning and at the start of the
  answer are dropped, and a client that sends the turn back gets the model's own text rendered.
  Empty reasoning is none (null).
- **Streams equal replies.** The whole-reply split runs the streaming parser over the whole text,
  so the streamed pieces add up to the non-streamed fields exactly, wherever the detokenizer cut
  the text (a tag split across chunks, or spelled in several tokens, is held until it is whole).
- A reply cut off inside its reasoning (`finish_reason` length) is all reasoning, no content.
"""

from __future__ import annotations

from typing import Optional

# The format's tags and their ids live in the leaf layer: the engine reads them too (a grammar
# starts after the reasoning, radixserve.grammar.reasoning_gate).
from radixserve.chat_formats import REASONING_PARSERS, ReasoningFormat, reasoning_format  # noqa: F401

def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag`."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


# Parser states: before the reply shows whether it reasons; inside the reasoning (newlines at its
# start dropped, then kept); the answer (newlines at its start dropped, then everything).
_UNDECIDED, _REASONING_START, _REASONING, _CONTENT_START, _CONTENT = range(5)


class ReasoningStream:
    """Splits a reply's text, fed as it streams, into reasoning and content pieces."""

    def __init__(self, fmt: ReasoningFormat, in_reasoning: bool):
        self.fmt = fmt
        self.state = _REASONING_START if in_reasoning else _UNDECIDED
        self.held = ""  # text that may still turn out to be (part of) a tag or trailing newlines

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) that can be shown now; either may be empty."""
        text = self.held + delta
        self.held = ""
        reasoning, content = [], []
        while text:
            if self.state == _UNDECIDED:
                head = text.lstrip()
                if head.startswith(self.fmt.start):
                    self.state, text = _REASONING_START, head[len(self.fmt.start):]
                elif self.fmt.start.startswith(head):  # whitespace, or part of the tag
                    self.held, text = text, ""
                else:
                    self.state = _CONTENT
            elif self.state == _REASONING_START or self.state == _CONTENT_START:
                text = text.lstrip("\n")
                if text:
                    self.state += 1
            elif self.state == _REASONING:
                at = text.find(self.fmt.end)
                if at >= 0:
                    reasoning.append(text[:at].rstrip("\n"))
                    self.state, text = _CONTENT_START, text[at + len(self.fmt.end):]
                    continue
                keep = _partial_suffix(text, self.fmt.end)
                body = text[:len(text) - keep]
                shown = body.rstrip("\n")  # newlines that may come right before </think>
                reasoning.append(shown)
                self.held, text = text[len(shown):], ""
            else:
                content.append(text)
                text = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, once the reply is complete."""
        held, self.held = self.held, ""
        if self.state == _UNDECIDED:
            return "", held
        if self.state == _REASONING:
            return held.rstrip("\n"), ""
        return "", ""

    @property
    def in_reasoning(self) -> bool:
        return self.state in (_REASONING_START, _REASONING)


def split_reasoning(text: str, fmt: ReasoningFormat, in_reasoning: bool) -> tuple[Optional[str], str]:
    """(reasoning or None, content) of a whole reply: the streamed pieces, joined."""
    stream = ReasoningStream(fmt, in_reasoning)
    reasoning, content = stream.feed(text)
    rest_reasoning, rest_content = stream.finish()
    reasoning += rest_reasoning
    return (reasoning or None), content + rest_content
