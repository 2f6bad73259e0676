"""SwiGLU entry points: validate -> allocate on the input's device -> guard -> pick variant -> launch.

`swiglu(gate, up)` and `swiglu_packed(x)` compute silu(gate) * up in fp32 with one rounding,
forward and backward (the backward recomputes the activation and allocates only the gradients).
Variant choice and launches live in `_dispatch.py`, the torch.compile custom ops in
`_custom_ops.py`.
"""

from __future__ import annotations

import torch

from ._custom_ops import compiled_swiglu, compiled_swiglu_packed
from ._dispatch import IMPLS, _empty, _forward, _forward_packed, _resolve, _run
from .reference import swiglu_packed_reference, swiglu_reference

__all__ = ["swiglu", "swiglu_packed", "IMPLS"]

_SUPPORTED = frozenset({torch.float16, torch.bfloat16, torch.float32})


def _check_pair(fn: str, gate: object, up: object) -> None:
    if not isinstance(gate, torch.Tensor):
        raise TypeError(f"{fn}: `gate` must be a torch.Tensor, got {type(gate).__name__}")
    if not isinstance(up, torch.Tensor):
        raise TypeError(f"{fn}: `up` must be a torch.Tensor, got {type(up).__name__}")
    dtype = gate.dtype
    if dtype not in _SUPPORTED:
        raise TypeError(f"{fn}: `gate` must be float16, bfloat16 or float32, got {dtype}")
    if up.dtype is not dtype:
        raise TypeError(f"{fn}: `up` must have dtype {dtype} like `gate`, got {up.dtype}")
    # two CUDA tensors with one index are on one device; anything else compares torch.devices
    if not (gate.is_cuda and up.is_cuda and gate.get_device() == up.get_device()) and up.device != gate.device:
        raise ValueError(f"{fn}: `up` must be on {gate.device} like `gate`, got {up.device}")
    shape = gate.shape
    if up.shape != shape:
        raise ValueError(f"{fn}: `up` must have the shape of `gate` {tuple(shape)}, got {tuple(up.shape)}")
    if not shape:
        raise ValueError(f"{fn}: `gate` must have at least one dimension, got a 0-d tensor")


def _check_packed(x: object) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"swiglu_packed: `x` must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _SUPPORTED:
        raise TypeError(f"swiglu_packed: `x` must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(
            f"swiglu_packed: `x` must have an even last dimension [..., 2I], got shape {tuple(x.shape)}"
        )


def _once(dy: torch.Tensor, *grads: torch.Tensor) -> tuple:
    """Under create_graph=True: the gradients, behind a node whose backward raises. The kernels build
    no graph, so a second derivative must fail rather than read zero (`once_differentiable`'s
    treatment, without its wrapper on the usual first-order path)."""
    if not dy.requires_grad:
        return grads
    err = torch._C._functions.DelayedError(b"swiglu: trying to differentiate twice (no second derivative)",
                                           len(grads))
    out = err(*[g.detach().requires_grad_() for g in grads])
    return out if isinstance(out, tuple) else (out,)


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, target) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.target = target
        return _forward(target, gate, up)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        dg, du = _empty(gate), _empty(up)
        # autograd hands dy over with the output's dtype and device (gate's); any strides work
        _run(ctx.target, True, False, gate.shape[-1], (dy, gate, up, dg, du))
        if torch.is_grad_enabled():  # create_graph=True
            dg, du = _once(dy, dg, du)
        return dg, du, None


class _SwiGLUPackedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, target) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.target = target
        return _forward_packed(target, x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (x,) = ctx.saved_tensors
        # one [..., 2I] gradient; the kernel writes both halves
        dx = _empty(x)
        _run(ctx.target, True, True, x.shape[-1] // 2, (dy, x, x, dx, dx))
        if torch.is_grad_enabled():  # create_graph=True
            (dx,) = _once(dy, dx)
        return dx, None


def _base_apply(function: type) -> object:
    """`Function.apply` minus its Python prologue (setup_context binding, functorch checks): the
    C++ `_FunctionBase.apply` bound to `function`. ~4 us less host time per eager call; used only
    when no functorch transform is active (`_functorch` sends those calls to the reference), where
    the prologue changes nothing for these Functions (no `setup_context`)."""
    base = getattr(torch._C, "_FunctionBase", None)
    if base is None or function.setup_context is not torch.autograd.Function.setup_context:
        return function.apply
    return super(torch.autograd.Function, function).apply


_SWIGLU_APPLY = _base_apply(_SwiGLUFunction)
_SWIGLU_PACKED_APPLY = _base_apply(_SwiGLUPackedFunction)
_functorch_active = torch._C._are_functorch_transforms_active


def _functorch(fn: str, impl: str | None) -> bool:
    """Under a torch.func transform (vmap, grad, ...): True, so the torch reference runs (the same
    fp32 math and one rounding); the kernels read raw addresses, which a batched tensor has not,
    so a forced Triton `impl` is refused there."""
    if not _functorch_active():
        return False
    if impl is not None:
        raise ValueError(f"{fn}: torch.func transforms (vmap, grad, ...) run the torch reference; "
                         f"`impl` {impl!r} cannot run under one (use impl=None or 'reference')")
    return True


def _addressable() -> bool:
    """Tensors have addresses to compare: not while torch.compile traces (fake tensors) or under a
    torch.func transform (batched tensors). Both paths compute the result first and copy it into
    `out`, which is right whatever memory `out` shares."""
    return not (torch.compiler.is_compiling() or _functorch_active())


def _impl_arg(fn: str, impl: str | None) -> str:
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"{fn}: `impl` must be one of {IMPLS} or None, got {impl!r}")
    return "auto" if impl is None else impl


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, one past the last) byte address of a non-empty tensor's elements (torch strides are
    never negative)."""
    start = t.data_ptr()
    if t.is_contiguous():  # the usual case, without the Python loop below
        return start, start + t.nbytes
    last = sum([(n - 1) * st for n, st in zip(t.shape, t.stride())])
    return start, start + (last + 1) * t.element_size()


def _check_no_overlap(fn: str, out: torch.Tensor, inputs: tuple[tuple[str, torch.Tensor], ...],
                      same_ok: bool) -> None:
    """`out` shares no memory with the inputs, or (`same_ok`) is one of them exactly.

    The kernels read an input element in the program that writes the same element of `out`, and
    only there, so `out` that *is* an input (same address, shape and strides; `out` is contiguous)
    is computed in place; any other sharing lets one program overwrite what another still has to
    read. Conservative: byte ranges that intersect are refused even where a strided input's gaps
    would hold `out`. Only calls given `out` pay for it (a couple of us).
    """
    if out.is_meta or not out.numel():  # (meta tensors have no memory)
        return
    lo, hi = _span(out)
    for name, t in inputs:
        if not t.numel():
            continue
        start, end = _span(t)
        if start < hi and lo < end:
            if same_ok and start == lo and end == hi and t.is_contiguous():
                continue  # the very memory of `out`, element for element
            exact = " (it may be that very tensor, with its strides)" if same_ok else ""
            raise ValueError(f"{fn}: `out` overlaps `{name}`'s memory; pass a separate tensor{exact}")


def _check_out(fn: str, out: object, shape: tuple, like: torch.Tensor, needs_grad: bool) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{fn}: `out` must be a torch.Tensor or None, got {type(out).__name__}")
    if out.device != like.device:
        raise ValueError(f"{fn}: `out` must be on {like.device} like the input, got {out.device}")
    if out.dtype != like.dtype:
        raise TypeError(f"{fn}: `out` must have dtype {like.dtype} like the input, got {out.dtype}")
    if out.shape != shape:
        raise ValueError(f"{fn}: `out` must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if not out.is_contiguous():
        raise ValueError(f"{fn}: `out` must be contiguous, got strides {out.stride()}")
    if torch.is_grad_enabled() and (needs_grad or out.requires_grad):
        raise ValueError(f"{fn}: `out` is not differentiable; call without `out` when inputs require grad")


def swiglu(
    gate: torch.Tensor, up: torch.Tensor, *, out: torch.Tensor | None = None, impl: str | None = None
) -> torch.Tensor:
    """silu(gate) * up, computed in fp32 and rounded once; differentiable.

    Args:
        gate: [..., I], float16/bfloat16/float32, any strides (a `chunk` view works, no copy).
        up: same shape, dtype and device as `gate`.
        out: optional preallocated result: contiguous, gate's shape, dtype and device; written in
            place and returned (not differentiable). Validated, never moved or reallocated. It may
            be `gate` or `up` itself (computed in place) but share no other memory with them.
        impl: None picks by the capability of `gate`'s device (>= 90: "sm90", else "sm80"; under a
            torch.func transform the torch reference); "sm90"/"sm80" force a Triton variant (CUDA,
            or CPU under TRITON_INTERPRET=1), "reference" the torch reference.

    Returns:
        [..., I] contiguous, dtype and device of `gate`.

    Raises:
        TypeError: not tensors, unsupported dtype, or dtypes differ.
        ValueError: devices or shapes differ, 0-d input, unknown `impl` (or a Triton one under a
            torch.func transform), unusable `out` (including one whose memory overlaps an input's
            without being that input; checked in eager calls, while torch.compile and torch.func
            compute the result first and copy it, right whatever `out` shares).
    """
    _check_pair("swiglu", gate, up)
    if out is not None:
        _check_out("swiglu", out, gate.shape, gate, gate.requires_grad or up.requires_grad)
        if _addressable():
            _check_no_overlap("swiglu", out, (("gate", gate), ("up", up)), same_ok=True)
    # (under a torch.func transform, compiled or not, the reference runs: see `_functorch`)
    if torch.compiler.is_compiling() and impl != "reference" and not _functorch_active():
        y = compiled_swiglu(gate, up, _impl_arg("swiglu", impl))
        return y if out is None else out.copy_(y)
    target = _resolve("swiglu", gate, impl)
    if target is None or _functorch("swiglu", impl):
        y = swiglu_reference(gate, up)
        return y if out is None else out.copy_(y)
    if out is not None:
        _run(target, False, False, gate.shape[-1], (gate, up, out))
        return out
    if (gate.requires_grad or up.requires_grad) and torch.is_grad_enabled():
        return _SWIGLU_APPLY(gate, up, target)
    return _forward(target, gate, up)


def swiglu_packed(
    x: torch.Tensor, *, out: torch.Tensor | None = None, impl: str | None = None
) -> torch.Tensor:
    """`swiglu` of x's halves: gate = x[..., :I], up = x[..., I:] (views, no copies).

    Args:
        x: [..., 2I], float16/bfloat16/float32, any strides.
        out: optional preallocated [..., I] result, as for `swiglu`; it shares no memory with `x`.
        impl: as for `swiglu`.

    Returns:
        [..., I] contiguous; the gradient is one [..., 2I] tensor.
    """
    _check_packed(x)
    if out is not None:
        _check_out("swiglu_packed", out, (*x.shape[:-1], x.shape[-1] // 2), x, x.requires_grad)
        if _addressable():
            _check_no_overlap("swiglu_packed", out, (("x", x),), same_ok=False)
    if torch.compiler.is_compiling() and impl != "reference" and not _functorch_active():
        y = compiled_swiglu_packed(x, _impl_arg("swiglu_packed", impl))
        return y if out is None else out.copy_(y)
    target = _resolve("swiglu_packed", x, impl)
    if target is None or _functorch("swiglu_packed", impl):
        y = swiglu_packed_reference(x)
        return y if out is None else out.copy_(y)
    if out is not None:
        _run(target, False, True, x.shape[-1] // 2, (x, x, out))
        return out
    if x.requires_grad and torch.is_grad_enabled():
        return _SWIGLU_PACKED_APPLY(x, target)
    return _forward_packed(target, x)
