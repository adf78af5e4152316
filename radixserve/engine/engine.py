"""The offline, in-process engine: `Engine(model_path=..., **settings).generate(...)`.

It drives the same scheduler as the server and returns the same shape as the server's native
`/generate` endpoint.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional, Sequence, Union

from radixserve.cache.host_memory import check_host_memory
from radixserve.cache.namespace import cache_namespace, check_cache_salt
from radixserve.default_model import ensure_model_path
from radixserve.engine.core import EngineCore, new_request_id
from radixserve.engine.detokenize import decode_output
from radixserve.engine.messages import GenerateRequest, RequestOutput
from radixserve.grammar.spec import check_grammar, grammar_spec
from radixserve.model.config import ModelConfig
from radixserve.sampling_params import sampling_params_from_dict
from radixserve.settings import ServerSettings

Prompt = Union[str, Sequence[str], None]
InputIds = Union[Sequence[int], Sequence[Sequence[int]], None]


class Engine:
    def __init__(self, model_path: Optional[str] = None, **settings: Any):
        checked = ServerSettings.from_kwargs(model_path=model_path, **settings)  # before any model is built
        self.settings = dataclasses.replace(checked, model_path=ensure_model_path(model_path))
        model_dir = self.settings.model_path
        self.settings.check_context_length(ModelConfig.from_dir(model_dir).max_position_embeddings, repr(model_dir))
        if self.settings.hicache_size > 0:  # before the model loads (a ratio is checked when the tier is built)
            check_host_memory(self.settings.hicache_host_bytes, f"hicache_size={self.settings.hicache_size:g}")
        self.core = EngineCore(self.settings)

    @property
    def tokenizer(self):
        return self.core.tokenizer

    def _requests(self, prompt: Prompt, input_ids: InputIds, sampling_params,
                  cache_salt: Optional[str] = None) -> tuple[list[GenerateRequest], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        check_cache_salt(cache_salt)
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else list(prompt)
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer: pass input_ids")
            if any(not isinstance(p, str) for p in prompts):
                raise ValueError("prompt must be a string or a list of strings")
            ids_list = [self.tokenizer.encode(p) for p in prompts]
        else:
            single = len(input_ids) == 0 or isinstance(input_ids[0], int)
            ids_list = [list(input_ids)] if single else [list(x) for x in input_ids]
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(ids_list):
                raise ValueError(f"{len(sampling_params)} sampling_params for {len(ids_list)} prompts")
            params = [sampling_params_from_dict(p) for p in sampling_params]
        else:
            params = [sampling_params_from_dict(sampling_params) for _ in ids_list]
        for p in params:
            spec = grammar_spec(p)
            if spec is not None:
                check_grammar(*spec)  # a bad grammar is a ValueError before anything is queued
        now = time.monotonic()
        namespace = cache_namespace(cache_salt)
        reqs = [GenerateRequest(rid=new_request_id(), input_ids=ids, sampling_params=p, arrival_time=now,
                                stream=False, cache_namespace=namespace) for ids, p in zip(ids_list, params)]
        return reqs, single

    def generate(self, prompt: Prompt = None, input_ids: InputIds = None,
                 sampling_params: Union[dict, Sequence[dict], None] = None,
                 cache_salt: Optional[str] = None) -> Union[dict, list[dict]]:
        """Generate for one request or a list; every request is validated before any is queued.
        cache_salt: the requests share cached prefixes only with requests of the same salt."""
        reqs, single = self._requests(prompt, input_ids, sampling_params, cache_salt)
        engine_reqs = [self.core.make_req(r) for r in reqs]  # raises before anything is allocated
        for r in engine_reqs:
            self.core.submit(r)
        start = {r.rid: time.perf_counter() for r in reqs}
        results: dict[str, dict] = {}
        outputs: dict[str, list[int]] = {r.rid: [] for r in reqs}
        logprobs: dict[str, list] = {r.rid: [] for r in reqs}
        prompt_logprobs: dict[str, list] = {r.rid: [] for r in reqs}
        while len(results) < len(reqs):
            if self.core.copy_wait_s:
                time.sleep(self.core.copy_wait_s)
            for out in self.core.step():
                if out.rid not in outputs:
                    continue
                outputs[out.rid].extend(out.new_token_ids)
                logprobs[out.rid].extend(out.new_logprobs)
                prompt_logprobs[out.rid].extend(out.input_logprobs)
                if out.finished:
                    results[out.rid] = self._result(out, outputs[out.rid], reqs, start[out.rid])
                    meta = results[out.rid]["meta_info"]
                    if logprobs[out.rid]:
                        meta.update(logprob_meta(outputs[out.rid], logprobs[out.rid]))
                    request = next(r for r in reqs if r.rid == out.rid)
                    if request.sampling_params.wants_prompt_logprobs:
                        meta.update(prompt_logprob_meta(request.input_ids, request.sampling_params.logprob_start_len,
                                                        prompt_logprobs[out.rid]))
        ordered = [results[r.rid] for r in reqs]
        return ordered[0] if single else ordered

    def _result(self, out: RequestOutput, output_ids: list[int], reqs: list[GenerateRequest], t0: float) -> dict:
        params = next(r.sampling_params for r in reqs if r.rid == out.rid)
        return {
            "text": decode_output(self.tokenizer, output_ids, params, out.finish_reason),
            "output_ids": output_ids,
            "meta_info": {
                "id": out.rid,
                "finish_reason": None if out.finish_reason is None else out.finish_reason.as_dict(),
                "prompt_tokens": out.prompt_tokens,
                "completion_tokens": out.completion_tokens,
                "cached_tokens": out.cached_tokens,
                "e2e_latency": time.perf_counter() - t0,
            },
        }

    def cache_stats(self) -> dict[str, Any]:
        return self.core.stats()

    def flush_cache(self) -> bool:
        return self.core.flush_cache()

    def check_invariants(self) -> None:
        self.core.check_invariants()

    def shutdown(self) -> None:
        """Release the engine; with tp_size > 1 this stops its other rank processes."""
        if self.core is not None:
            self.core.shutdown()
        self.core = None  # type: ignore[assignment]

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def logprob_meta(output_ids: list[int], logprobs: list) -> dict[str, Any]:
    """SGLang's meta_info fields: [logprob, token id, None] per output token, and per token its
    top entries in the same shape (the server's /generate fills the text with
    return_text_in_logprobs)."""
    return {"output_token_logprobs": [[lp.logprob, t, None] for lp, t in zip(logprobs, output_ids)],
            "output_top_logprobs": [[[v, i, None] for v, i in zip(lp.top_logprobs, lp.top_ids)]
                                    for lp in logprobs]}


def prompt_logprob_meta(prompt_ids: list[int], start: int, logprobs: list) -> dict[str, Any]:
    """SGLang's prompt fields: [logprob, token id, None] per prompt token from `start` on (the
    prompt's first token has no log probability: None), and per token its top entries (None for
    the first)."""
    head = [[None, prompt_ids[0], None]] if start == 0 else []
    top_head: list = [None] if start == 0 else []
    ids = prompt_ids[max(start, 1):]
    return {"input_token_logprobs": head + [[lp.logprob, t, None] for lp, t in zip(logprobs, ids)],
            "input_top_logprobs": top_head + [[[v, i, None] for v, i in zip(lp.top_logprobs, lp.top_ids)]
                                              for lp in logprobs]}
