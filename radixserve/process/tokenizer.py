"""The one tokenizer loader: the API process, the engine, the router and the benchmarks read a
model directory's Hugging Face tokenizer the same way.

transformers is imported when a tokenizer is loaded, not when this module is: the API process and
the router import this at start-up and must not load torch by importing it."""

from __future__ import annotations

import os
from typing import Any, Optional

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_tokenizer(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, name)) for name in TOKENIZER_FILES)


def load_tokenizer(path: str, required: bool = False) -> Optional[Any]:
    """The directory's tokenizer. Without tokenizer files: None (a model served on token ids
    only), or ValueError when `required`. ValueError naming the path when the files are there but
    do not load."""
    if not has_tokenizer(path):
        if required:
            raise ValueError(f"no tokenizer in {path!r} (neither of {', '.join(TOKENIZER_FILES)})")
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001: a broken or foreign tokenizer file; say which directory
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e
