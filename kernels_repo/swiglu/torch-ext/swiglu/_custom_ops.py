"""The launches as torch ops, used only while torch.compile traces (no graph breaks).

Eager calls never go through these: the dispatcher costs ~10 us a call, the autograd.Function
path in `ops.py` a few. Where a gradient may be needed, `torch.library.custom_op`s with their
backward; where none is (inference), plain `torch.library.Library` ops without custom_op's Python
layers around the body (an autograd kernel, alias checks of every input and output), which cost
host time on every compiled call. The op namespace carries the module name, which carries the
kernel's path digest, so two loaded versions of this kernel register distinct ops.
"""

from __future__ import annotations

import torch

from ._dispatch import _empty, _forward, _forward_packed, _grad_output, _resolve, _run
from ._inference_ops import define_inference_op
from .reference import swiglu_backward_reference, swiglu_packed_reference, swiglu_reference

_NS = "kernelhub_" + __name__.replace(".", "_")


def _op_target(fn: str, x: torch.Tensor, impl: str):
    return _resolve(fn, x, None if impl == "auto" else impl)


def _swiglu(gate: torch.Tensor, up: torch.Tensor, impl: str) -> torch.Tensor:
    target = _op_target("swiglu", gate, impl)
    return swiglu_reference(gate, up) if target is None else _forward(target, gate, up)


def _swiglu_fake(gate: torch.Tensor, up: torch.Tensor, impl: str) -> torch.Tensor:
    return gate.new_empty(gate.shape)


def _swiglu_packed(x: torch.Tensor, impl: str) -> torch.Tensor:
    target = _op_target("swiglu_packed", x, impl)
    return swiglu_packed_reference(x) if target is None else _forward_packed(target, x)


def _swiglu_packed_fake(x: torch.Tensor, impl: str) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


_LIB = torch.library.Library(_NS, "FRAGMENT")  # (kept: the ops live as long as the library object)
_swiglu_infer_op = define_inference_op(_LIB, "swiglu_infer", "(Tensor gate, Tensor up, str impl) -> Tensor",
                                       _swiglu, _swiglu_fake)
_swiglu_packed_infer_op = define_inference_op(_LIB, "swiglu_packed_infer", "(Tensor x, str impl) -> Tensor",
                                              _swiglu_packed, _swiglu_packed_fake)

_swiglu_op = torch.library.custom_op(f"{_NS}::swiglu", _swiglu, mutates_args=())
_swiglu_op.register_fake(_swiglu_fake)


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


_swiglu_packed_op = torch.library.custom_op(f"{_NS}::swiglu_packed", _swiglu_packed, mutates_args=())
_swiglu_packed_op.register_fake(_swiglu_packed_fake)


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


def compiled_swiglu(gate: torch.Tensor, up: torch.Tensor, impl: str) -> torch.Tensor:
    """What `swiglu` runs while torch.compile traces: the op with a backward where a gradient may
    be needed, else the inference op."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _swiglu_op(gate, up, impl)
    return _swiglu_infer_op(gate, up, impl)


def compiled_swiglu_packed(x: torch.Tensor, impl: str) -> torch.Tensor:
    """`compiled_swiglu` for `swiglu_packed`."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _swiglu_packed_op(x, impl)
    return _swiglu_packed_infer_op(x, impl)
