"""Build .qwen2-tokenizer/ (git-ignored): the real Qwen2 vocabulary for the GPU benchmarks.

The benchmark configs carry no tokenizer and nothing may be downloaded from a model hub at run
time; the PyPI package `dashscope` (Apache-2.0) ships Qwen's BPE ranks as
`dashscope/resources/qwen.tiktoken`. transformers' TikTokenConverter turns them into a
`tokenizer.json` (151,643 regular tokens) to which Qwen2's 22 special tokens are appended.

    pip download --no-deps dashscope -d /tmp/ds && unzip -o -q /tmp/ds/dashscope-*.whl -d /tmp/ds
    pip install tiktoken    # the converter reads the ranks with it
    python scripts/qwen2_tokenizer.py /tmp/ds/dashscope/resources/qwen.tiktoken .qwen2-tokenizer
"""

from __future__ import annotations

import sys

from tokenizers import normalizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

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


def build(ranks_path: str, out_dir: str) -> None:
    backend = TikTokenConverter(vocab_file=ranks_path, pattern=PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.save_pretrained(out_dir)
    print(f"{out_dir}: {len(tokenizer)} tokens, <|endoftext|> = {tokenizer.convert_tokens_to_ids('<|endoftext|>')}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    build(sys.argv[1], sys.argv[2])
