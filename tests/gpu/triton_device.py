"""Where the Triton tests run: a CUDA GPU, or the CPU under TRITON_INTERPRET=1; elsewhere they skip.

Importing this from a test module skips the whole module when neither is available. On the CPU:
`TRITON_INTERPRET=1 python -m pytest tests/gpu/test_triton_attention.py tests/gpu/test_triton_fused.py
tests/gpu/test_decode_linear.py tests/gpu/test_triton_layers.py` (tens of minutes; the CPU suite
runs a quick subset: tests/test_triton_interpreter.py). Triton 3.7.1 (the test extra's) works
with numpy 2.4; triton 3.6's interpreter needs numpy < 2.3.
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
