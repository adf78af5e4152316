"""The GPU tests' oracle, shared by every model family: random token-id prompts, transformers'
greedy continuation on CUDA, ours through the Engine, how far two greedy outputs agree, and the
checks every family's tests run on them."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch
import transformers

from radixserve import Engine

MAX_NEW = 24


def prompts(n: int, vocab: int, seed: int, longest: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(5, longest))] for _ in range(n)]


def hf_greedy(path: str, dtype: torch.dtype, batch: list[list[int]], architecture: Optional[str] = None
              ) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (`architecture`: the class
    the checkpoint must load as)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()
    assert architecture is None or type(hf).__name__ == architecture, type(hf).__name__
    out = []
    for p in batch:
        with torch.no_grad():
            ids = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                              do_sample=False, pad_token_id=0)[0].tolist()
        out.append(ids[len(p):])
    return out


def hf_greedy_fp32_torch(path: str, batch: list[list[int]]) -> list[list[int]]:
    """transformers' float32 greedy continuation on its torch code paths. With flash-linear-attention
    installed, transformers runs a hybrid's linear-attention layers through fla's chunked kernels,
    whose dots are TF32: near-ties of a tiny random model then break either way. A process that
    cannot import fla runs them in float32, the reference for our float32 prefill in short chunks
    (which takes the recurrent kernel, never fla)."""
    if importlib.util.find_spec("fla") is None:
        return hf_greedy(path, torch.float32, batch)
    code = ("import json, sys; sys.modules['fla'] = None; sys.path.insert(0, sys.argv[2]); import torch; "
            "from greedy_oracle import hf_greedy; "
            "print(json.dumps(hf_greedy(sys.argv[1], torch.float32, json.loads(sys.stdin.read()))))")
    done = subprocess.run([sys.executable, "-c", code, path, str(Path(__file__).parent)], input=json.dumps(batch),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def engine_greedy(path: str, dtype: str, batch: list[list[int]], *, expect_no_cache_hits: bool = False,
                  **settings) -> tuple[list[list[int]], Engine]:
    """Our greedy outputs and the engine, its invariants checked (`expect_no_cache_hits`: and no
    prompt token served from the cache)."""
    settings.setdefault("cuda_graph_max_bs", 16)  # fewer captures: the buckets used here
    engine = Engine(path, device="cuda", dtype=dtype, max_total_tokens=8192, **settings)
    res = engine.generate(input_ids=batch, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0,
                                                            "ignore_eos": True})
    engine.check_invariants()
    if expect_no_cache_hits:
        assert sum(r["meta_info"]["cached_tokens"] for r in res) == 0
    return [r["output_ids"] for r in res], engine


def agreement(ours: list[list[int]], ref: list[list[int]]) -> float:
    """The share of reference tokens ours matches before its first difference, over all rows."""
    def common_prefix(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n
    return sum(common_prefix(a, b) for a, b in zip(ours, ref)) / sum(len(r) for r in ref)


def check_as_close_to_fp32_as_hf_bf16(path: str, ours: list[list[int]], batch: list[list[int]],
                                      slack: float = 0.25) -> None:
    """For a model whose bf16 greedy tokens are chaotic (the tiny random hybrids: transformers' own
    bf16 tokens follow its float32 ones for 37-52% of the tokens, measured on an H200), ours in bf16
    follow transformers' float32 tokens about as far as transformers' bf16 do."""
    truth = hf_greedy(path, torch.float32, batch)
    theirs = agreement(hf_greedy(path, torch.bfloat16, batch), truth)
    assert agreement(ours, truth) >= theirs - slack, (agreement(ours, truth), theirs)


def check_bf16_graphs_change_no_token(path: str, *, expect_no_cache_hits: bool = False, chaotic: bool = False) -> None:
    """In bf16 (the Triton kernels), four prompts (a graph bucket: the same kernels with and
    without graphs) give the same tokens with graphs on and off, most of them transformers' bf16
    (`chaotic`: as close to its float32 tokens as its bf16 ones are)."""
    batch = prompts(4, 500, seed=7)
    on, engine = engine_greedy(path, "bfloat16", batch, expect_no_cache_hits=expect_no_cache_hits)
    assert engine.core.model.kernels.triton and engine.core.runner.num_graph_steps > 0
    off, _ = engine_greedy(path, "bfloat16", batch, disable_cuda_graph=True, expect_no_cache_hits=expect_no_cache_hits)
    assert on == off
    if chaotic:
        check_as_close_to_fp32_as_hf_bf16(path, on, batch)
        return
    ref = hf_greedy(path, torch.bfloat16, batch)
    agree = agreement(on, ref)
    assert agree >= 0.5, (agree, on, ref)


def check_fp32_cached_prefix_gives_the_same_tokens(path: str, architecture: Optional[str] = None) -> None:
    """In fp32, six prompts twice with chunked prefill of 16: transformers' greedy tokens both
    times, the second time with every prompt but its last token from the cache."""
    batch = prompts(6, 500, seed=21)
    expected = hf_greedy(path, torch.float32, batch, architecture)
    engine = Engine(path, device="cuda", dtype="float32", max_total_tokens=8192, cuda_graph_max_bs=16,
                    chunked_prefill_size=16)
    params = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    for _ in range(2):
        results = engine.generate(input_ids=batch, sampling_params=params)
        assert [r["output_ids"] for r in results] == expected
    assert sum(r["meta_info"]["cached_tokens"] for r in results) == sum(len(p) - 1 for p in batch)
    engine.check_invariants()
