"""The direct-launch key of radixserve.kernels.launch (CPU: no Triton launch happens here).

The GPU side (direct launches equal Triton's own, one entry per specialisation) is in
tests/gpu/test_triton_fused.py.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels.launch import FastKernel, _arg_key


def test_key_separates_everything_triton_specialises_on():
    flat = torch.zeros(64, dtype=torch.bfloat16)
    aligned, misaligned = flat[:32], flat[1:33]
    assert _arg_key(aligned) != _arg_key(misaligned), "16-byte alignment"
    assert _arg_key(aligned) != _arg_key(aligned.float()), "dtype"
    assert _arg_key(aligned) == _arg_key(flat[8:40]), "another aligned view shares the entry"
    ints = [1, 2, 16, 17, 32, 1 << 31, -16, 0]
    keys = {_arg_key(i) for i in ints}
    assert _arg_key(1) != _arg_key(2) and _arg_key(16) != _arg_key(17), "== 1 and divisibility by 16"
    assert _arg_key(16) != _arg_key(1 << 31), "32-bit vs 64-bit ints"
    assert len(keys) >= 5
    assert _arg_key(True) != _arg_key(1), "a bool is not an int"
    assert _arg_key(0.5) == _arg_key(2.0) and _arg_key(None) is None
    with pytest.raises(TypeError):
        _arg_key("a string")


class _NotJitted:
    """Stands in for a kernel that is not a compiled Triton JITFunction (e.g. under the interpreter)."""

    arg_names = ["X", "n", "BLOCK"]

    def __init__(self):
        self.calls: list[tuple] = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.calls.append((grid, args, kwargs))

        return run


def test_without_a_jit_function_every_call_goes_through_triton():
    fn = _NotJitted()
    fast = FastKernel(fn)
    x = torch.zeros(4)
    for _ in range(3):
        fast[(2,)](x, 4, BLOCK=8, num_warps=1)
    assert len(fn.calls) == 3 and fn.calls[0] == ((2,), (x, 4), {"BLOCK": 8, "num_warps": 1})
    assert fast._cache == {}
