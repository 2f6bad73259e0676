"""SwiGLU entry points: validate -> allocate on the input's device -> guard -> pick variant -> launch.

`swiglu(gate, up)` and `swiglu_packed(x)` compute silu(gate) * up in fp32 with one rounding,
forward and backward (the backward recomputes the activation and allocates only the gradients).
The variant is chosen per call from the capability of the input's own device index (>= 90:
`_sm90`, else `_sm80`); CPU tensors run the Triton kernels under TRITON_INTERPRET=1 (tests) and
the torch reference otherwise. Everything that touches a device lives in this module.
"""

from __future__ import annotations

import os

import torch

from kernelhub.device import device_guard, device_properties

from . import _sm80, _sm90
from ._launcher import CachedLaunch
from .reference import swiglu_backward_reference, swiglu_packed_reference, swiglu_reference

__all__ = ["swiglu", "swiglu_packed", "IMPLS"]

IMPLS = ("sm90", "sm80", "reference")
_SUPPORTED = frozenset({torch.float16, torch.bfloat16, torch.float32})
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The interpreter has no SMs; 2 keeps the persistent (sm90) grid smaller than the tile count in
# tests, so its grid-stride loop runs more than once.
_INTERPRETER_SM_COUNT = 2
_MAX_CONFIGS = 4096


class _Variant:
    """One generation's kernels, launch configs and cached launchers."""

    def __init__(self, name: str, module) -> None:
        self.name = name
        self._config = module.config
        self._configs: dict[tuple, tuple] = {}
        self.fwd = CachedLaunch(module.fwd_kernel, module.OPTIONS)
        self.bwd = CachedLaunch(module.bwd_kernel, module.OPTIONS)

    def config(self, M: int, N: int, elem_bytes: int, sm_count: int,
               backward: bool) -> tuple[int, int, int, int]:
        key = (M, N, elem_bytes, sm_count, backward)
        cfg = self._configs.get(key)
        if cfg is None:
            if len(self._configs) >= _MAX_CONFIGS:
                self._configs.clear()
            cfg = self._configs[key] = self._config(M, N, elem_bytes, sm_count, backward)
        return cfg

    def __repr__(self) -> str:
        return f"<swiglu variant {self.name}>"


# ROCm reports capabilities like 94 but takes none of the sm90 options: the generic path there.
_VARIANTS = {"sm90": _Variant("sm90", _sm90), "sm80": _Variant("sm80", _sm80)}
if torch.version.hip is not None:
    _VARIANTS["sm90"] = _VARIANTS["sm80"]


def _check_pair(fn: str, gate: object, up: object) -> None:
    if not isinstance(gate, torch.Tensor):
        raise TypeError(f"{fn}: `gate` must be a torch.Tensor, got {type(gate).__name__}")
    if not isinstance(up, torch.Tensor):
        raise TypeError(f"{fn}: `up` must be a torch.Tensor, got {type(up).__name__}")
    if gate.dtype not in _SUPPORTED:
        raise TypeError(f"{fn}: `gate` must be float16, bfloat16 or float32, got {gate.dtype}")
    if up.dtype != gate.dtype:
        raise TypeError(f"{fn}: `up` must have dtype {gate.dtype} like `gate`, got {up.dtype}")
    if up.device != gate.device:
        raise ValueError(f"{fn}: `up` must be on {gate.device} like `gate`, got {up.device}")
    if up.shape != gate.shape:
        raise ValueError(
            f"{fn}: `up` must have the shape of `gate` {tuple(gate.shape)}, got {tuple(up.shape)}"
        )
    if gate.dim() == 0:
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


def _resolve(fn: str, x: torch.Tensor, impl: str | None) -> tuple[_Variant, int, int] | None:
    """(variant, device index, SM count) for x's device; None means the torch reference."""
    if impl is None:
        variant = None
    elif impl == "reference":
        return None
    else:
        variant = _forced(fn, x, impl)
    if x.is_cuda:
        props = device_properties(x.device)
        if variant is None:
            variant = _VARIANTS["sm90" if props.capability >= 90 else "sm80"]
        return variant, x.device.index, props.sm_count
    if not _INTERPRET:
        return None
    return variant or _VARIANTS["sm80"], -1, _INTERPRETER_SM_COUNT


def _forced(fn: str, x: torch.Tensor, impl: object) -> _Variant:
    variant = _VARIANTS.get(impl) if isinstance(impl, str) else None
    if variant is None:
        raise ValueError(f"{fn}: `impl` must be one of {IMPLS} or None, got {impl!r}")
    if not x.is_cuda and not _INTERPRET:
        raise ValueError(f"{fn}: `impl` {impl!r} needs a CUDA tensor (or TRITON_INTERPRET=1), got {x.device}")
    return variant


def _rows(shape: torch.Size, strides: tuple[int, ...]) -> tuple[int, int] | None:
    """(M, row stride) of a [..., N] tensor seen as [M, N] without a copy, or None if impossible."""
    if len(shape) == 2:
        return shape[0], strides[0]
    M, stride_m = 1, 0
    for size, st in zip(reversed(shape[:-1]), reversed(strides[:-1]), strict=True):
        if size == 1:
            continue
        if M == 1:
            M, stride_m = size, st
        elif st == stride_m * M:
            M *= size
        else:
            return None
    return M, stride_m


def _launch(target: tuple[_Variant, int, int], backward: bool, packed: bool, N: int,
            tensors: tuple[torch.Tensor, ...]) -> None:
    """Launch over [..., N] tensors (inputs then outputs) viewed as rows; loop where no view exists.

    Packed: the up (and d up) tensor is the packed [..., 2N] one, offset N columns in the kernel.
    """
    variant, device_index, sm_count = target
    shape = tensors[-1].shape
    strides = [t.stride() for t in tensors]
    if len(shape) == 2:  # the common case, without the general collapse below
        M = shape[0]
        rs = [st[0] for st in strides]
    else:
        rows = [_rows(shape, st) for st in strides]
        if None in rows:
            # leading dims that no single row stride spans (rare): one launch per outer index
            for i in range(shape[0]):
                _launch(target, backward, packed, N, tuple(t[i] for t in tensors))
            return
        M = rows[0][0]
        rs = [r[1] for r in rows]
    block_m, block_n, num_warps, grid = variant.config(
        M, N, tensors[0].element_size(), sm_count, backward
    )
    if backward:
        ints = (M, N, rs[0], strides[0][-1], rs[1], strides[1][-1], rs[2], strides[2][-1], rs[3], rs[4])
        launcher = variant.bwd
    else:
        ints = (M, N, rs[0], strides[0][-1], rs[1], strides[1][-1], rs[2])
        launcher = variant.fwd
    launcher(grid, num_warps, device_index, tensors, ints, (block_m, block_n, N % block_n == 0, packed))


def _run(target: tuple[_Variant, int, int], backward: bool, packed: bool, N: int,
         tensors: tuple[torch.Tensor, ...]) -> None:
    """Launch with the tensors' device current (so on its current stream); restore the caller's."""
    if tensors[-1].numel() == 0:
        return
    device_index = target[1]
    # device_guard is a no-op when the device is already current; skipping its context manager
    # there saves ~2 us of host time per launch
    if device_index < 0 or torch.cuda.current_device() == device_index:
        _launch(target, backward, packed, N, tensors)
    else:
        with device_guard(tensors[0].device):
            _launch(target, backward, packed, N, tensors)


def _empty(like: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of like's shape, dtype and device (empty_like parses ~1.5 us faster
    than torch.empty(shape, dtype=, device=))."""
    return torch.empty_like(like, memory_format=torch.contiguous_format)


def _forward(target, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = _empty(gate)
    _run(target, False, False, gate.shape[-1], (gate, up, out))
    return out


def _forward_packed(target, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] // 2
    out = x.new_empty((*x.shape[:-1], n))
    _run(target, False, True, n, (x, x, out))
    return out


def _grad_output(dy: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if dy.dtype != like.dtype or dy.device != like.device:
        dy = dy.to(device=like.device, dtype=like.dtype)
    return dy


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, target) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.target = target
        return _forward(target, gate, up)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        dy = _grad_output(dy, gate)
        dg, du = _empty(gate), _empty(up)
        _run(ctx.target, True, False, gate.shape[-1], (dy, gate, up, dg, du))
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
        dy = _grad_output(dy, x)
        # one [..., 2I] gradient; the kernel writes both halves
        dx = _empty(x)
        _run(ctx.target, True, True, x.shape[-1] // 2, (dy, x, x, dx, dx))
        return dx, None


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
            place and returned (not differentiable). Validated, never moved or reallocated.
        impl: None picks by the capability of `gate`'s device (>= 90: "sm90", else "sm80");
            "sm90"/"sm80" force a Triton variant (CUDA, or CPU under TRITON_INTERPRET=1),
            "reference" the torch reference.

    Returns:
        [..., I] contiguous, dtype and device of `gate`.

    Raises:
        TypeError: not tensors, unsupported dtype, or dtypes differ.
        ValueError: devices or shapes differ, 0-d input, unknown `impl`, unusable `out`.
    """
    _check_pair("swiglu", gate, up)
    if out is not None:
        _check_out("swiglu", out, gate.shape, gate, gate.requires_grad or up.requires_grad)
    if torch.compiler.is_compiling() and impl != "reference":
        y = _swiglu_op(gate, up, _impl_arg("swiglu", impl))
        return y if out is None else out.copy_(y)
    target = _resolve("swiglu", gate, impl)
    if target is None:
        y = swiglu_reference(gate, up)
        return y if out is None else out.copy_(y)
    if out is not None:
        _run(target, False, False, gate.shape[-1], (gate, up, out))
        return out
    if (gate.requires_grad or up.requires_grad) and torch.is_grad_enabled():
        return _SwiGLUFunction.apply(gate, up, target)
    return _forward(target, gate, up)


def swiglu_packed(
    x: torch.Tensor, *, out: torch.Tensor | None = None, impl: str | None = None
) -> torch.Tensor:
    """`swiglu` of x's halves: gate = x[..., :I], up = x[..., I:] (views, no copies).

    Args:
        x: [..., 2I], float16/bfloat16/float32, any strides.
        out: optional preallocated [..., I] result, as for `swiglu`.
        impl: as for `swiglu`.

    Returns:
        [..., I] contiguous; the gradient is one [..., 2I] tensor.
    """
    _check_packed(x)
    if out is not None:
        _check_out("swiglu_packed", out, (*x.shape[:-1], x.shape[-1] // 2), x, x.requires_grad)
    if torch.compiler.is_compiling() and impl != "reference":
        y = _swiglu_packed_op(x, _impl_arg("swiglu_packed", impl))
        return y if out is None else out.copy_(y)
    target = _resolve("swiglu_packed", x, impl)
    if target is None:
        y = swiglu_packed_reference(x)
        return y if out is None else out.copy_(y)
    if out is not None:
        _run(target, False, True, x.shape[-1] // 2, (x, x, out))
        return out
    if x.requires_grad and torch.is_grad_enabled():
        return _SwiGLUPackedFunction.apply(x, target)
    return _forward_packed(target, x)


# ---- torch.compile: the same launches as opaque custom ops (no graph breaks) -------------------
# Eager calls never go through these: the dispatcher costs ~10 us a call, the autograd.Function
# path above a few. The namespace carries the module name, which carries the kernel's path digest,
# so two loaded versions of this kernel register distinct ops.
_NS = "kernelhub_" + __name__.replace(".", "_")


def _impl_arg(fn: str, impl: str | None) -> str:
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"{fn}: `impl` must be one of {IMPLS} or None, got {impl!r}")
    return "auto" if impl is None else impl


def _op_target(fn: str, x: torch.Tensor, impl: str):
    return _resolve(fn, x, None if impl == "auto" else impl)


@torch.library.custom_op(f"{_NS}::swiglu", mutates_args=())
def _swiglu_op(gate: torch.Tensor, up: torch.Tensor, impl: str) -> torch.Tensor:
    target = _op_target("swiglu", gate, impl)
    return swiglu_reference(gate, up) if target is None else _forward(target, gate, up)


@_swiglu_op.register_fake
def _(gate: torch.Tensor, up: torch.Tensor, impl: str) -> torch.Tensor:
    return gate.new_empty(gate.shape)


@torch.library.custom_op(f"{_NS}::swiglu_backward", mutates_args=())
def _swiglu_backward_op(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, impl: str
) -> tuple[torch.Tensor, torch.Tensor]:
    target = _op_target("swiglu", gate, impl)
    if target is None:
        return swiglu_backward_reference(dy, gate, up)
    dg, du = _empty(gate), _empty(up)
    _run(target, True, False, gate.shape[-1], (_grad_output(dy, gate), gate, up, dg, du))
    return dg, du


@_swiglu_backward_op.register_fake
def _(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _swiglu_setup(ctx, inputs, output) -> None:
    gate, up, impl = inputs
    ctx.save_for_backward(gate, up)
    ctx.impl = impl


def _swiglu_op_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    dg, du = _swiglu_backward_op(dy, gate, up, ctx.impl)
    return dg, du, None


_swiglu_op.register_autograd(_swiglu_op_backward, setup_context=_swiglu_setup)


@torch.library.custom_op(f"{_NS}::swiglu_packed", mutates_args=())
def _swiglu_packed_op(x: torch.Tensor, impl: str) -> torch.Tensor:
    target = _op_target("swiglu_packed", x, impl)
    return swiglu_packed_reference(x) if target is None else _forward_packed(target, x)


@_swiglu_packed_op.register_fake
def _(x: torch.Tensor, impl: str) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op(f"{_NS}::swiglu_packed_backward", mutates_args=())
def _swiglu_packed_backward_op(dy: torch.Tensor, x: torch.Tensor, impl: str) -> torch.Tensor:
    target = _op_target("swiglu_packed", x, impl)
    n = x.shape[-1] // 2
    if target is None:
        return torch.cat(swiglu_backward_reference(dy, x.narrow(-1, 0, n), x.narrow(-1, n, n)), dim=-1)
    dx = _empty(x)
    _run(target, True, True, n, (_grad_output(dy, x), x, x, dx, dx))
    return dx


@_swiglu_packed_backward_op.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, impl: str) -> torch.Tensor:
    return x.new_empty(x.shape)


def _swiglu_packed_setup(ctx, inputs, output) -> None:
    x, impl = inputs
    ctx.save_for_backward(x)
    ctx.impl = impl


def _swiglu_packed_op_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return _swiglu_packed_backward_op(dy, x, ctx.impl), None


_swiglu_packed_op.register_autograd(_swiglu_packed_op_backward, setup_context=_swiglu_packed_setup)
