"""A request's state inside the engine, from arrival to finish."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional, Protocol

import torch

from radixserve.cache.admission import Admission, AdmissionRecord
from radixserve.cache.prefix_cache import TreeNode
from radixserve.sampling_params import FinishReason, SamplingParams, TokenLogprob


class ReqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class TokenGrammar(Protocol):
    """A request's grammar matcher (radixserve.grammar.backend.RequestGrammar, or
    radixserve.grammar.reasoning_gate.GrammarAfterReasoning in front of one)."""

    @property
    def constrains_next(self) -> bool:
        """Whether the next token is masked (not inside a reasoning the grammar waits behind)."""

    def also_allowed(self) -> tuple[int, ...]:
        """Tokens allowed next besides the ones the grammar's matcher allows."""

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it."""

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token accepted."""


@dataclass(eq=False)  # identity equality: requests live in sets and dicts
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    arrival_seq: int
    log: bool = False
    stream: bool = True  # outputs every --stream-interval tokens; else the first token and the end
    # Its cache namespace (radixserve.cache.namespace; None: the shared one): it shares cached
    # prefixes only with requests of the same one.
    cache_namespace: Optional[str] = None
    # Positions of its prompt where later requests are likely to branch off it, as the client's
    # request says (the end of a chat's system turn): a hybrid model's cache keeps the state there
    # (Admission.lock). () for most requests.
    branch_hints: tuple[int, ...] = ()

    state: ReqState = ReqState.WAITING
    output_ids: list[int] = field(default_factory=list)
    # Positions [0, kv_len) have slots in req_to_token; after the step that computes them, their KV.
    kv_len: int = 0
    # Positions [0, locked_len) are the radix tree's, kept from eviction by locking `last_node`;
    # the slots after them are req's own until they go into the tree (KVManager.cache_req).
    locked_len: int = 0
    last_node: Optional[TreeNode] = None
    req_pool_idx: Optional[int] = None
    # KV slot of each position with a slot (whole pages: len(slots) == page_ceil(kv_len)).
    slots: list[int] = field(default_factory=list)
    # Positions its prompt pieces must end at, ascending (Admission.lock): there the cache
    # keeps the state it needs beyond KV (a hybrid model's branch point); () for most requests.
    chunk_ends: tuple[int, ...] = ()
    # Cached prompt tokens found when first admitted (reported to the user).
    cached_tokens: int = -1
    # Whether its cached prefix, when first admitted, ran through a finished request's whole prompt
    # (Conversations.extends_a_prompt): a later turn of a conversation.
    continues_conversation: bool = False
    # What the cache keeps of it between its admissions (the copies of its prefix it started for
    # it); only the cache reads it (cache.admission).
    admission_record: AdmissionRecord = field(default_factory=AdmissionRecord)
    # The cache's answer when it was admitted, holding its locked prefix while it runs (None while
    # it waits).
    admission: Optional[Admission] = None
    # The scheduler's view while waiting: length of the cached prefix and the node it reaches.
    peek_len: int = 0
    peek_node: Optional[TreeNode] = None
    peek_key: object = None  # what change under peek_node could lengthen the match
    finish_reason: Optional[FinishReason] = None
    num_retractions: int = 0
    admitted_time: Optional[float] = None
    first_token_time: Optional[float] = None
    generator: Optional[torch.Generator] = None
    # Log probabilities of each output token, when the request asked for them (aligned with output_ids).
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Prompt log probabilities (sampling_params.logprob_start_len): of prompt tokens
    # max(logprob_start_len, 1) onwards, in order, gathered over the prompt's chunks.
    input_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Output tokens already sent to the caller.
    sent_len: int = 0
    # Tokens sampled by a launched step whose value the host has not read yet (0 or 1 when a step
    # is scheduled; see StepInFlight). Their positions count in seq_len: with overlap scheduling
    # the next step is built on positions alone and the model reads such a token from the device.
    pending: int = 0
    # Constrained decoding: the matcher every sampled token advances (None: unconstrained). A
    # step sampling for it is masked only once the step before has been collected.
    grammar: Optional[TokenGrammar] = None

    @cached_property
    def sampling_flags(self) -> int:
        """sampling_params.sampling_flags(), worked out once: every decode step reads it."""
        return self.sampling_params.sampling_flags()

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids) + self.pending

    @property
    def num_generated(self) -> int:
        """Output tokens sampled so far, those still on the device included."""
        return len(self.output_ids) + self.pending

    @property
    def remaining(self) -> int:
        """Tokens whose KV is still to be computed before the next token can be sampled."""
        return self.seq_len - self.kv_len

    @property
    def prompt_logprobs_from(self) -> Optional[int]:
        """The first position whose logits a prompt log probability still needs (the logits of
        position q give the log probability of prompt token q + 1); None when none is needed."""
        start = self.sampling_params.logprob_start_len
        if start < 0:
            return None
        pos = max(start, 1) - 1 + len(self.input_logprobs)
        return pos if pos < len(self.origin_input_ids) - 1 else None

    def prompt_logprob_positions(self, start: int, end: int) -> range:
        """Positions in [start, end) whose logits give a prompt log probability not yet gathered."""
        first = self.prompt_logprobs_from
        if first is None:
            return range(0)
        return range(max(start, first), min(end, len(self.origin_input_ids) - 1))

    def match_target(self) -> list[int]:
        """Tokens looked up in the cache: all but the last, which must be computed to get logits,
        and none from the first position whose logits prompt log probabilities need."""
        ids = self.fill_ids
        end = len(ids) - 1
        first = self.prompt_logprobs_from
        return ids[: end if first is None else min(end, first)]

    def remaining_new_tokens(self) -> int:
        return self.sampling_params.max_new_tokens - self.num_generated
