"""Lean Triton launches: `kernel[grid](...)` once per specialization, then the compiled handle.

`kernel[grid](...)` spends tens of microseconds in Python per call (binding, specializing every
argument, building a string key) before a few-microsecond driver call. Triton specializes a
launch on each pointer's dtype and 16-byte alignment and each integer's `== 1`, `% 16 == 0` and
32/64-bit width. `CachedLaunch` lets Triton compile and launch the first call of a
specialization, keeps the compiled kernel, and afterwards calls that kernel's launcher itself
with the same arguments: same binary, same stream, same bits. Its calling convention,
`run(gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook,
*all_args)`, is the one `JITFunction.run` uses in triton 3.4 through 3.7.

Keys: a launch whose pointers are all 16-byte aligned is looked up by its exact integers (one
tuple hash); a new integer tuple is mapped to Triton's specialization of it, so a new sequence
length reuses the compiled kernel. Misaligned pointers, profiler hooks, pre-run hooks, 3.7
stage hooks, async compilation and the interpreter take Triton's own path.
"""

from __future__ import annotations

import os

import torch

try:
    from triton import knobs as _knobs
except ImportError:  # triton < 3.4: always take Triton's own path
    _knobs = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_MAX_KEYS = 4096  # exact-integer keys; a sweep over many sequence lengths must not grow forever
_I32 = 1 << 31


def _int_spec(v: int) -> int:
    """Triton's specialization of an int: == 1 (a constant), else % 16 and 32/64-bit width."""
    if v == 1:
        return 1
    return 2 + (v % 16 == 0) + 2 * (v >= _I32 or v < -_I32)


def _hooks_registered() -> bool:
    rt = _knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        # 3.6/3.7: a HookChain whose `calls` list is empty when nothing is registered
        if hook is not None and getattr(hook, "calls", True):
            return True
    return getattr(rt, "add_stages_inspection_hook", None) is not None


class CachedLaunch:
    """Launch one `@triton.jit` kernel whose signature is (*pointers, *ints, *constexprs)."""

    def __init__(self, kernel, options: dict):
        self.kernel = kernel
        self.options = {} if _INTERPRET else options  # GPU-only compile options
        self.exact: dict[tuple, tuple] = {}  # exact ints -> launcher triple
        self.by_spec: dict[tuple, tuple] = {}  # Triton's specialization -> launcher triple
        self.fast = not _INTERPRET and _knobs is not None and hasattr(kernel, "pre_run_hooks")

    def _triton(self, grid: int, num_warps: int, args: tuple):
        return self.kernel[(grid,)](*args, num_warps=num_warps, **self.options)

    def __call__(self, grid: int, num_warps: int, device_index: int, ptrs: tuple, ints: tuple,
                 constexprs: tuple) -> None:
        """Launch on `device_index`'s current stream; that device must be current (the guard)."""
        args = ptrs + ints + constexprs
        aligned = True
        for p in ptrs:
            aligned = aligned and p.data_ptr() % 16 == 0
        if not (self.fast and aligned) or self.kernel.pre_run_hooks or _hooks_registered():
            self._triton(grid, num_warps, args)
            return
        rt = _knobs.runtime
        common = (device_index, num_warps, constexprs, ptrs[0].dtype, rt.debug,
                  getattr(_knobs.compilation, "instrumentation_mode", None))
        key = (common, ints)
        hit = self.exact.get(key)
        if hit is None:
            spec_key = (common, tuple([_int_spec(v) for v in ints]))
            hit = self.by_spec.get(spec_key)
            if hit is None:
                compiled = self._triton(grid, num_warps, args)
                # 3.7's async compile mode returns a future: keep only a loaded, launchable kernel
                if compiled is None or hasattr(compiled, "result") or not all(
                    hasattr(compiled, a) for a in ("run", "function", "packed_metadata")
                ) or not callable(compiled.run):
                    return
                hit = self.by_spec[spec_key] = (compiled.run, compiled.function, compiled.packed_metadata)
                if len(self.exact) >= _MAX_KEYS:
                    self.exact.clear()
                self.exact[key] = hit
                return
            if len(self.exact) >= _MAX_KEYS:
                self.exact.clear()
            self.exact[key] = hit
        run, function, metadata = hit
        # launch metadata and hooks None: what Triton passes when no hook is registered
        run(grid, 1, 1, torch._C._cuda_getCurrentRawStream(device_index), function, metadata,
            None, None, None, *args)
