"""The autograd Function of `fused_experts` (training path of the Triton variants).

Forward saves the inputs, the pre-activation [gate | up] per aligned row (`aux`) and the routing;
backward computes only the gradients asked for, under the input device's guard.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from kernelhub.device import device_guard

from . import _experts_pipeline as pipeline
from ._experts_routing import ExpertRows
from ._experts_validate import FN


class FusedExpertsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate_up_proj, down_proj, topk_idx, topk_weights, variant, cfg):
        with device_guard(x):
            out, routing, h, aux = pipeline.forward(x, gate_up_proj, down_proj, topk_idx, topk_weights, variant,
                                                    cfg, save=True)
        # h is not saved: the down_proj gradient recomputes it from aux (saves P*I elements).
        del h
        ctx.save_for_backward(x, gate_up_proj, down_proj, topk_weights, aux, routing.rows,
                              routing.row_expert, routing.expert_start, routing.expert_count,
                              routing.token_topk_to_pos)
        ctx.meta = (variant, cfg, routing.num_rows, routing.block_m)
        return out

    @staticmethod
    @once_differentiable  # the kernels build no graph: a second derivative must fail, not read zero
    def backward(ctx, dout):
        x, gate_up_proj, down_proj, topk_weights, aux, *rt = ctx.saved_tensors
        variant, cfg, num_rows, block_m = ctx.meta
        routing = ExpertRows(*rt, num_rows=num_rows, block_m=block_m)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2],
                 ctx.needs_input_grad[4])
        if dout.device != x.device:
            raise ValueError(f"{FN}: gradient must be on {x.device} like `x`, got {dout.device}")
        with device_guard(x):
            dx, dgu, dd, dw = pipeline.backward(dout.contiguous(), x, gate_up_proj, down_proj, topk_weights,
                                                routing, aux, variant, cfg, needs)
        return dx, dgu, dd, None, dw, None, None


# Function.apply minus its Python prologue (setup_context binding, functorch checks), which
# changes nothing for this Function while no functorch transform is active (fused_experts refuses
# the Triton variants under one): the C++ apply.
apply = (super(torch.autograd.Function, FusedExpertsFunction).apply
         if hasattr(torch._C, "_FunctionBase") else FusedExpertsFunction.apply)
