"""A tiny random Qwen2 (or Qwen3, Qwen3-MoE, Qwen2-MoE, or hybrid Qwen3-Next / Qwen3.5) checkpoint
written by `transformers` itself: the correctness oracle.

The tokenizer is a byte-level BPE trained on a corpus embedded here, so any text tokenizes and
nothing is downloaded. Weights come from `transformers.Qwen2ForCausalLM` (`family="qwen3"`:
`Qwen3ForCausalLM`, with a `head_dim` that may differ from hidden / heads; the hybrid families
below) with a fixed seed, so the same arguments always give the same files.

Hybrid families (Gated DeltaNet and gated full-attention layers): `"qwen3_next"`
(Qwen3NextForCausalLM with dense MLPs: num_experts 0), `"qwen3_5"` (Qwen3_5ForCausalLM) and
`"qwen3_5_vl"` (Qwen3_5ForConditionalGeneration: the same language model under
`model.language_model`, with a one-block vision tower the engine does not load) and
`"qwen3_5_moe"` (Qwen3_5MoeForCausalLM: every MLP sparse with a shared expert; `moe` sizes it, as
it does Qwen3-Next's MoE form). Their layers alternate linear and full attention unless
`layer_types` says otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from radixserve.chat_formats import QWEN3_ADDED_TOKENS, QWEN3_CHAT_TEMPLATE

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
# Chat formats a tiny model can be built with: Qwen2.5's (the default) or Qwen3's, whose tokenizer
# adds <tool_call>, </tool_call>, <tool_response>, </tool_response>, <think> and </think> as
# tokens that are not special, and ends a turn (its EOS) with <|im_end|>.
CHAT_FORMATS = ("qwen2", "qwen3")
QWEN3_EXTRA_TOKENS = ("<tool_call>", "</tool_call>", *QWEN3_ADDED_TOKENS)

# Qwen2's context, so every command written for Qwen2 (1,024-token prompts, 512-token outputs)
# runs unchanged on the tiny model; RoPE has no learned weights, so the positions cost nothing.
MAX_POSITIONS = 32768
# The version of what build_tiny_model writes: a cached build with another version is rebuilt.
# Raise it whenever the files change (config, tokenizer, weights).
BUILD_VERSION = 3
BUILD_MARKER = "radixserve-tiny-model.json"

# Qwen2.5-Instruct's ChatML template: a default system turn when none is given; `tools` are listed
# in the system turn, an assistant's tool calls are written as <tool_call> blocks and tool results
# go back as <tool_response> blocks in a user turn (Qwen2.5's format, shorter wording).
CHAT_TEMPLATE = (
    "{%- set system = messages[0]['content'] if messages[0]['role'] == 'system' else "
    "'You are a helpful assistant.' %}"
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n' + system + '\\n\\n# Tools\\n\\nYou may call one or more functions. Their "
    "signatures are within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with the function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set args = call['function']['arguments'] %}"
    "{{ ('\\n' if (message['content'] or not loop.first) else '') + '<tool_call>\\n{\"name\": \"' "
    "+ call['function']['name'] + '\", \"arguments\": ' + (args if args is string else (args | tojson)) "
    "+ '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Plain English, numbers and punctuation, so common words and digits get their own merges.
CORPUS = """\
The river ran past the old mill every morning, and the miller listened to it while he worked.
He counted the sacks of grain, wrote the numbers in a small book, and checked them twice.
When the sun was high, children came to the bridge to watch the water turn the great wheel.
They asked him how the stones could grind so fine, and he told them about patience and care.

A server answers many questions at once. Each question arrives as a request with a prompt,
and each prompt is turned into tokens. Many prompts begin with the same instructions, so a
careful system keeps the work it has already done and reuses it for the next request.
That is why a tree of shared prefixes saves time: the common part is computed only once.

Numbers matter too: 0 1 2 3 4 5 6 7 8 9 10 11 12 20 25 50 64 100 128 256 512 1000 1024 2048.
Prices were 3.50, 12.99 and 100.00; the date was 2024-05-17 and the time was 09:45:30.
Lists look like (a), [b], {c}; paths like /tmp/data.txt; mail like user@example.com.
Math: 2 + 2 = 4, 10 - 3 = 7, 6 * 7 = 42, 9 / 3 = 3, 5 % 2 = 1, x < y, y > z, a & b | c ^ d.
Quotes: "hello", 'world', `code`; marks: ! ? ; : , . - _ ~ # $ % ^ * + = \\ / | < > @.

What is the capital of France? Paris is the capital of France, and it is a large city.
Please write a short story about a cat who learns to read. The cat found a book one day.
Translate the following sentence into simple words. Summarize the text in three points.
You are a helpful assistant. Answer the question as clearly and briefly as you can.
Once upon a time there was a small village near the sea, where fishermen told long tales.
The weather today is sunny with a light wind from the west, and tomorrow it may rain.

Good software is written slowly and read many times. Engineers measure before they change
anything, keep their tests fast, and explain the reason behind each choice in plain words.
A queue holds the requests that wait; a scheduler decides which one runs next, and memory
for the keys and values of attention is lent out in pages and returned when work is done.
Questions, answers, stories, letters and notes: every kind of writing becomes a sequence.
"""


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Keep offsets byte-exact without adding BOS/EOS (Qwen2 adds none either).
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        # Every byte gets a token, so any text (not only the corpus) tokenizes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return tok


# family -> the transformers config and model class names that write it.
FAMILIES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
            "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
            "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
            "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
            "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
            "qwen3_5_vl": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
            "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM")}
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_vl", "qwen3_5_moe")
# The hybrids' linear-attention shapes unless the caller gives others: 2 key heads and 4 value
# heads (grouped 2:1, as the published 16:32 / 16:48), head dims a power of two as the kernels need.
HYBRID_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                     linear_value_head_dim=16, linear_conv_kernel_dim=4)
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")


@dataclass(frozen=True)
class TinyMoe:
    """The experts of a tiny Qwen3-MoE / Qwen2-MoE: `experts` of `intermediate` each, `top_k` per
    token; layer i is sparse unless in `mlp_only_layers`, when (i + 1) % `sparse_step` == 0 (the
    others keep a dense MLP of the model's `intermediate`); Qwen2-MoE adds a shared expert of
    `shared_intermediate`."""

    experts: int = 8
    top_k: int = 2
    intermediate: int = 32
    norm_topk_prob: bool = True
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_intermediate: int = 48


def _hf_config(family: str, vocab_size: int, *, hidden: int, layers: int, num_heads: int, num_kv_heads: int,
               head_dim: Optional[int], intermediate: int, tie_word_embeddings: bool, eos_id: int,
               dtype: torch.dtype, moe: Optional[TinyMoe] = None, layer_types: Optional[list[str]] = None):
    import transformers

    config_name, model_name = FAMILIES[family]
    if family in HYBRID_FAMILIES:
        if moe is not None and family not in ("qwen3_next", "qwen3_5_moe"):
            raise ValueError(f"moe is an option of the MoE families ({', '.join(MOE_FAMILIES)}, qwen3_next, "
                             f"qwen3_5_moe), not {family!r}")
        return _hybrid_config(family, vocab_size, hidden=hidden, layers=layers, num_heads=num_heads,
                              num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate=intermediate,
                              tie_word_embeddings=tie_word_embeddings, eos_id=eos_id, dtype=dtype,
                              layer_types=layer_types, moe=moe)
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        # Large random weights: greedy argmax margins are wide and outputs vary with the prompt.
        initializer_range=0.1,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        use_sliding_window=False,
        architectures=[model_name],
    )
    if family in ("qwen3", "qwen3_moe"):
        kwargs.update(head_dim=head_dim or hidden // num_heads, attention_bias=False)
    elif head_dim is not None:
        raise ValueError("head_dim is a Qwen3 option: Qwen2's is hidden / num_heads")
    if family in MOE_FAMILIES:
        moe = moe or TinyMoe()
        kwargs.update(num_experts=moe.experts, num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.intermediate,
                      norm_topk_prob=moe.norm_topk_prob, decoder_sparse_step=moe.sparse_step,
                      mlp_only_layers=list(moe.mlp_only_layers))
        if family == "qwen2_moe":
            kwargs.update(shared_expert_intermediate_size=moe.shared_intermediate, qkv_bias=True)
    elif moe is not None:
        raise ValueError(f"moe is an option of the MoE families ({', '.join(MOE_FAMILIES)}), not {family!r}")
    if int(transformers.__version__.split(".")[0]) >= 5:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    else:  # transformers 4.x spells it as a top-level key
        kwargs["rope_theta"] = 10000.0
    config = getattr(transformers, config_name)(**kwargs)
    config.dtype = dtype
    return config


def _hybrid_config(family: str, vocab_size: int, *, hidden: int, layers: int, num_heads: int, num_kv_heads: int,
                   head_dim: Optional[int], intermediate: int, tie_word_embeddings: bool, eos_id: int,
                   dtype: torch.dtype, layer_types: Optional[list[str]], moe: Optional[TinyMoe] = None):
    import transformers

    config_name, model_name = FAMILIES[family]
    head_dim = head_dim or hidden // num_heads
    rotary_dim = head_dim // 4  # the published partial_rotary_factor
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    if family != "qwen3_next":  # Qwen3.5's multimodal RoPE sections (text positions: plain RoPE)
        half = rotary_dim // 2
        rope.update(mrope_section=[half - 2 * (half // 3), half // 3, half // 3], mrope_interleaved=True)
    text = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        max_position_embeddings=MAX_POSITIONS, initializer_range=0.1, rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        rope_parameters=rope, attention_bias=False,
        layer_types=layer_types or ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        **HYBRID_LINEAR)
    if family == "qwen3_next":
        if moe is None:
            text.update(num_experts=0)  # the dense-MLP form
        else:  # sparse layers with a shared expert (every layer unless sparse_step / mlp_only_layers say not)
            text.update(num_experts=moe.experts, num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.intermediate,
                        norm_topk_prob=moe.norm_topk_prob, decoder_sparse_step=moe.sparse_step,
                        mlp_only_layers=list(moe.mlp_only_layers), shared_expert_intermediate_size=moe.shared_intermediate)
    elif family == "qwen3_5_moe":  # every layer sparse, with a shared expert; no dense MLP size
        moe = moe or TinyMoe()
        del text["intermediate_size"]
        text.update(num_experts=moe.experts, num_experts_per_tok=moe.top_k, moe_intermediate_size=moe.intermediate,
                    shared_expert_intermediate_size=moe.shared_intermediate)
    if family != "qwen3_5_vl":
        config = getattr(transformers, config_name)(**text, architectures=[model_name])
    else:
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                      temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=hidden, num_position_embeddings=16)
        config = transformers.Qwen3_5Config(text_config=text, vision_config=vision,
                                            tie_word_embeddings=tie_word_embeddings, architectures=[model_name])
    config.dtype = dtype
    return config


def build_tiny_model(path: Union[str, os.PathLike], *, tie_word_embeddings: bool = False, num_kv_heads: int = 2,
                     num_heads: int = 4, hidden: int = 64, layers: int = 2, intermediate: int = 128, seed: int = 0,
                     dtype: torch.dtype = torch.float32, vocab_size: int = 512, shard: bool = False,
                     family: str = "qwen2", head_dim: Optional[int] = None, moe: Optional[TinyMoe] = None,
                     chat_format: str = "qwen2", layer_types: Optional[list[str]] = None) -> Path:
    """Write tokenizer + config.json + safetensors of a random Qwen2 into `path`; returns the path.

    `shard=True` saves in several small shards with a model.safetensors.index.json.
    `family="qwen3"` writes a Qwen3 dense model instead (q/k norms, no q|k|v bias); its `head_dim`
    (default hidden / num_heads) may make num_heads x head_dim differ from hidden.
    `family="qwen3_moe"` / `"qwen2_moe"`: a mixture-of-experts model (`moe`, default TinyMoe(): 8
    experts, top-2, every layer sparse); transformers saves each expert's weights as its own
    tensors (`mlp.experts.{e}.gate_proj.weight`, ...), as the published checkpoints hold them.
    `chat_format="qwen3"`: Qwen3's chat template and added tokens (`CHAT_FORMATS`), whatever the
    family; the BPE merges are the same, so text outside those tokens tokenizes as in the default.
    The hybrid families (module docstring) take `layer_types` (default: linear, full, linear, ...).
    """
    import transformers
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: expected one of {', '.join(FAMILIES)}")
    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"chat_format must be one of {', '.join(CHAT_FORMATS)}, got {chat_format!r}")
    qwen3 = chat_format == "qwen3"

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(vocab_size),
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    if qwen3:
        hf_tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_EXTRA_TOKENS])
        hf_tok.eos_token = IM_END
        hf_tok.chat_template = QWEN3_CHAT_TEMPLATE
    hf_tok.save_pretrained(out)

    eos_id = hf_tok.convert_tokens_to_ids(IM_END if qwen3 else ENDOFTEXT)
    config = _hf_config(family, len(hf_tok), hidden=hidden, layers=layers, num_heads=num_heads,
                        num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate=intermediate,
                        tie_word_embeddings=tie_word_embeddings, eos_id=eos_id, dtype=dtype, moe=moe,
                        layer_types=layer_types)

    # A private RNG stream: the caller's global torch RNG state is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, FAMILIES[family][1])(config)
        with torch.no_grad():
            # HF initialises biases to 0 and norms to 1; random values make the equivalence
            # tests check that both are loaded into the right places.
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0.0, 0.1)
                elif "norm" in name and family in HYBRID_FAMILIES:
                    # Around HF's init: 0 for the zero-centred (1 + w) norms, 1 for the gated one.
                    param.add_(0.1 * torch.randn_like(param))
                elif "norm" in name:
                    param.copy_(1.0 + 0.1 * torch.randn_like(param))
    model = model.to(dtype)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    model.generation_config.bos_token_id = eos_id
    # A tiny checkpoint is well under a megabyte; 100KB shards give an index and several files.
    model.save_pretrained(out, max_shard_size="100KB" if shard else "50GB")
    (out / BUILD_MARKER).write_text(json.dumps({"version": BUILD_VERSION}) + "\n")
    return out


def build_version(path: Union[str, os.PathLike]) -> int:
    """The BUILD_VERSION a directory was built with (0: none, or not a tiny model build)."""
    try:
        return int(json.loads((Path(path) / BUILD_MARKER).read_text())["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def ensure_tiny_model(path: Union[str, os.PathLike]) -> Path:
    """The default tiny model at `path`, built there unless a build of this version is present.

    A build of another version (an older config, e.g. a 512-position context) is replaced. The
    new build is written beside it and renamed into place, so a concurrent reader never sees a
    half-written directory.
    """
    out = Path(path)
    if build_version(out) == BUILD_VERSION and (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.building-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    build_tiny_model(staging)
    if build_version(out) != BUILD_VERSION:  # another process may have finished first
        shutil.rmtree(out, ignore_errors=True)
        try:
            os.rename(staging, out)
        except OSError:  # it did, between the check and the rename
            pass
    shutil.rmtree(staging, ignore_errors=True)
    return out
