"""Build .qwen2-tokenizer/ (git-ignored): the real Qwen2 vocabulary for the GPU benchmarks, or with
--qwen3 Qwen3's (the same BPE ranks and Qwen2's 22 added tokens, then <tool_response>,
</tool_response>, <think> and </think> at 151665-151668, <|im_end|> as EOS, and our Qwen3-format
chat template, radixserve.chat_formats.QWEN3_CHAT_TEMPLATE).

The benchmark configs carry no tokenizer and nothing may be downloaded from a model hub at run
time; the PyPI package `dashscope` (Apache-2.0) ships Qwen's BPE ranks as
`dashscope/resources/qwen.tiktoken`. transformers' TikTokenConverter turns them into a
`tokenizer.json` (151,643 regular tokens) to which the added tokens are appended.

    pip download --no-deps dashscope -d /tmp/ds && unzip -o -q /tmp/ds/dashscope-*.whl -d /tmp/ds
    pip install tiktoken    # the converter reads the ranks with it
    python scripts/qwen2_tokenizer.py /tmp/ds/dashscope/resources/qwen.tiktoken .qwen2-tokenizer
    python scripts/qwen2_tokenizer.py --qwen3 /tmp/ds/dashscope/resources/qwen.tiktoken .qwen3-tokenizer
"""

from __future__ import annotations

import argparse

from tokenizers import AddedToken, normalizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

from radixserve.chat_formats import QWEN3_ADDED_TOKENS, QWEN3_CHAT_TEMPLATE

# Qwen2's pre-tokenizer split (contractions, letters, single digits, punctuation, newlines).
PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
]
# Qwen3's tokenizer marks these of Qwen2's added tokens as not special, so decoding keeps them in
# the text that the tool-call and reasoning parsers read (the Qwen2 build keeps them all special).
QWEN3_NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                     "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", *QWEN3_ADDED_TOKENS}


def build(ranks_path: str, out_dir: str, qwen3: bool = False) -> None:
    backend = TikTokenConverter(vocab_file=ranks_path, pattern=PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    if not qwen3:
        tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    else:
        # Qwen's order puts the 14 special ones first, so adding them, then the rest, keeps every id.
        added = SPECIAL_TOKENS + list(QWEN3_ADDED_TOKENS)
        tokenizer.add_special_tokens({"additional_special_tokens": [t for t in added if t not in QWEN3_NOT_SPECIAL]})
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added if t in QWEN3_NOT_SPECIAL])
        tokenizer.eos_token = "<|im_end|>"
        tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>", "<tool_call>", "</think>")}
    print(f"{out_dir}: {len(tokenizer)} tokens, " + ", ".join(f"{t} = {i}" for t, i in ids.items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ranks", help="qwen.tiktoken (from the dashscope package)")
    parser.add_argument("out_dir")
    parser.add_argument("--qwen3", action="store_true", help="Qwen3's added tokens, EOS and chat format")
    args = parser.parse_args()
    build(args.ranks, args.out_dir, qwen3=args.qwen3)
