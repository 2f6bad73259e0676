"""Lean Triton launches: `kernel[grid](...)` once per specialization, then the compiled handle.

`kernel[grid](...)` spends tens of microseconds in Python per call (binding, specializing every
argument, building a string key) before a few-microsecond driver call. Triton specializes a
launch on each pointer's dtype and 16-byte alignment and each integer's `== 1`, `% 16 == 0` and
32/64-bit width; `CachedLaunch` keys on exactly those facts (plus device index, constexprs and
options), lets Triton compile and launch the first call of a key, and afterwards calls that
compiled kernel's launcher itself with the same arguments: same binary, same stream, same bits.
The launcher's calling convention, `run(gx, gy, gz, stream, function, packed_metadata,
launch_metadata, enter_hook, exit_hook, *all_args)`, is the one `JITFunction.run` uses in
triton 3.4 through 3.7. Profiler hooks, pre-run hooks, 3.7 stage hooks and the interpreter take
Triton's own path.
"""

from __future__ import annotations

import os

import torch

try:
    from triton import knobs as _knobs
except ImportError:  # older triton: always take Triton's own path
    _knobs = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_MAX_KEYS = 1024  # keys hold flags, not values, so this is only a guard against pathological use
_I32 = 1 << 31


def _int_spec(v: int) -> int:
    """Triton's specialization of an int: ==1 (constexpr), else %16 and 32/64-bit width."""
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
        self.options = options  # GPU-only compile options (maxnreg, num_stages)
        self.cache: dict[tuple, tuple] = {}
        self.fast = (
            not _INTERPRET
            and _knobs is not None
            and hasattr(kernel, "pre_run_hooks")
        )

    def __call__(self, grid: int, num_warps: int, device_index: int, ptrs: tuple, ints: tuple,
                 constexprs: tuple) -> None:
        """Launch on `device_index`'s current stream; that device must be current (the guard)."""
        if not self.fast:
            self.kernel[(grid,)](*ptrs, *ints, *constexprs, num_warps=num_warps,
                                 **({} if _INTERPRET else self.options))
            return
        if self.kernel.pre_run_hooks or _hooks_registered():
            self.kernel[(grid,)](*ptrs, *ints, *constexprs, num_warps=num_warps, **self.options)
            return
        rt = _knobs.runtime
        key = (
            device_index, num_warps, constexprs, ptrs[0].dtype,
            tuple([p.data_ptr() % 16 == 0 for p in ptrs]),
            tuple([_int_spec(v) for v in ints]),
            rt.debug, getattr(_knobs.compilation, "instrumentation_mode", None),
        )
        hit = self.cache.get(key)
        if hit is not None:
            run, function, metadata = hit
            stream = torch._C._cuda_getCurrentRawStream(device_index)
            # launch metadata and hooks None: what Triton passes when no hook is registered
            run(grid, 1, 1, stream, function, metadata, None, None, None, *ptrs, *ints, *constexprs)
            return
        compiled = self.kernel[(grid,)](*ptrs, *ints, *constexprs, num_warps=num_warps, **self.options)
        # 3.7's async compile mode returns a future; keep only a launchable, loaded kernel
        if compiled is not None and not hasattr(compiled, "result") and all(
            hasattr(compiled, a) for a in ("run", "function", "packed_metadata")
        ):
            if len(self.cache) >= _MAX_KEYS:
                self.cache.clear()
            self.cache[key] = (compiled.run, compiled.function, compiled.packed_metadata)
