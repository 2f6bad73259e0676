"""Run a Gluon kernel's own source in Triton's CPU interpreter, which has no Gluon.

Why: Gluon adds explicit layouts to Triton's tensor semantics; the values a kernel computes do not
depend on them. So the kernel's source, with `gl` bound to a shim that maps each Gluon call to
its `triton.language` twin and drops the layout arguments, runs under TRITON_INTERPRET=1 and
tests the kernel's indexing, masks and arithmetic on the CPU. The layouts themselves are checked
where they matter, by compiling for sm90 (`benchmarks/compile_check_fp8.py`) and on the GPU.
"""

from __future__ import annotations

import types

import triton
import triton.language as tl


def _layout(*_args, **_kwargs) -> None:
    return None


def _shim() -> types.SimpleNamespace:
    # calls go through tl's attributes at run time, which the interpreter patches while it runs
    return types.SimpleNamespace(
        constexpr=tl.constexpr, float32=tl.float32, float16=tl.float16, int32=tl.int32, int64=tl.int64,
        BlockedLayout=_layout, SliceLayout=_layout,
        num_warps=lambda: 4,
        program_id=lambda axis: tl.program_id(axis),
        arange=lambda start, end, layout=None: tl.arange(start, end),
        zeros=lambda shape, dtype, layout=None: tl.zeros(shape, dtype),
        expand_dims=lambda x, axis: tl.expand_dims(x, axis),
        convert_layout=lambda x, layout: x,
        load=lambda ptr, mask=None, other=None: tl.load(ptr, mask=mask, other=other),
        store=lambda ptr, value, mask=None: tl.store(ptr, value, mask=mask),
        sum=lambda x, axis: tl.sum(x, axis=axis),
        exp=lambda x: tl.exp(x),
        where=lambda c, x, y: tl.where(c, x, y),
    )


def interpreted(kernel) -> object:
    """`kernel` (a `@gluon.jit` function) as a `@triton.jit` one with `gl` shimmed and the grid
    dependency control it may call (PDL: no CPU meaning) a no-op."""
    fn = kernel.fn
    scope = {**fn.__globals__, "gl": _shim(), "tl": tl, "gdc_launch_dependents": lambda: None,
             "gdc_wait": lambda: None}
    twin = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    twin.__module__ = fn.__module__
    twin.__qualname__ = fn.__qualname__
    jitted = triton.jit(twin)
    # the interpreter finds constexpr parameters by their (string) annotations, "tl.constexpr"
    rewritten = jitted.rewrite()
    rewritten.__annotations__ = {k: "tl.constexpr" if v == "gl.constexpr" else v
                                 for k, v in rewritten.__annotations__.items()}
    return jitted
