"""A grammar that starts after the reply's reasoning (`--reasoning-parser`, vLLM's and SGLang's
default): the reasoning is free text, and the grammar (response_format, regex, ebnf, a forced
tool call) holds from the end-of-reasoning token on.

One gate per request wraps its matcher. Where it starts is read off the prompt's last think tag
(`ReasoningFormat.prompt_leaves`):

- the prompt opened `<think>` (a template that writes it): the reply starts in the reasoning;
- the prompt closed a think block (`enable_thinking=false`): the grammar holds from the first
  token, as without a reasoning parser;
- neither (Qwen3's own template leaves `<think>` to the model): the first token is either
  `<think>`, which opens the reasoning, or one the grammar allows, which starts it. Only those
  are allowed, so a reply that does not reason still follows the grammar from its first token
  (waiting for a `</think>` that never comes would leave it unconstrained).

In the reasoning nothing is masked (the row is left out of the step's bitmask: all allowed, or,
when its last token is still on the device, deferred: radixserve.engine.grammar_mask) and nothing
is fed to the matcher; max_new_tokens still bounds the reply. `</think>` ends it; the next
token may be a newline token (what Qwen3 writes before its answer, which the reasoning parser
drops from the content) or one the grammar allows, and the matcher takes everything from there.
"""

from __future__ import annotations

from typing import Optional

from radixserve.chat_formats import ReasoningFormat

# Where the reply is, as the gate has seen its tokens.
UNDECIDED = "undecided"  # the first token opens the reasoning or starts the grammar
REASONING = "reasoning"  # free text until the end-of-reasoning token
LEAD_IN = "lead_in"  # just after it: a newline token may come before the grammar's first token
GRAMMAR = "grammar"  # the matcher takes every token


def first_state(fmt: ReasoningFormat, prompt_ids: list[int]) -> str:
    """Where a reply to this prompt starts (see the module docstring)."""
    leaves = fmt.prompt_leaves(prompt_ids)
    return REASONING if leaves is True else GRAMMAR if leaves is False else UNDECIDED


class GrammarAfterReasoning:
    """A request's matcher behind its reasoning: the scheduler's TokenGrammar, as the plain
    matcher is, and the grammar mask's rows (`constrains_next`, `also_allowed`)."""

    def __init__(self, grammar, fmt: ReasoningFormat, prompt_ids: list[int]):
        self.grammar = grammar  # radixserve.grammar.backend.RequestGrammar
        self.fmt = fmt
        self.state = first_state(fmt, prompt_ids)

    @property
    def matcher(self):
        """The grammar's matcher (the mask fills its row from it)."""
        return self.grammar.matcher

    @property
    def constrains_next(self) -> bool:
        """Whether the next token is masked: everywhere but inside the reasoning."""
        return self.state != REASONING

    def also_allowed(self) -> tuple[int, ...]:
        """Tokens allowed next besides the grammar's own: `<think>` at an undecided start, the
        newline tokens right after `</think>`."""
        if self.state == UNDECIDED:
            return (self.fmt.start_id,)
        if self.state == LEAD_IN:
            return self.after_end_allowed()
        return ()

    @property
    def end_id(self) -> int:
        """The token that ends the reasoning (a deferred mask row looks for it on the device)."""
        return self.fmt.end_id

    def after_end_allowed(self) -> tuple[int, ...]:
        """Tokens allowed right after the end of the reasoning besides the grammar's first ones."""
        return self.fmt.lead_in_ids

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False when neither the reasoning nor the grammar allows it."""
        state = self.state
        if state == REASONING:
            if token == self.fmt.end_id:
                self.state = LEAD_IN
            return True
        if state == GRAMMAR:
            return self.grammar.accept(token)
        # The first token of the reply, or the one after </think>: the grammar's if it takes it
        # (a grammar may itself begin with <think> or a newline), else the gate's own.
        self.state = GRAMMAR
        if self.grammar.accept(token):
            return True
        if state == UNDECIDED and token == self.fmt.start_id:
            self.state = REASONING
            return True
        return state == LEAD_IN and token in self.fmt.lead_in_ids

    @property
    def terminated(self) -> bool:
        return self.state == GRAMMAR and self.grammar.terminated


def gate_grammar(grammar, fmt: Optional[ReasoningFormat], prompt_ids: list[int], after_reasoning: bool):
    """The request's grammar as the engine runs it: behind its reasoning when the request asks
    (`grammar_after_reasoning`) and the engine knows the reasoning format."""
    if not after_reasoning or fmt is None:
        return grammar
    return GrammarAfterReasoning(grammar, fmt, prompt_ids)
