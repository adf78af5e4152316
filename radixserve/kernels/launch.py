"""Launch our Triton kernels without Triton's per-call dispatch (eager steps are host-bound).

`kernel[grid](*args, **constexprs)` through Triton binds every argument, specialises it, builds
a cache key and looks the compiled kernel up, on every call: ~15-30 us of host time on an H200's
host, before the C launcher (~6-12 us). An eager step of Qwen2-0.5B makes ~120 Triton launches,
so that is 2-4 ms of every prefill and mixed step, during which the GPU mostly waits.

`FastKernel(fn)[grid](*args, **constexprs)` keeps, per specialisation of its arguments, the
kernel Triton compiled (the first call of each goes through Triton as usual) and afterwards
calls its C launcher directly. The specialisation key holds everything Triton specialises on
(a superset, so two calls that Triton would compile apart never share an entry): each tensor's
dtype and 16-byte alignment; each int's width, divisibility by 16 and equality to 1; the
constexpr values and launch options. When a launch hook is installed (a profiler), under
Triton's interpreter, or with a Triton whose compiled kernels lack this interface, every call
takes Triton's own path.
"""

from __future__ import annotations

from typing import Any

import torch

_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1


def _arg_key(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return a.dtype, (a.data_ptr() & 15) == 0
    if isinstance(a, bool):
        return bool, a
    if isinstance(a, int):
        return a == 1, (a & 15) == 0, _I32_MIN <= a <= _I32_MAX, a < 0
    if isinstance(a, float):
        return float
    if a is None:
        return None
    raise TypeError(f"FastKernel: no key for an argument of type {type(a).__name__}")


class FastKernel:
    """A @triton.jit function launched as `FastKernel(fn)[grid](*args, **constexprs_and_options)`:
    positional arguments are the kernel's non-constexpr parameters in order; every constexpr
    parameter comes by keyword, with num_warps / num_stages."""

    def __init__(self, fn):
        self.fn = fn
        self.arg_names: list[str] = list(getattr(fn, "arg_names", []))
        self._cache: dict[tuple, tuple[Any, list[Any]]] = {}
        self._direct = self._direct_launch_available()

    def _direct_launch_available(self) -> bool:
        try:
            from triton import knobs
            from triton.runtime import driver
            from triton.runtime.jit import JITFunction
        except ImportError:
            return False
        if not isinstance(self.fn, JITFunction):  # e.g. TRITON_INTERPRET=1
            return False
        try:
            self._get_device = driver.active.get_current_device
            self._get_stream = driver.active.get_current_stream
        except Exception:  # no GPU driver here
            return False
        self._knobs = knobs.runtime
        return True

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _hooked(self) -> bool:
        # Triton >= 3.5 keeps the hooks in a HookChain (never None; empty when nothing is hooked).
        hook = self._knobs.launch_enter_hook
        return hook is not None and bool(getattr(hook, "calls", True))

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any]) -> None:
        if not self._direct or self._hooked():
            self.fn[grid](*args, **kwargs)
            return
        key = (tuple(kwargs.items()), *map(_arg_key, args))
        entry = self._cache.get(key)
        if entry is None:
            kernel = self.fn[grid](*args, **kwargs)  # compiles (once per variant) and launches
            if all(hasattr(kernel, attr) for attr in ("run", "function", "packed_metadata")):
                tail = [kwargs[name] for name in self.arg_names[len(args):]]
                self._cache[key] = (kernel, tail)
            return
        kernel, tail = entry
        n = len(grid)
        kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                   self._get_stream(self._get_device()), kernel.function, kernel.packed_metadata,
                   None, None, None, *args, *tail)
