"""Chat formats the server knows by name: Qwen3's prompt format as our own Jinja template, and the
tags and added tokens of Qwen3's reasoning and tool calls.

`QWEN3_CHAT_TEMPLATE` writes what Qwen3's published template writes: ChatML turns
(`<|im_start|>role\\n...<|im_end|>\\n`, no default system turn), `tools` as JSON lines inside
`<tools></tools>` in the system turn, an assistant's calls as `<tool_call>` blocks, tool results
as `<tool_response>` blocks grouped in one user turn, `enable_thinking=false` adding an empty
`<think>\\n\\n</think>\\n\\n` to the generation prompt, and an assistant turn's reasoning
(`reasoning_content`, or a `<think>` block inside `content`) kept only for the turns after the last
user query (a tool-calling loop in progress) and dropped from earlier turns. Only the wording of
the tools preamble is ours.

`ReasoningFormat` is the reasoning tags as the tokenizer spells them: the API process splits a
reply's reasoning with it, and the engine starts a grammar after it (both read it here, in the
leaf layer).

`SystemTurns` finds where a ChatML prompt's leading system and developer turns end from its tokens
alone, so that a prompt the client rendered itself (/v1/completions, token ids, the offline
engine) marks that branch point for a hybrid model's cache as the chat API does.

One variable is ours too: `keep_reasoning` true renders every earlier assistant turn with its
reasoning as the model generated it (`<think>\\n` reasoning `\\n</think>\\n\\n` content), so the
next turn's prompt extends the previous turn's whole sequence and the radix cache finds all of it
(`--keep-reasoning-history`; docs/tuning.md, "Reasoning history and the prefix cache").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

THINK_START = "<think>"
THINK_END = "</think>"
# Qwen3's added tokens beyond Qwen2's special tokens, none of them special (so decoding with
# skip_special_tokens keeps them in the text the parsers read): ids 151665-151668 in Qwen3's
# tokenizer. <tool_call>/</tool_call> are Qwen2's added tokens, not special in Qwen3 either.
QWEN3_TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
QWEN3_ADDED_TOKENS = ("<tool_response>", "</tool_response>", THINK_START, THINK_END)
# The template variable that keeps every earlier turn's reasoning.
KEEP_REASONING = "keep_reasoning"

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SYSTEM_ROLES = ("system", "developer")

REASONING_PARSERS = ("qwen3",)
# How far back from the end of a prompt its think tags are looked for: the generation prompt's
# tags sit in its last few tokens; an earlier turn's reasoning never decides.
PROMPT_TAIL_TOKENS = 16
# What Qwen3 writes between `</think>` and its answer ("\n\n", one token in its vocabulary).
ANSWER_LEAD_IN = ("\n", "\n\n")


@dataclass(frozen=True)
class ReasoningFormat:
    """A model's reasoning tags, as text and as the token ids its tokenizer gives them, and the
    ids of the newline tokens that may come between the end of the reasoning and the answer."""

    start: str
    end: str
    start_id: int
    end_id: int
    lead_in_ids: tuple[int, ...] = ()

    def prompt_leaves(self, prompt_ids: list[int]) -> Optional[bool]:
        """What the prompt's last think tag (among its last PROMPT_TAIL_TOKENS tokens) leaves the
        reply: True inside an opened `<think>` (a template that opens it), False after a closed
        block (`enable_thinking=false`), None when it has none (the reply may open one)."""
        for token in reversed(prompt_ids[-PROMPT_TAIL_TOKENS:]):
            if token == self.start_id:
                return True
            if token == self.end_id:
                return False
        return None

    def starts_in_reasoning(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt leaves the reply inside an opened `<think>`."""
        return self.prompt_leaves(prompt_ids) is True

    def reasoning_tokens(self, output_ids: list[int], in_reasoning: bool) -> int:
        """Output tokens inside the reasoning (the tags themselves not counted)."""
        count, started = 0, in_reasoning
        for token in output_ids:
            if token == self.end_id:
                return count
            if token == self.start_id and not started:
                started = True
            elif started:
                count += 1
            else:  # the reply did not open with <think>: it has no reasoning
                return 0
        return count


def reasoning_format(name: str, tokenizer) -> ReasoningFormat:
    """The format `--reasoning-parser name` reads; ValueError when the tokenizer does not have its
    tags as single tokens (they decide where the reply starts, count reasoning tokens, and start a
    grammar that waits for the reasoning)."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not one of {', '.join(REASONING_PARSERS)}")
    if tokenizer is None:
        raise ValueError("--reasoning-parser needs the model's tokenizer")
    ids = []
    for tag in (THINK_START, THINK_END):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"--reasoning-parser {name}: the tokenizer has no {tag} token (it spells it in "
                             f"{len(encoded)} tokens); this model does not reason in Qwen3's format")
        ids.append(encoded[0])
    lead_in = [tokenizer.encode(text, add_special_tokens=False) for text in ANSWER_LEAD_IN]
    return ReasoningFormat(THINK_START, THINK_END, ids[0], ids[1],
                           tuple(sorted({e[0] for e in lead_in if len(e) == 1})))


QWEN3_CHAT_TEMPLATE = """\
{%- set keep = keep_reasoning is defined and keep_reasoning %}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to answer the request. Their signatures are inside \
<tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nTo call a function, write a JSON object with its name and arguments inside \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n\
</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{#- The last user query (a user turn that is not a tool result): reasoning after it is kept. #}
{%- set ns = namespace(last_query=messages | length - 1, found=false) %}
{%- for message in messages | reverse %}
    {%- if not ns.found and message.role == 'user' and message.content is string
           and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.found = true %}
        {%- set ns.last_query = messages | length - 1 - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {#- Set here, not inside a role's branch: jinja2's analysis would count it a template variable. #}
    {%- set reasoning = '' %}
    {%- if message.role == 'assistant' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
    {%- endif %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- if keep or (loop.index0 > ns.last_query and (loop.last or reasoning)) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'
                + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- set call = call.function if call.function is defined else call %}
            {{- ('\\n' if (content or not loop.first) else '') + '<tool_call>\\n{"name": "' + call.name
                + '", "arguments": ' }}
            {{- call.arguments if call.arguments is string else (call.arguments | tojson) }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Templates `--chat-template` takes by name instead of a file.
BUILTIN_CHAT_TEMPLATES = {"qwen3": QWEN3_CHAT_TEMPLATE}


@dataclass(frozen=True)
class SystemTurns:
    """A ChatML tokenizer's turn markers as token ids: `<|im_start|>system` and
    `<|im_start|>developer` (each role's head), `<|im_end|>` and the newline the template writes
    after it."""

    heads: tuple[tuple[int, ...], ...]
    end: int
    newline: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer) -> Optional["SystemTurns"]:
        """The tokenizer's markers; None for a tokenizer without ChatML's control tokens."""
        vocab = tokenizer.get_vocab()
        if IM_START not in vocab or IM_END not in vocab:
            return None
        heads = tuple(tuple(tokenizer.encode(IM_START + role, add_special_tokens=False)) for role in SYSTEM_ROLES)
        return cls(heads, vocab[IM_END], tuple(tokenizer.encode("\n", add_special_tokens=False)))

    def end_of(self, ids: list[int]) -> Optional[int]:
        """How many of a prompt's tokens its leading system and developer turns take (what every
        chat on the same system prompt shares, the chat API's `system_turn_end` for a ChatML
        template); None when it starts with no such turn or nothing follows it."""
        pos = 0
        while True:
            head = next((h for h in self.heads if tuple(ids[pos:pos + len(h)]) == h), None)
            if head is None:
                break
            try:
                pos = ids.index(self.end, pos + len(head)) + 1
            except ValueError:
                return None  # an unfinished system turn: the prompt is all system prompt
            if tuple(ids[pos:pos + len(self.newline)]) == self.newline:
                pos += len(self.newline)
        return pos if 0 < pos < len(ids) else None
