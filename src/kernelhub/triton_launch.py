"""Lean Triton launches for kernel repositories: `kernel[grid](...)` once, then the compiled handle.

`kernel[grid](...)` spends tens of microseconds of Python per call (binding, specializing every
argument, hashing a key, reading knobs) before a few-microsecond driver call; a MoE forward makes
about ten launches, so in eager decode that Python *is* the run time. `CachedLaunch` lets Triton
compile and launch the first call of each specialization, keeps the compiled kernel, and afterwards
calls that kernel's launcher itself with the same arguments: same binary, same stream, same bits.
The launcher's calling convention, `run(gx, gy, gz, stream, function, packed_metadata,
launch_metadata, enter_hook, exit_hook, *all_args)`, is the one `JITFunction.run` uses in triton
3.4 through 3.7.

Device safety: the caller names the device index the launch is for (the one its guard made
current); the stream is that device's current stream and every key includes the index, so a
kernel compiled for one GPU is never launched on another.

Keys are at least as fine as Triton's own specialization: tensors by dtype and 16-byte alignment,
ints by exact value (and, to reuse a compiled kernel for a new value, by Triton's int
specialization: `== 1`, `% 16 == 0`, 32/64-bit), constexprs, bools, floats, None and tensor
descriptors by value. Profiler hooks, pre-run hooks, stage hooks, async compilation and the
interpreter take Triton's own path.

Tensors reach the launcher as their addresses (ints): for a tensor it would call `data_ptr()` and
ask the driver (`cuPointerGetAttribute`) whether the address is a device one, per pointer and per
launch. Our callers have already checked that every tensor is a CUDA tensor on the launch's
device, so that check repeats one of ours. On triton 3.6 the launcher's own entry point is called
directly when the kernel needs no scratch memory (what `CudaLauncher.__call__` does, minus a
Python frame).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from typing import NamedTuple

import torch

try:
    from triton import knobs as _knobs
except ImportError:  # triton < 3.4: always take Triton's own path
    _knobs = None

__all__ = ["CachedLaunch", "SplitLaunch"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_MAX_KEYS = 4096  # exact keys; a sweep over many sequence lengths must not grow forever
_I32 = 1 << 31


def _int_spec(v: int) -> int:
    """Triton's specialization of a runtime int: == 1 (a constant), else % 16 and 32/64-bit width."""
    if v == 1:
        return 1
    return 2 + (v % 16 == 0) + 2 * (v >= _I32 or v < -_I32)


def _arg_key(a: object) -> object:
    """An argument's part of the exact key (never equal for two args Triton specializes apart)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if type(a) is int or a is None:
        return a
    base = getattr(a, "base", None)
    if isinstance(base, torch.Tensor):  # a host TensorDescriptor: every field, exactly
        return (type(a), base.dtype, base.data_ptr() % 16 == 0, tuple(a.shape), tuple(a.strides),
                tuple(a.block_shape), getattr(a, "padding", None))
    return (type(a), a)  # bool (True == 1 must not collide with an int), float, str, dtype


def _spec_key(exact: tuple, constexpr: tuple[bool, ...]) -> tuple:
    """The exact key with each runtime int replaced by Triton's specialization of it."""
    return tuple(
        _int_spec(k) if type(k) is int and not is_const else k
        for k, is_const in zip(exact, constexpr, strict=True)
    )


def _hooks_registered() -> bool:
    return _launch_state() is None


def _launch_state() -> tuple | None:
    """(debug, instrumentation mode), the Triton settings a compiled handle depends on; None while a
    launch or compile hook is registered (every launch must then go through Triton, which calls it)."""
    rt = _knobs.runtime
    # 3.6/3.7: a HookChain whose `calls` list is empty when nothing is registered
    hook = rt.launch_enter_hook
    if hook is not None and getattr(hook, "calls", True):
        return None
    hook = rt.launch_exit_hook
    if hook is not None and getattr(hook, "calls", True):
        return None
    if getattr(rt, "add_stages_inspection_hook", None) is not None:
        return None
    return rt.debug, getattr(_knobs.compilation, "instrumentation_mode", None)


def _split_key(device_index: int, num_warps: int, num_stages: int | None, state: tuple, dtypes: tuple,
               extras: tuple, ints: tuple, constexprs: tuple) -> tuple:
    """A `split` call's exact key: device, launch options, Triton settings, dtypes, the extras' keys,
    ints, constexprs (tagged: `__call__`'s keys share the dicts)."""
    return ("split", device_index, num_warps, num_stages, state, dtypes,
            tuple([_arg_key(e) for e in extras]) if extras else (), ints, constexprs)


def _direct_entry(run: object) -> tuple | None:
    """(launch, cooperative, pdl) of a triton 3.6 CudaLauncher that needs no scratch memory, whose
    `__call__` then only forwards to `launch(gx, gy, gz, stream, function, cooperative, pdl,
    global_scratch, profile_scratch, *rest)`; None (call the launcher itself) for anything else,
    e.g. triton 3.7, whose launcher takes its arguments in another layout."""
    if type(run).__name__ != "CudaLauncher" or hasattr(run, "arg_annotations"):
        return None
    fields = ("launch", "launch_cooperative_grid", "launch_pdl", "global_scratch_size", "profile_scratch_size")
    if not all(hasattr(run, f) for f in fields) or run.global_scratch_size or run.profile_scratch_size:
        return None
    return run.launch, run.launch_cooperative_grid, run.launch_pdl


class SplitLaunch(NamedTuple):
    """One `CachedLaunch.split` call as `CachedLaunch.recording` saw it (its arguments, unchanged)."""

    launcher: CachedLaunch
    grid: tuple
    device_index: int
    tensors: tuple
    extras: tuple
    ints: tuple
    constexprs: tuple
    num_warps: int
    num_stages: int | None


_RECORDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("kernelhub_split_recording",
                                                                         default=None)


class CachedLaunch:
    """Launch one `@triton.jit` kernel; every parameter passed (positionally or as constexpr kw)."""

    def __init__(self, kernel, **options) -> None:
        self.kernel = kernel
        self.options = {} if _INTERPRET else options  # GPU-only compile options (e.g. maxnreg)
        params = getattr(kernel, "params", None)  # JITFunction; the interpreter's has arg_names only
        self.names = tuple(getattr(kernel, "arg_names", None) or (p.name for p in params or ()))
        self.constexpr = tuple(bool(p.is_constexpr) for p in params) if params is not None else ()
        self.exact: dict[tuple, tuple] = {}  # exact key -> (run, function, packed_metadata)
        self.by_spec: dict[tuple, tuple] = {}  # Triton's specialization -> the same triple
        self.fast = (not _INTERPRET and _knobs is not None and params is not None
                     and hasattr(kernel, "pre_run_hooks"))

    def _triton(self, grid: tuple, args: tuple, num_warps: int, num_stages: int | None,
                kwargs: dict | None = None):
        extra = dict(kwargs or {})
        if num_stages is not None:
            extra["num_stages"] = num_stages
        return self.kernel[grid](*args, num_warps=num_warps, **extra, **self.options)

    def __call__(self, grid: tuple, device_index: int, *args, num_warps: int = 4,
                 num_stages: int | None = None, **constexprs) -> None:
        """Launch on `device_index`'s current stream; that device must be current (the guard).

        `grid` has 1-3 entries; `args` are the kernel's leading parameters in order and
        `constexprs` the remaining ones by name.
        """
        if constexprs:
            names = self.names[len(args):]
            if len(names) != len(constexprs) or not all(n in constexprs for n in names):
                self._triton(grid, args, num_warps, num_stages, constexprs)
                return
            args = args + tuple([constexprs[n] for n in names])
        if not self.fast or len(args) != len(self.names) or self.kernel.pre_run_hooks or _hooks_registered():
            self._triton(grid, args, num_warps, num_stages)
            return
        rt = _knobs.runtime
        head = (device_index, num_warps, num_stages, rt.debug,
                getattr(_knobs.compilation, "instrumentation_mode", None))
        exact = tuple([a if type(a) is int else _arg_key(a) for a in args])
        key = (head, exact)
        hit = self.exact.get(key)
        if hit is None:
            hit = self._lookup_or_compile(key, (head, _spec_key(exact, self.constexpr)), grid, args,
                                          num_warps, num_stages)
            if hit is None:
                return  # launched by Triton itself
        self._run(hit, grid, device_index,
                  tuple([a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]))

    def split(self, grid: tuple, device_index: int, tensors: tuple, ints: tuple, constexprs: tuple,
              num_warps: int = 4, num_stages: int | None = None, extras: tuple = ()) -> None:
        """The same launch with a cheaper key, for a kernel whose signature is
        (*tensors, *extras, *ints, *constexprs) and a call site that passes the same kinds at each
        position (`ints` plain ints, `constexprs` fixed types, `extras` None or tensor descriptors):
        the key is the tensors' dtypes, the extras' keys, the ints and the constexprs, with no
        per-argument dispatch (a few us less per launch on slow hosts; ~20 us for a 40-argument
        kernel).
        """
        recording = _RECORDING.get()
        if recording is not None:
            recording.append(SplitLaunch(self, grid, device_index, tensors, extras, ints, constexprs, num_warps,
                                         num_stages))
        ptrs = []
        dtypes = []
        bits = 0
        for t in tensors:
            p = t.data_ptr()
            bits |= p
            ptrs.append(p)
            dtypes.append(t.dtype)
        state = None if bits & 15 or not self.fast or self.kernel.pre_run_hooks else _launch_state()
        if state is None:
            self(grid, device_index, *tensors, *extras, *ints, *constexprs, num_warps=num_warps,
                 num_stages=num_stages)
            return
        key = _split_key(device_index, num_warps, num_stages, state, tuple(dtypes), extras, ints, constexprs)
        hit = self.exact.get(key)
        if hit is None:
            # (only here: a hit's key fixes every part's length, and a call with the wrong number of
            # arguments takes Triton's path, which raises)
            if len(tensors) + len(extras) + len(ints) + len(constexprs) != len(self.names):
                self(grid, device_index, *tensors, *extras, *ints, *constexprs, num_warps=num_warps,
                     num_stages=num_stages)
                return
            spec_key = key[:7] + (tuple([_int_spec(v) for v in ints]), constexprs)
            hit = self._lookup_or_compile(key, spec_key, grid, tensors + extras + ints + constexprs, num_warps,
                                          num_stages)
            if hit is None:
                return
        ptrs.extend(extras)
        ptrs.extend(ints)
        ptrs.extend(constexprs)
        self._run(hit, grid, device_index, ptrs)

    def split_hit(self, call: SplitLaunch) -> tuple | None:
        """The compiled handle a recorded `split` call launched through (None where it took Triton's
        own path), for a caller that replays the same launch with other addresses (`run_hit`)."""
        state = None if not self.fast or self.kernel.pre_run_hooks else _launch_state()
        if state is None:
            return None
        return self.exact.get(_split_key(call.device_index, call.num_warps, call.num_stages, state,
                                         tuple([t.dtype for t in call.tensors]), call.extras, call.ints,
                                         call.constexprs))

    @staticmethod
    @contextlib.contextmanager
    def recording() -> Iterator[list[SplitLaunch]]:
        """Collect every `split` call made in this context (this thread / task only) while it still
        launches as usual: how a caller learns the launches of a code path in order to replay them."""
        calls: list[SplitLaunch] = []
        token = _RECORDING.set(calls)
        try:
            yield calls
        finally:
            _RECORDING.reset(token)

    @staticmethod
    def launch_state() -> tuple | None:
        """The Triton settings compiled handles depend on (debug, instrumentation), for a replaying
        caller's key; None while launch or compile hooks are set (then every launch must go
        through Triton, which calls them) or on a Triton without knobs."""
        return None if _knobs is None else _launch_state()

    @staticmethod
    def run_hit(hit: tuple, grid: tuple, device_index: int, args: tuple) -> None:
        """Launch a handle from `split_hit` on `device_index`'s current stream with `args` in the
        kernel's order, tensors as addresses. The caller answers for everything `split` checks:
        same dtypes, ints, constexprs and descriptors as the recorded call, every address 16-byte
        aligned and on that device, no hooks registered."""
        CachedLaunch._run(hit, grid, device_index, args)

    def _lookup_or_compile(self, key: tuple, spec_key: tuple, grid: tuple, args: tuple, num_warps: int,
                           num_stages: int | None) -> tuple | None:
        """The compiled handle for Triton's specialization of this call; on a miss Triton compiles
        (or loads) and launches this call itself, and None is returned."""
        hit = self.by_spec.get(spec_key)
        if hit is not None:
            self._remember(key, hit)
            return hit
        compiled = self._triton(grid, args, num_warps, num_stages)
        # 3.7's async compile mode returns a future: keep only a loaded, launchable kernel
        if compiled is None or hasattr(compiled, "result") or not all(
            hasattr(compiled, a) for a in ("run", "function", "packed_metadata")
        ) or not callable(compiled.run):
            return None
        hit = self.by_spec[spec_key] = (compiled.run, compiled.function, compiled.packed_metadata,
                                        _direct_entry(compiled.run))
        self._remember(key, hit)
        return None

    @staticmethod
    def _run(hit: tuple, grid: tuple, device_index: int, args: tuple) -> None:
        run, function, metadata, direct = hit
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(device_index)
        # launch metadata and hooks None: what Triton passes when no hook is registered
        if direct is not None:
            launch, cooperative, pdl = direct
            # scratch None: the kernel needs none (checked in _direct_entry)
            launch(grid[0], g1, g2, stream, function, cooperative, pdl, None, None, metadata, None, None,
                   None, *args)
        else:
            run(grid[0], g1, g2, stream, function, metadata, None, None, None, *args)

    def _remember(self, key: tuple, hit: tuple) -> None:
        if len(self.exact) >= _MAX_KEYS:
            self.exact.clear()
        self.exact[key] = hit
