"""xgrammar in the engine: compiling grammars off the engine loop, one matcher per request, and the
token bitmask of a whole batch.

Compiling a grammar against the vocabulary takes from a millisecond (a small regex) to seconds (a
large JSON Schema on a 150k-token vocabulary). It runs on compile lanes, worker threads (xgrammar
releases the GIL while it compiles: measured, a Python thread kept running at full rate beside a
1.7 s compile), so the engine loop goes on stepping meanwhile and keeps the request out of
admission until it is done. Queued compiles run smallest grammar first, and one lane takes only
small grammars, so a slow compile cannot hold up a small one. A compile nobody waits for any more
(its requests aborted, disconnected or timed out) is dropped before it starts; one that has
started runs to its end (xgrammar cannot interrupt a compile), its result cached for a retry.

Compiled grammars are cached by (kind, text) (agents send the same tool schema on every call),
bounded by their memory (`CompiledGrammar.memory_size_bytes`) as well as their count. The bitmask
of a step holds one row per constrained sampling request; xgrammar fills them in one batched call,
on several threads (`FILL_THREADS`), into a buffer the caller keeps.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from radixserve.grammar.spec import build_grammar


# Distinct compiled grammars kept, and the memory they may hold together: a compiled JSON Schema
# of a 150k vocabulary is from a megabyte to ~80 MB (a 10,000-value enum: 27 MB on the tiny model).
CACHE_ENTRIES = 256
DEFAULT_CACHE_MB = 1024  # --grammar-cache-mb
# Lanes that take any grammar (smallest first), and one more that takes only small grammars.
GENERAL_LANES = 2
SMALL_GRAMMAR_CHARS = 4096
# Threads filling a batch's bitmask rows: a JSON fill costs ~5-100 us per row (see
# docs/structured_outputs.md, "What the fill costs").
FILL_THREADS = max(1, min(8, len(os.sched_getaffinity(0)) // 2 if hasattr(os, "sched_getaffinity")
                          else (os.cpu_count() or 2) // 2))


@dataclass(eq=False)
class _Job:
    key: tuple[str, str]
    seq: int
    future: Future = field(default_factory=Future)
    waiters: int = 0
    started: bool = False

    @property
    def size(self) -> int:
        return len(self.key[1])


class RequestGrammar:
    """One request's matcher: the tokens it has accepted decide the next mask."""

    def __init__(self, compiled):
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)

    # Every next token is masked by the matcher alone (a grammar behind a reasoning says otherwise).
    constrains_next = True

    def also_allowed(self) -> tuple[int, ...]:
        return ()

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it."""
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the request ends here."""
        return self.matcher.is_terminated()


class GrammarCompilers:
    """A vocabulary's grammar compilers, their lanes and the cache of compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_mb: float = DEFAULT_CACHE_MB):
        import xgrammar

        self._xgr = xgrammar
        self.cache_bytes = int(cache_mb * 2**20)
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(set(stop_token_ids)))
        self.vocab_size = vocab_size
        self.info = info
        self.batch_matcher = xgrammar.BatchGrammarMatcher(max_threads=FILL_THREADS)
        self._cache: OrderedDict[tuple[str, str], _Job] = OrderedDict()  # pending and done
        self._cached_bytes = 0
        self._sizes: dict[tuple[str, str], int] = {}
        self._queue: list[_Job] = []
        self._jobs_by_future: dict[int, _Job] = {}
        self._seq = 0
        self._cond = threading.Condition()
        self._stopped = False
        self.skipped = 0  # compiles dropped because nobody waited for them any more
        self._lanes = [threading.Thread(target=self._lane, args=(small_only,), daemon=True,
                                        name=f"grammar-{'small' if small_only else i}")
                       for i, small_only in enumerate([False] * GENERAL_LANES + [True])]
        for lane in self._lanes:
            lane.start()

    @property
    def compiler_threads(self) -> int:
        return len(self._lanes)

    def compile(self, kind: str, text: str) -> Future:
        """A future of the compiled grammar of (kind, text); cached, so a repeat is done at once.
        Each call on a grammar not compiled yet counts a waiter, which `release` gives back."""
        key = (kind, text)
        with self._cond:
            job = self._cache.get(key)
            if job is None:
                self._seq += 1
                job = _Job(key, self._seq)
                self._cache[key] = job
                self._jobs_by_future[id(job.future)] = job
                self._queue.append(job)
                self._cond.notify_all()
            self._cache.move_to_end(key)
            if not job.future.done():
                job.waiters += 1
            return job.future

    def release(self, future: Future) -> None:
        """A waiter of `future` (from `compile`) no longer waits; a compile left with none is
        dropped if it has not started."""
        with self._cond:
            job = self._jobs_by_future.get(id(future))
            if job is None or job.future.done():
                return
            job.waiters = max(0, job.waiters - 1)
            if job.waiters == 0 and not job.started:
                self._queue.remove(job)
                self._forget(job)
                job.future.cancel()
                self.skipped += 1

    def _forget(self, job: _Job) -> None:
        self._jobs_by_future.pop(id(job.future), None)
        if self._cache.get(job.key) is job:
            del self._cache[job.key]
            self._cached_bytes -= self._sizes.pop(job.key, 0)

    def _next_job(self, small_only: bool) -> Optional[_Job]:
        with self._cond:
            while not self._stopped:
                eligible = [j for j in self._queue if not small_only or j.size <= SMALL_GRAMMAR_CHARS]
                if eligible:
                    job = min(eligible, key=lambda j: (j.size, j.seq))
                    self._queue.remove(job)
                    job.started = True
                    job.future.set_running_or_notify_cancel()
                    return job
                self._cond.wait()
        return None

    def _lane(self, small_only: bool) -> None:
        compiler = self._xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        while True:
            job = self._next_job(small_only)
            if job is None:
                return
            try:
                # The API process already checked (kind, text) with build_grammar; this adds the vocabulary.
                result = compiler.compile_grammar(build_grammar(*job.key))
            except BaseException as e:  # noqa: BLE001: handed to the requests waiting for it
                with self._cond:
                    self._jobs_by_future.pop(id(job.future), None)
                    self._account(job, 0)
                job.future.set_exception(e)
                continue
            with self._cond:
                self._jobs_by_future.pop(id(job.future), None)
                self._account(job, int(result.memory_size_bytes))
            job.future.set_result(result)

    def _account(self, job: _Job, size: int) -> None:
        """Keep a compiled grammar in the cache if it fits, evicting the least recently used."""
        if self._cache.get(job.key) is not job:
            return
        if size > self.cache_bytes:
            del self._cache[job.key]  # its requests hold it; a repeat compiles anew
            return
        self._sizes[job.key] = size
        self._cached_bytes += size
        for key in list(self._cache):
            if self._cached_bytes <= self.cache_bytes and len(self._cache) <= CACHE_ENTRIES:
                break
            old = self._cache[key]
            if old is job or not old.future.done():
                continue
            del self._cache[key]
            self._cached_bytes -= self._sizes.pop(key, 0)

    def cache_stats(self) -> dict[str, int]:
        with self._cond:
            return {"entries": len(self._cache), "bytes": self._cached_bytes, "queued": len(self._queue),
                    "skipped": self.skipped}

    def fill_bitmask(self, grammars: Sequence[RequestGrammar], out: torch.Tensor) -> None:
        """Fill out[i] (int32 [>= len(grammars), ceil(vocab / 32)] on the host, contiguous) with the
        tokens grammars[i] allows next."""
        self.batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars], out)

    def shutdown(self) -> None:
        """Stop the lanes (daemon threads: a compile under way does not hold up the exit)."""
        with self._cond:
            self._stopped = True
            for job in self._queue:
                job.future.cancel()
            self._queue.clear()
            self._cond.notify_all()
