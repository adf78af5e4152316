"""Constrained requests whose grammar is still compiling.

Such a request stays out of the scheduler (so out of admission, holding no KV and no batch row)
until the worker thread has compiled its grammar; everything else keeps running meanwhile. The
engine moves it into the scheduler, with its matcher, at the start of the first step after.
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future
from typing import Optional

from radixserve.grammar.spec import grammar_spec
from radixserve.scheduler.request import Req, ReqState


class GrammarWaitlist:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._compilers = None
        self._disabled: Optional[str] = None  # why constrained decoding is off, when it is
        self.waiting: dict[str, tuple[Req, Future]] = {}

    @property
    def compilers(self):
        """The vocabulary's GrammarCompilers, built (and xgrammar imported) on first use."""
        if self._disabled is not None:
            raise ValueError(self._disabled)
        if self._compilers is None:
            if self.tokenizer is None:
                raise ValueError("constrained decoding (json_schema, regex, ebnf) needs the model's tokenizer")
            from radixserve.grammar.backend import GrammarCompilers

            self._compilers = GrammarCompilers(self.tokenizer, self.vocab_size, self.stop_token_ids)
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
        future = self.compilers.compile(kind, text)
        if future.done():
            req.grammar = self._matcher(future)  # raises ValueError for a bad grammar
            return True
        self.waiting[req.rid] = (req, future)
        return False

    def _matcher(self, future: Future):
        from radixserve.grammar.backend import RequestGrammar

        return RequestGrammar(future.result())

    def take_ready(self) -> tuple[list[Req], list[Req]]:
        """Requests whose grammar is compiled (with their matcher) and requests whose grammar failed
        (finished, with the reason)."""
        ready, failed = [], []
        for rid, (req, future) in list(self.waiting.items()):
            if not future.done():
                continue
            del self.waiting[rid]
            try:
                req.grammar = self._matcher(future)
                ready.append(req)
            except Exception as e:  # noqa: BLE001: a grammar the API did not check (offline use)
                req.finish_reason = {"type": "abort", "message": str(e)}
                req.state = ReqState.FINISHED
                failed.append(req)
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Block until a compile finishes or timeout_s passes (the engine has nothing else to do)."""
        if self.waiting:
            concurrent.futures.wait([f for _, f in self.waiting.values()], timeout=timeout_s,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def abort(self, rid: str) -> Optional[Req]:
        entry = self.waiting.pop(rid, None)
        if entry is None:
            return None
        req = entry[0]
        req.finish_reason = {"type": "abort", "message": "aborted"}
        req.state = ReqState.FINISHED
        return req
