"""Log probabilities and penalties on a CUDA GPU, with decode CUDA graphs and overlap scheduling on
and off: the same answers as Hugging Face (fp32). Skipped without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

import transformers  # noqa: E402

from radixserve import Engine  # noqa: E402
from radixserve.testing.tiny_model import build_tiny_model  # noqa: E402

MAX_NEW = 16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-sampling-gpu")))


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return transformers.Qwen2ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).to("cuda").eval()


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(5, 60))] for _ in range(n)]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("graphs", [True, False])
def test_logprobs_and_penalties_equal_hf(tiny_dir, hf, graphs, overlap):
    engine = Engine(tiny_dir, device="cuda", dtype="float32", max_total_tokens=8192, cuda_graph_max_bs=16,
                    disable_cuda_graph=not graphs, disable_overlap_schedule=not overlap)
    batch = prompts(6, seed=3)
    base = {"max_new_tokens": MAX_NEW, "min_new_tokens": MAX_NEW, "temperature": 0}
    params = [{**base, "return_logprob": True, "top_logprobs_num": 5}, base,
              {**base, "repetition_penalty": 1.5}, {**base, "repetition_penalty": 0.8, "return_logprob": True},
              {**base, "return_logprob": True, "top_logprobs_num": 20}, {**base, "repetition_penalty": 1.2}]
    results = engine.generate(input_ids=batch, sampling_params=params)
    engine.check_invariants()
    if graphs:
        assert engine.core.runner.num_graph_steps > 0
    with torch.no_grad():
        for p, param, result in zip(batch, params, results):
            ids = torch.tensor([p], device="cuda")
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                              min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0,
                              repetition_penalty=param.get("repetition_penalty", 1.0))[0, len(p):].tolist()
            assert result["output_ids"] == ref, param
            if not param.get("return_logprob"):
                continue
            logprobs = torch.log_softmax(hf(torch.tensor([p + ref], device="cuda")).logits[0].float(), dim=-1)
            meta = result["meta_info"]
            for k, token in enumerate(ref):
                row = logprobs[len(p) - 1 + k]
                assert meta["output_token_logprobs"][k][0] == pytest.approx(row[token].item(), abs=1e-3)
                n = param.get("top_logprobs_num", 0)
                got = [v for v, _, _ in meta["output_top_logprobs"][k]]
                assert got == pytest.approx(row.topk(n).values.tolist(), abs=1e-3)
