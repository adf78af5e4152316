"""Constrained requests whose grammar is still compiling.

Such a request stays out of the scheduler (so out of admission, holding no KV and no batch row)
until a compile lane has compiled its grammar; everything else keeps running meanwhile. The
engine moves it into the scheduler, with its matcher, at the start of the first step after. A
request that waits longer than the compile timeout ends with an error naming it (the server
answers 400); one that is aborted stops waiting, and a compile nobody waits for is dropped.
"""

from __future__ import annotations

import concurrent.futures
import time
from concurrent.futures import Future
from typing import NamedTuple, Optional

from radixserve.chat_formats import ReasoningFormat
from radixserve.grammar.reasoning_gate import gate_grammar
from radixserve.grammar.spec import GRAMMAR_COMPILE_TIMEOUT, INVALID_GRAMMAR, grammar_spec
from radixserve.sampling_params import FinishReason
from radixserve.scheduler.request import Req, ReqState

# How long a request waits for its grammar to compile. The schema limits keep a compile within a
# few seconds on a 150k vocabulary; beyond this the request fails rather than waiting on.
DEFAULT_COMPILE_TIMEOUT_S = 20.0  # --grammar-compile-timeout-s


class _Waiting(NamedTuple):
    req: Req
    future: Future
    deadline: float


class GrammarWaitlist:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], *,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S, cache_mb: float = 1024,
                 reasoning: Optional[ReasoningFormat] = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.compile_timeout_s = compile_timeout_s
        self.cache_mb = cache_mb
        self.reasoning = reasoning  # what a grammar_after_reasoning request's grammar waits behind
        self._compilers = None
        self._disabled: Optional[str] = None  # why constrained decoding is off, when it is
        self.waiting: dict[str, _Waiting] = {}
        self.timed_out = 0

    @property
    def compilers(self):
        """The vocabulary's GrammarCompilers, built (and xgrammar imported) on first use."""
        if self._disabled is not None:
            raise ValueError(self._disabled)
        if self._compilers is None:
            if self.tokenizer is None:
                raise ValueError("constrained decoding (json_schema, regex, ebnf) needs the model's tokenizer")
            from radixserve.grammar.backend import GrammarCompilers

            self._compilers = GrammarCompilers(self.tokenizer, self.vocab_size, self.stop_token_ids, self.cache_mb)
        return self._compilers

    def disable(self, reason: str) -> None:
        """Refuse every constrained request with `reason` (a ValueError at intake)."""
        self._disabled = reason

    def __len__(self) -> int:
        return len(self.waiting)

    def __contains__(self, rid: str) -> bool:
        return rid in self.waiting

    def add(self, req: Req) -> bool:
        """Start compiling req's grammar; True when it was cached (req has its matcher and can be
        scheduled now), False when req waits here. ValueError for a grammar that does not compile."""
        kind, text = grammar_spec(req.sampling_params)
        compilers = self.compilers
        future = compilers.compile(kind, text)
        if future.done():
            req.grammar = self._matcher(future, req)  # raises ValueError for a bad grammar
            return True
        self.waiting[req.rid] = _Waiting(req, future, time.monotonic() + self.compile_timeout_s)
        return False

    def _matcher(self, future: Future, req: Req):
        from radixserve.grammar.backend import RequestGrammar

        return gate_grammar(RequestGrammar(future.result()), self.reasoning, req.origin_input_ids,
                            req.sampling_params.grammar_after_reasoning)

    def take_ready(self) -> tuple[list[Req], list[Req]]:
        """Requests whose grammar is compiled (with their matcher) and requests that end here:
        their grammar failed, or did not compile within the timeout (finished, with the reason)."""
        ready, failed = [], []
        now = time.monotonic()
        for rid, (req, future, deadline) in list(self.waiting.items()):
            if not future.done():
                if now >= deadline:
                    del self.waiting[rid]
                    self._compilers.release(future)
                    self.timed_out += 1
                    failed.append(self._finish(req, GRAMMAR_COMPILE_TIMEOUT,
                                               f"the grammar did not compile within the {self.compile_timeout_s:g} s "
                                               "grammar compile timeout; simplify the schema"))
                continue
            del self.waiting[rid]
            try:
                req.grammar = self._matcher(future, req)
                ready.append(req)
            except Exception as e:  # noqa: BLE001: a grammar the API did not check (offline use)
                failed.append(self._finish(req, INVALID_GRAMMAR, str(e)))
        return ready, failed

    @staticmethod
    def _finish(req: Req, code: str, message: str) -> Req:
        req.finish_reason = FinishReason("abort", message=message, code=code)
        req.state = ReqState.FINISHED
        return req

    def wait(self, timeout_s: float) -> None:
        """Block until a compile finishes, a wait times out, or timeout_s passes (the engine has
        nothing else to do)."""
        if self.waiting:
            nearest = min(w.deadline for w in self.waiting.values()) - time.monotonic()
            concurrent.futures.wait([w.future for w in self.waiting.values()], timeout=max(0.0, min(timeout_s, nearest)),
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def abort(self, rid: str) -> Optional[Req]:
        entry = self.waiting.pop(rid, None)
        if entry is None:
            return None
        self._compilers.release(entry.future)
        req = entry.req
        req.finish_reason = FinishReason("abort", message="aborted")
        req.state = ReqState.FINISHED
        return req
