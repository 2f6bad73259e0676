"""Inference-only torch ops for this kernel's compiled path, defined through a `torch.library.Library`.

Why not `torch.library.custom_op`: an op called only where no gradient is needed has no use for
custom_op's Python layers around its body (an autograd kernel, alias checks of every input and
output), which cost host time on every call (`tools/compiled_swiglu_op_host.py` times both).
Without an autograd kernel, torch's autograd fallback applies (the callers never pass tensors that
need a gradient).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def define_inference_op(lib: torch.library.Library, name: str, schema: str, fn: Callable,
                        fake: Callable) -> torch._ops.OpOverload:
    """`lib.ns::name` with `schema` (arguments and result, e.g. "(Tensor x) -> Tensor"), `fn` for
    CPU and CUDA tensors and `fake` for tracing; returns the op's default overload."""
    lib.define(name + schema)
    for key in ("CPU", "CUDA"):
        lib.impl(name, fn, key)
    torch.library.register_fake(f"{lib.ns}::{name}", fake, lib=lib)
    return getattr(getattr(torch.ops, lib.ns), name).default
