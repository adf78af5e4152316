"""The model layer against transformers' Qwen2 and Qwen3: same logits through every path of the KV pool."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from radixserve.attention.base import ForwardBatch, ForwardMode
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.cache.kv_pool import KVPool, ReqToTokenPool
from radixserve.model.config import ModelConfig
from radixserve.model.loader import load_model
from radixserve.model.qwen2 import Qwen2ForCausalLM
from radixserve.testing.tiny_model import build_tiny_model

import transformers  # noqa: E402  a required dependency: a broken install fails here, never skips

ATOL = 1e-4

VARIANTS = {
    # name: build_tiny_model keyword arguments
    "untied-gqa2": dict(tie_word_embeddings=False, num_heads=4, num_kv_heads=2),
    "tied-gqa4": dict(tie_word_embeddings=True, num_heads=4, num_kv_heads=1),
    "tied-mha": dict(tie_word_embeddings=True, num_heads=4, num_kv_heads=4),
    # Qwen3 dense: q/k norms, no q|k|v bias; heads x head_dim (4 x 32) wider than hidden (64).
    "qwen3-tied-wide-heads": dict(family="qwen3", tie_word_embeddings=True, num_heads=4, num_kv_heads=2, head_dim=32),
    "qwen3-untied-gqa4": dict(family="qwen3", tie_word_embeddings=False, num_heads=4, num_kv_heads=1),
}


# --------------------------------------------------------------------------- test-only batch helper

@dataclass
class _Req:
    row: int
    tokens: list[int] = field(default_factory=list)


class PoolHarness:
    """Drives a model over a KV pool the way a runner would, with slots handed out in random pages
    so that req_to_token is never contiguous."""

    def __init__(self, model: Qwen2ForCausalLM, cfg: ModelConfig, *, page_size: int = 1, num_tokens: int = 4096,
                 seed: int = 0, max_requests: int = 16, device: str = "cpu"):
        self.model = model
        self.page_size = page_size
        self.device = device
        self.pool = KVPool(num_tokens, page_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                           model.dtype, device)
        self.req_to_token = ReqToTokenPool(max_requests, cfg.max_position_embeddings, device)
        pages = self.pool.allocator.alloc_pages(self.pool.allocator.num_pages)
        random.Random(seed).shuffle(pages)
        self._free_pages = pages
        self.reqs: dict[str, _Req] = {}

    def _slots_for(self, req: _Req, n: int) -> torch.Tensor:
        """Slots for positions len(tokens) .. +n, opening new (random) pages as needed."""
        start = len(req.tokens)
        out: list[int] = []
        prev = int(self.req_to_token.table[req.row, start - 1]) if start else 0
        for pos in range(start, start + n):
            prev = self._free_pages.pop() * self.page_size if pos % self.page_size == 0 else prev + 1
            out.append(prev)
        slots = torch.tensor(out, dtype=torch.int64, device=self.device)
        self.req_to_token.table[req.row, start:start + n] = slots
        return slots

    def step(self, new_tokens: dict[str, list[int]], *, mode: ForwardMode = ForwardMode.EXTEND,
             only_last: bool = False) -> dict[str, torch.Tensor]:
        """One forward over the given requests; logits of every new token (or only the last ones)."""
        ids, pos, locs, rows, seq, ext, pre, logit_rows = [], [], [], [], [], [], [], []
        for rid, toks in new_tokens.items():
            req = self.reqs.setdefault(rid, _Req(self.req_to_token.alloc()))
            prefix = len(req.tokens)
            locs.append(self._slots_for(req, len(toks)))
            first_row = len(ids)
            ids += toks
            pos += range(prefix, prefix + len(toks))
            req.tokens += toks
            rows.append(req.row)
            seq.append(len(req.tokens))
            ext.append(len(toks))
            pre.append(prefix)
            logit_rows += [len(ids) - 1] if only_last else range(first_row, len(ids))
        t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)  # noqa: E731
        batch = ForwardBatch(mode=mode, input_ids=t(ids), positions=t(pos), out_cache_loc=torch.cat(locs),
                             req_pool_indices=t(rows), seq_lens=t(seq), extend_lens=t(ext), prefix_lens=t(pre),
                             seq_lens_cpu=seq, extend_lens_cpu=ext, prefix_lens_cpu=pre,
                             req_to_token=self.req_to_token.table, kv_pool=self.pool, logits_indices=t(logit_rows))
        logits = self.model(batch)
        assert logits.dtype == torch.float32 and logits.shape == (len(logit_rows), self.model.config.vocab_size)
        out, at = {}, 0
        for rid, toks in new_tokens.items():
            n = 1 if only_last else len(toks)
            out[rid] = logits[at:at + n]
            at += n
        return out


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), seed=1, **VARIANTS[request.param])
    model, cfg = load_model(path, attn_backend=TorchAttentionBackend())
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf).__name__ == type(model).__name__ == cfg.architecture
    return path, model, cfg, hf


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("plain"))


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


# --------------------------------------------------------------------------- equivalence with HF

def test_single_extend_matches_hf(tiny):
    _, model, cfg, hf = tiny
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    prompt = random_tokens(37, cfg.vocab_size, 0)
    ours = PoolHarness(model, cfg).step({"a": prompt})["a"]
    torch.testing.assert_close(ours, hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_prefix_then_extend_matches_hf(tiny):
    _, model, cfg, hf = tiny
    prompt = random_tokens(40, cfg.vocab_size, 1)
    ref = hf_logits(hf, prompt)
    h = PoolHarness(model, cfg, page_size=4, seed=3)
    # Three passes sharing one req_to_token row: the later ones read the earlier KV from the pool.
    parts = [(0, 11), (11, 12), (12, 40)]
    for lo, hi in parts:
        got = h.step({"a": prompt[lo:hi]})["a"]
        torch.testing.assert_close(got, ref[lo:hi], atol=ATOL, rtol=0)


def test_ragged_batch_matches_hf(tiny):
    _, model, cfg, hf = tiny
    a, b, c, d = (random_tokens(n, cfg.vocab_size, 10 + i) for i, n in enumerate((17, 15, 9, 5)))
    h = PoolHarness(model, cfg, page_size=2, seed=5)
    h.step({"b": b[:9], "c": c[:8]})  # cached prefixes for b and c
    got = h.step({"a": a, "b": b[9:], "c": c[8:], "d": d})  # fresh, prefix + 6, prefix + 1, fresh
    torch.testing.assert_close(got["a"], hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(got["b"], hf_logits(hf, b)[9:], atol=ATOL, rtol=0)
    torch.testing.assert_close(got["c"], hf_logits(hf, c)[8:], atol=ATOL, rtol=0)
    torch.testing.assert_close(got["d"], hf_logits(hf, d), atol=ATOL, rtol=0)


def test_logits_only_for_selected_rows(tiny):
    _, model, cfg, hf = tiny
    a, b = random_tokens(12, cfg.vocab_size, 20), random_tokens(7, cfg.vocab_size, 21)
    got = PoolHarness(model, cfg).step({"a": a, "b": b}, only_last=True)
    assert got["a"].shape == (1, cfg.vocab_size)
    torch.testing.assert_close(got["a"][0], hf_logits(hf, a)[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(got["b"][0], hf_logits(hf, b)[-1], atol=ATOL, rtol=0)


def test_token_by_token_decode_matches_hf(tiny):
    _, model, cfg, hf = tiny
    prompts = {"a": random_tokens(7, cfg.vocab_size, 30), "b": random_tokens(13, cfg.vocab_size, 31)}
    h = PoolHarness(model, cfg, page_size=4, seed=7)
    last = h.step(prompts, only_last=True)
    seqs = {rid: list(p) for rid, p in prompts.items()}
    steps = 12
    for _ in range(steps):
        nxt = {rid: [int(last[rid][-1].argmax())] for rid in seqs}
        for rid, tok in nxt.items():
            seqs[rid] += tok
        last = h.step(nxt, mode=ForwardMode.DECODE)
        for rid, seq in seqs.items():
            torch.testing.assert_close(last[rid][0], hf_logits(hf, seq)[-1], atol=ATOL, rtol=0)
    # Our greedy continuation is HF's greedy continuation.
    for rid, prompt in prompts.items():
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                              pad_token_id=cfg.eos_token_ids[0])[0].tolist()
        assert seqs[rid] == ref


def test_bfloat16_close_to_hf(tiny_dir):
    model, cfg = load_model(tiny_dir, dtype=torch.bfloat16, attn_backend=TorchAttentionBackend())
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    hf = transformers.Qwen2ForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).eval()
    prompt = random_tokens(24, cfg.vocab_size, 40)
    got = PoolHarness(model, cfg).step({"a": prompt})["a"]
    ref = hf_logits(hf, prompt)
    assert (got - ref).abs().max() < 0.1
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_sharded_checkpoint_loads(tmp_path):
    path = build_tiny_model(tmp_path / "sharded", shard=True, seed=4)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (path / "model.safetensors").exists()
    model, cfg = load_model(path, attn_backend=TorchAttentionBackend())
    hf = transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = random_tokens(19, cfg.vocab_size, 50)
    torch.testing.assert_close(PoolHarness(model, cfg).step({"a": prompt})["a"], hf_logits(hf, prompt),
                               atol=ATOL, rtol=0)


def test_tiny_model_is_deterministic_and_tokenizes_anything(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=3)
    b = build_tiny_model(tmp_path / "b", seed=3)
    c = build_tiny_model(tmp_path / "c", seed=4)
    blob = lambda p: (p / "model.safetensors").read_bytes()  # noqa: E731
    assert blob(a) == blob(b) != blob(c)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    tok = transformers.AutoTokenizer.from_pretrained(a)
    cfg = ModelConfig.from_dir(a)
    assert cfg.vocab_size == len(tok) and 400 <= len(tok) <= 520
    assert cfg.eos_token_ids == [tok.convert_tokens_to_ids("<|endoftext|>")] and tok.pad_token == "<|endoftext|>"
    text = "Zebra qux: 3.14159 ~ {é ü 漢字} \t tabs\nnewline!"
    assert tok.decode(tok(text)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids


# --------------------------------------------------------------------------- dummy weights

def test_dummy_weights_shapes_and_seed(tiny_dir, tmp_path):
    # config.json alone is enough: no safetensors file is read.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tiny_dir / "config.json").read_text())
    backend = TorchAttentionBackend()
    m1, cfg = load_model(bare, load_format="dummy", seed=7, attn_backend=backend)
    m2, _ = load_model(bare, load_format="dummy", seed=7, attn_backend=backend)
    m3, _ = load_model(bare, load_format="dummy", seed=8, attn_backend=backend, dtype=torch.bfloat16)
    ref, _ = load_model(tiny_dir, attn_backend=backend)
    p1, p2, p3 = (dict(m.named_parameters()) for m in (m1, m2, m3))
    assert {k: v.shape for k, v in p1.items()} == {k: v.shape for k, v in dict(ref.named_parameters()).items()}
    for name, p in p1.items():
        assert torch.equal(p, p2[name]), name
        assert p3[name].dtype == torch.bfloat16
        if "norm" in name:
            assert torch.all(p == 1), name
        else:
            assert 0.01 < p.std().item() < 0.03 and not torch.equal(p.to(torch.bfloat16), p3[name]), name
    assert p1["model.layers.0.self_attn.qkv_proj.weight"].shape == (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)
    logits = PoolHarness(m1, cfg).step({"a": [1, 2, 3, 4]})["a"]
    assert torch.isfinite(logits).all()


# --------------------------------------------------------------------------- loader and config errors

def _copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_loader_errors_name_what_is_missing(tiny_dir, tmp_path):
    backend = TorchAttentionBackend()
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(tmp_path / "nope", attn_backend=backend)

    no_config = _copy_model(tiny_dir, tmp_path / "no_config")
    (no_config / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(no_config, attn_backend=backend)

    no_weights = _copy_model(tiny_dir, tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no_weights.*model\.safetensors"):
        load_model(no_weights, attn_backend=backend)

    from safetensors.torch import load_file, save_file

    missing = _copy_model(tiny_dir, tmp_path / "missing_tensor")
    tensors = load_file(missing / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.rotary_emb.inv_freq"] = torch.ones(8)  # an extra that must be ignored, not an error
    save_file(tensors, missing / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(missing, attn_backend=backend)

    bad_shape = _copy_model(tiny_dir, tmp_path / "bad_shape")
    tensors = load_file(bad_shape / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.bias"] = torch.zeros(3)
    save_file(tensors, bad_shape / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"k_proj\.bias.*shape"):
        load_model(bad_shape, attn_backend=backend)

    llama = _copy_model(tiny_dir, tmp_path / "llama")
    cfg = json.loads((llama / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (llama / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.*Qwen2ForCausalLM"):
        load_model(llama, attn_backend=backend)

    with pytest.raises(ValueError, match="load_format"):
        load_model(tiny_dir, load_format="pt", attn_backend=backend)  # type: ignore[arg-type]


def test_sharded_missing_shard_is_named(tmp_path):
    path = build_tiny_model(tmp_path / "sharded", shard=True)
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(path, attn_backend=TorchAttentionBackend())


def _base_config(**over) -> dict:
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-6}
    cfg.update(over)
    return cfg


def test_model_config_parsing():
    c = ModelConfig.from_dict(_base_config(rope_theta=1e6, eos_token_id=[5, 7], torch_dtype="bfloat16",
                                           rope_scaling=None))
    assert (c.rope_theta, c.eos_token_ids, c.dtype, c.head_dim) == (1e6, [5, 7], "bfloat16", 16)
    assert c.torch_dtype == torch.bfloat16
    c = ModelConfig.from_dict(_base_config(rope_parameters={"rope_theta": 5e5, "rope_type": "default"},
                                           eos_token_id=3, dtype="float32", head_dim=32, tie_word_embeddings=True))
    assert (c.rope_theta, c.eos_token_ids, c.dtype, c.head_dim, c.tie_word_embeddings) == (5e5, [3], "float32", 32, True)
    assert (c.q_size, c.kv_size) == (128, 64)
    no_arch = _base_config()
    del no_arch["architectures"]
    assert ModelConfig.from_dict(no_arch).architecture == "Qwen2ForCausalLM"
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_dict(_base_config(rope_scaling={"type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="linear"):
        ModelConfig.from_dict(_base_config(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2}))
    with pytest.raises(ValueError, match="MistralForCausalLM.*Qwen2ForCausalLM"):
        ModelConfig.from_dict(_base_config(architectures=["MistralForCausalLM"]))
    with pytest.raises(ValueError, match="vocab_size"):
        ModelConfig.from_dict({k: v for k, v in _base_config().items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="sliding"):
        ModelConfig.from_dict(_base_config(use_sliding_window=True))


def test_context_length_extends_rope_table(tiny_dir):
    longer = 2 * ModelConfig.from_dir(tiny_dir).max_position_embeddings  # the tiny model has Qwen2's 32,768
    model, cfg = load_model(tiny_dir, attn_backend=TorchAttentionBackend(), context_length=longer)
    assert model.max_positions == longer > cfg.max_position_embeddings


# --------------------------------------------------------------------------- attention backend

def _naive_attention(q, k_ctx, v_ctx, prefix: int) -> torch.Tensor:
    """float64, one head at a time: q [E, Hq, D], k/v [S, Hkv, D] -> [E, Hq*D]."""
    e, hq, d = q.shape
    group = hq // k_ctx.shape[1]
    out = torch.zeros(e, hq, d, dtype=torch.float64)
    for h in range(hq):
        kh, vh = k_ctx[:, h // group].double(), v_ctx[:, h // group].double()
        for j in range(e):
            visible = prefix + j + 1
            scores = (kh[:visible] @ q[j, h].double()) / math.sqrt(d)
            out[j, h] = torch.softmax(scores, dim=0) @ vh[:visible]
    return out.reshape(e, hq * d)


@pytest.mark.parametrize("seed,page_size,hq,hkv,decode", [
    (0, 1, 4, 2, False), (1, 4, 8, 1, False), (2, 2, 4, 4, False), (3, 4, 6, 2, True), (4, 1, 4, 1, True),
])
def test_torch_backend_matches_naive_attention(seed, page_size, hq, hkv, decode):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    d, layers, layer = 16, 2, 1
    pool = KVPool(1024, page_size, layers, hkv, d, torch.float32, "cpu")
    req_to_token = ReqToTokenPool(8, 128, "cpu")
    pages = pool.allocator.alloc_pages(pool.allocator.num_pages)
    rng.shuffle(pages)  # page-scattered: neighbours in a request are far apart in the pool

    n_req = 4
    prefix_lens = [rng.randrange(0, 30) for _ in range(n_req)]
    extend_lens = [1] * n_req if decode else [rng.randrange(1, 12) for _ in range(n_req)]
    if decode:
        prefix_lens = [p + 1 for p in prefix_lens]
    rows = rng.sample(range(8), n_req)
    k_ctx, v_ctx, out_loc = [], [], []
    for row, pre, ext in zip(rows, prefix_lens, extend_lens):
        for pos in range(pre + ext):
            if pos % page_size == 0:
                req_to_token.table[row, pos] = pages.pop() * page_size
            else:
                req_to_token.table[row, pos] = req_to_token.table[row, pos - 1] + 1
        slots = req_to_token.table[row, :pre + ext]
        k_all = torch.randn(pre + ext, hkv, d, generator=g)
        v_all = torch.randn(pre + ext, hkv, d, generator=g)
        pool.store(layer, slots[:pre], k_all[:pre], v_all[:pre])  # the cached prefix
        k_ctx.append(k_all)
        v_ctx.append(v_all)
        out_loc.append(slots[pre:])
    total = sum(extend_lens)
    q = torch.randn(total, hq, d, generator=g)
    k_new = torch.cat([k[p:] for k, p in zip(k_ctx, prefix_lens)])
    v_new = torch.cat([v[p:] for v, p in zip(v_ctx, prefix_lens)])
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    batch = ForwardBatch(mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND, input_ids=torch.zeros(total,
                         dtype=torch.int64), positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens,
                         seq_lens)]), out_cache_loc=torch.cat(out_loc), req_pool_indices=t(rows), seq_lens=t(seq_lens),
                         extend_lens=t(extend_lens), prefix_lens=t(prefix_lens), seq_lens_cpu=seq_lens,
                         extend_lens_cpu=extend_lens, prefix_lens_cpu=prefix_lens,
                         req_to_token=req_to_token.table, kv_pool=pool, logits_indices=t([total - 1]))
    backend = TorchAttentionBackend()
    backend.init_forward(batch)
    out = backend.forward(q, k_new, v_new, layer, batch)
    assert out.shape == (total, hq * d)
    # The new K/V landed in the pool at out_cache_loc.
    torch.testing.assert_close(pool.k_buffers[layer][batch.out_cache_loc], k_new, atol=0, rtol=0)
    torch.testing.assert_close(pool.v_buffers[layer][batch.out_cache_loc], v_new, atol=0, rtol=0)
    at = 0
    for i, (pre, ext) in enumerate(zip(prefix_lens, extend_lens)):
        ref = _naive_attention(q[at:at + ext], k_ctx[i], v_ctx[i], pre)
        torch.testing.assert_close(out[at:at + ext].double(), ref, atol=1e-5, rtol=1e-5)
        at += ext
