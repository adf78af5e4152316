"""xgrammar in the engine: compiling grammars off the engine loop, one matcher per request, and the
token bitmask of a whole batch.

Compiling a grammar against the vocabulary takes from a millisecond (a small regex) to a good part
of a second (a large JSON Schema on a 150k-token vocabulary), so it runs in a worker thread
(`GrammarCompilers.compile` returns a future) and the engine keeps the request out of admission
until it is done. Compiled grammars are cached by (kind, text): agents send the same tool schema
on every call. The bitmask of a step holds one row per constrained sampling request; xgrammar fills
them in one batched call, on several threads (`FILL_THREADS`), into a buffer the caller keeps.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from radixserve.grammar.spec import build_grammar

# Distinct compiled grammars kept; a compiled JSON Schema of a 150k vocabulary is about a megabyte.
CACHE_ENTRIES = 256
COMPILE_THREADS = 1
# Threads filling a batch's bitmask rows: a JSON fill costs ~5-100 us per row (see
# docs/structured_outputs.md, "What the fill costs").
FILL_THREADS = max(1, min(8, len(os.sched_getaffinity(0)) // 2 if hasattr(os, "sched_getaffinity")
                          else (os.cpu_count() or 2) // 2))


class RequestGrammar:
    """One request's matcher: the tokens it has accepted decide the next mask."""

    def __init__(self, compiled):
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False when the grammar does not allow it."""
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the request ends here."""
        return self.matcher.is_terminated()


class GrammarCompilers:
    """A vocabulary's grammar compiler, its worker thread and the cache of compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(set(stop_token_ids)))
        self.vocab_size = vocab_size
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
        self.executor = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        self.batch_matcher = xgrammar.BatchGrammarMatcher(max_threads=FILL_THREADS)
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, kind: str, text: str) -> Future:
        """A future of the compiled grammar of (kind, text); cached, so a repeat is done at once."""
        key = (kind, text)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self.executor.submit(self._compile, kind, text)
            self._cache[key] = future
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return future

    def _compile(self, kind: str, text: str):
        # The API process already parsed (kind, text) with build_grammar; this adds the vocabulary.
        return self.compiler.compile_grammar(build_grammar(kind, text))

    def fill_bitmask(self, grammars: Sequence[RequestGrammar], out: torch.Tensor) -> None:
        """Fill out[i] (int32 [>= len(grammars), ceil(vocab / 32)] on the host, contiguous) with the
        tokens grammars[i] allows next."""
        self.batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars], out)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
