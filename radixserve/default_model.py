"""The model served when no --model-path is given: the built-in tiny random Qwen2 (a CPU demo).

The entry points (the offline `Engine`, the server launcher) resolve the model path here, so the
engine itself only ever loads a directory it is given and never imports the test helpers.
"""

from __future__ import annotations

import os
from typing import Optional


# The built-in model's directory name, which is also its served name.
DEFAULT_MODEL_NAME = "tiny-qwen2"


def default_model_dir() -> str:
    """Where the built-in tiny random Qwen2 lives (built on first use, a few seconds on a CPU)."""
    root = os.environ.get("RADIXSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "radixserve"))
    return os.path.join(root, DEFAULT_MODEL_NAME)


def ensure_model_path(model_path: Optional[str]) -> str:
    """model_path itself, or the built-in tiny model's directory (built there if missing or built by
    another version of build_tiny_model)."""
    if model_path:
        return model_path
    from radixserve.testing.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(default_model_dir()))


def default_model_positions() -> int:
    """The built-in tiny model's max_position_embeddings (Qwen2's), known before it is built."""
    from radixserve.testing.tiny_model import MAX_POSITIONS

    return MAX_POSITIONS
