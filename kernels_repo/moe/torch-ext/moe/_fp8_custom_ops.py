"""`fused_experts` on fp8 weights as torch ops, used only while torch.compile traces.

As `_experts_custom_ops` does for the 16-bit path: the forward (any variant, resolved while
tracing) is one opaque op (an inference op where no gradient is needed), so Dynamo never traces
the Triton launches (it cannot) or the reference's data-dependent `nonzero`; the backward (x,
topk_weights; the fp8 weights are frozen) is a second op: the Triton variants' W8A16 backward,
or the reference's vector-Jacobian product.
"""

from __future__ import annotations

import json

import torch

from kernelhub.device import device_guard

from . import _fp8_experts as fp8
from ._fp8_validate import refuse_weight_gradients
from ._inference_ops import define_inference_op
from .reference_fp8 import fp8_reference_unchecked

_NS = "kernelhub_" + __name__.replace(".", "_")


def _forward(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv, down_proj_scale_inv,
             variant: str, block_size, config: str) -> torch.Tensor:
    with torch.no_grad():
        if variant == "reference":
            return fp8_reference_unchecked(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv,
                                           down_proj_scale_inv, tuple(block_size))
        # the eager inference path (variant resolved while tracing): a compiled graph replays too
        return fp8.run(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv,
                       down_proj_scale_inv, tuple(block_size), variant, False, None,
                       json.loads(config) if config else None)


@torch.library.custom_op(f"{_NS}::fused_experts_fp8", mutates_args=())
def fused_experts_fp8_op(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                         topk_idx: torch.Tensor, topk_weights: torch.Tensor, gate_up_proj_scale_inv: torch.Tensor,
                         down_proj_scale_inv: torch.Tensor, variant: str, block_size: list[int],
                         weight_needs: list[bool], config: str = "") -> torch.Tensor:
    """The training op (a gradient is needed: x's or topk_weights', or an fp8 weight's, refused in
    backward). `weight_needs`: which fp8 weights / scales required grad while tracing (AOT autograd
    does not report an fp8 input's need in needs_input_grad). `config`: a pinned bucket as JSON
    (`config_arg`; an op takes no dicts), "" for none."""
    return _forward(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv, down_proj_scale_inv,
                    variant, block_size, config)


@fused_experts_fp8_op.register_fake
def _(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv, down_proj_scale_inv, variant,
      block_size, weight_needs, config=""):
    return x.new_empty(x.shape)


def _infer_fake(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv, down_proj_scale_inv,
                variant, block_size, config):
    return x.new_empty(x.shape)


_LIB = torch.library.Library(_NS, "FRAGMENT")  # (kept: the ops live as long as the library object)
# where no gradient is needed (`_inference_ops`: no autograd layers)
fused_experts_fp8_infer_op = define_inference_op(
    _LIB, "fused_experts_fp8_infer", "(Tensor x, Tensor gate_up_proj, Tensor down_proj, Tensor topk_idx, "
    "Tensor topk_weights, Tensor gate_up_proj_scale_inv, Tensor down_proj_scale_inv, str variant, int[] block_size, "
    "str config) -> Tensor", _forward, _infer_fake)


@torch.compiler.assume_constant_result
def config_arg(config: dict | None) -> str:
    """A pinned bucket as the op's string argument (checked before: plain JSON values), computed
    once while tracing (Dynamo cannot trace the json encoder)."""
    return "" if config is None else json.dumps(config, sort_keys=True)


@torch.library.custom_op(f"{_NS}::fused_experts_fp8_backward", mutates_args=())
def fused_experts_fp8_backward_op(
    dout: torch.Tensor, x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, topk_idx: torch.Tensor,
    topk_weights: torch.Tensor, gate_up_proj_scale_inv: torch.Tensor, down_proj_scale_inv: torch.Tensor,
    block_size: list[int], needs: list[bool], weight_needs: list[bool], variant: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, d topk_weights, then the four weights' and scales' never-returned gradients); the first
    two by torch.func.vjp of the dequantized reference (a custom op's body runs
    below the autograd key, where torch.autograd.grad would see no graph); empty where not needed.
    `weight_needs`: gradients asked for the fp8 weights and scales, refused here, when the backward
    runs (AOT autograd traces the backward while compiling the forward, so raising in the autograd
    formula would fail every compiled forward of a module whose fp8 weights require grad)."""
    refuse_weight_gradients(tuple(weight_needs))
    empty = tuple(t.new_empty(0) for t in (gate_up_proj, down_proj, gate_up_proj_scale_inv, down_proj_scale_inv))
    if variant != "reference" and x.shape[0] > 0:  # the Triton backward (W8A16 kernels)
        with torch.no_grad(), device_guard(x):
            dx, dw = fp8.backward(dout, x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv,
                                  down_proj_scale_inv, tuple(needs))
        return (dx if needs[0] else x.new_empty(0), dw if needs[1] else topk_weights.new_empty(0)) + empty
    wanted = [t for t, need in zip((x, topk_weights), needs, strict=True) if need]

    def f(*args):
        it = iter(args)
        a = next(it) if needs[0] else x
        b = next(it) if needs[1] else topk_weights
        return fp8_reference_unchecked(a, gate_up_proj, down_proj, topk_idx, b, gate_up_proj_scale_inv,
                                       down_proj_scale_inv, tuple(block_size))

    found = iter(())
    if wanted:
        with device_guard(x):
            _, vjp = torch.func.vjp(f, *wanted)
            # copies: gradients of the "nothing routed" link are expanded views, which an op may not return
            found = iter(g.clone(memory_format=torch.contiguous_format) for g in vjp(dout.to(x.dtype)))
    grads = tuple(next(found).to(t.dtype) if need else t.new_empty(0)
                  for t, need in zip((x, topk_weights), needs, strict=True))
    # (the weights' slots exist so that a compiled backward uses this op's outputs where a weight
    # gradient is asked, and keeps the op that raises instead of dropping it as dead code)
    return grads + empty


@fused_experts_fp8_backward_op.register_fake
def _(dout, x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv, down_proj_scale_inv,
      block_size, needs, weight_needs, variant):
    return tuple(t.new_empty(t.shape) if need else t.new_empty(0)
                 for t, need in zip((x, topk_weights, gate_up_proj, down_proj, gate_up_proj_scale_inv,
                                     down_proj_scale_inv), needs + weight_needs, strict=True))


def _setup(ctx, inputs, output) -> None:
    x, gate_up_proj, down_proj, topk_idx, topk_weights, gus, ds, variant, block_size, weight_needs, _ = inputs
    ctx.save_for_backward(x, gate_up_proj, down_proj, topk_idx, topk_weights, gus, ds)
    ctx.block_size, ctx.weight_needs, ctx.variant = block_size, weight_needs, variant


def _backward(ctx, dout):
    n = ctx.needs_input_grad
    x, gate_up_proj, down_proj, topk_idx, topk_weights, gus, ds = ctx.saved_tensors
    needs = [n[0], n[4]]
    weight_needs = [a or b for a, b in zip(ctx.weight_needs, (n[1], n[2], n[5], n[6]), strict=True)]
    dx, dw, dgu, ddn, dgus, dds = fused_experts_fp8_backward_op(dout, x, gate_up_proj, down_proj, topk_idx,
                                                                topk_weights, gus, ds, ctx.block_size, needs,
                                                                weight_needs, ctx.variant)
    wg = [g if need else None for g, need in zip((dgu, ddn, dgus, dds), weight_needs, strict=True)]
    return (dx if needs[0] else None, wg[0], wg[1], None, dw if needs[1] else None, wg[2], wg[3], None, None, None,
            None)


fused_experts_fp8_op.register_autograd(_backward, setup_context=_setup)
