"""Where the Triton tests run: a CUDA GPU, or the CPU under TRITON_INTERPRET=1; elsewhere they skip.

Importing this from a test module skips the whole module when neither is available.
"""

import os

import pytest
import torch

if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = "cpu"
else:
    pytest.skip("needs a CUDA GPU (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")
