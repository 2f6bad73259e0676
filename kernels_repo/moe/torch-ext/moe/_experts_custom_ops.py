"""`fused_experts` as torch ops, used only while torch.compile traces (no graph breaks).

Eager calls never go through these (the dispatcher costs microseconds a call, and the eager path
has its own replay of inference launches). Three ops: inference (`_inference_ops`: no autograd
layers); training, which also returns the saved activation [g | u] and the routing (copied into one
int32 tensor: a custom op's outputs may not alias each other); and its backward, which computes
only the gradients asked for. The config is passed as JSON ("" = the shipped buckets) and the
variant by name (resolved and checked by `fused_experts` while tracing), so that every argument has
a schema type. The op namespace carries the module name, which carries the kernel's path digest, so
two loaded versions of this kernel register distinct ops.
"""

from __future__ import annotations

import json

import torch

from kernelhub.device import device_guard

from . import _experts_eager as eager
from . import _experts_pipeline as pipeline
from ._experts_configs import shape_buckets
from ._experts_routing import ExpertRows, max_rows
from ._inference_ops import define_inference_op
from .reference_experts import reference_unchecked

_NS = "kernelhub_" + __name__.replace(".", "_")


def _bucket(x, gate_up_proj, topk_idx, variant: str, config: str) -> dict:
    E, two_i, H = gate_up_proj.shape
    return pipeline.bucket(variant, E, H, two_i // 2, topk_idx.numel(), json.loads(config) if config else None,
                       x.device, x.element_size())


def _saved_rows(x, gate_up_proj, topk_idx, variant: str, config: str):
    """P, the rows of the training op's saved activation: `max_rows` at its bucket's block_m."""
    E, two_i, H = gate_up_proj.shape
    pairs = topk_idx.numel()
    if type(pairs) is int or config or (x.device.type != "cuda" and pipeline.INTERPRET):
        return max_rows(pairs, E, _bucket(x, gate_up_proj, topk_idx, variant, config)["block_m"])
    # dynamic shapes, tiles from configs/: the bucket follows the load T*K/E, so P is one branch per
    # bucket (sym_ite) where pick_config's comparisons would guard on the load (a recompile whenever
    # a batch moved to a bucket of another block_m)
    buckets = shape_buckets(90 if variant == "sm90" else 80, E, H, two_i // 2)
    load = pairs / max(E, 1)  # as pick_config computes it, so that both pick the same bucket
    rows = max_rows(pairs, E, buckets[-1]["block_m"])
    for b in reversed(buckets):
        limit, here = b.get("max_rows_per_expert"), max_rows(pairs, E, b["block_m"])
        rows = here if limit is None else torch.sym_ite(load <= limit, here, rows)
    return rows


def _meta_sizes(P: int, E: int, pairs: int) -> list[int]:
    # rows, row_expert, expert_start, expert_count, token_topk_to_pos
    return [P, P, E, E, pairs]


def _fused_experts_infer(x, gate_up_proj, down_proj, topk_idx, topk_weights, variant: str, config: str):
    # the eager path (variant resolved while tracing), so a compiled graph replays recorded launches too
    with torch.no_grad():
        return eager.run(x, gate_up_proj, down_proj, topk_idx, topk_weights, variant,
                         json.loads(config) if config else None, False)


def _fused_experts_fake(x, gate_up_proj, down_proj, topk_idx, topk_weights, variant, config):
    return x.new_empty(x.shape)


_LIB = torch.library.Library(_NS, "FRAGMENT")  # (kept: the ops live as long as the library object)
fused_experts_op = define_inference_op(
    _LIB, "fused_experts", "(Tensor x, Tensor gate_up_proj, Tensor down_proj, Tensor topk_idx, Tensor topk_weights, "
    "str variant, str config) -> Tensor", _fused_experts_infer, _fused_experts_fake)


@torch.library.custom_op(f"{_NS}::fused_experts_train", mutates_args=())
def fused_experts_train_op(
    x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, topk_idx: torch.Tensor,
    topk_weights: torch.Tensor, variant: str, config: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, aux [P, 2I], routing meta int32); the reference variant saves nothing (empty aux and
    meta) and its backward recomputes through autograd."""
    if variant == "reference" or x.shape[0] == 0:
        with torch.no_grad():
            out = reference_unchecked(x, gate_up_proj, down_proj, topk_idx, topk_weights)
        return out, x.new_empty(0, 0), torch.empty(0, dtype=torch.int32, device=x.device)
    cfg = _bucket(x, gate_up_proj, topk_idx, variant, config)
    with torch.no_grad(), device_guard(x):
        out, routing, _, aux = pipeline.forward(x, gate_up_proj, down_proj, topk_idx, topk_weights, variant,
                                                cfg, save=True)
    meta = torch.cat([routing.rows, routing.row_expert, routing.expert_start, routing.expert_count,
                      routing.token_topk_to_pos.reshape(-1)])
    return out, aux, meta


@fused_experts_train_op.register_fake
def _(x, gate_up_proj, down_proj, topk_idx, topk_weights, variant, config):
    if variant == "reference" or x.shape[0] == 0:
        return x.new_empty(x.shape), x.new_empty(0, 0), x.new_empty(0, dtype=torch.int32)
    E, two_i, _ = gate_up_proj.shape
    P = _saved_rows(x, gate_up_proj, topk_idx, variant, config)
    return (x.new_empty(x.shape), x.new_empty(P, two_i),
            x.new_empty(sum(_meta_sizes(P, E, topk_idx.numel())), dtype=torch.int32))


@torch.library.custom_op(f"{_NS}::fused_experts_backward", mutates_args=())
def fused_experts_backward_op(
    dout: torch.Tensor, x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
    topk_idx: torch.Tensor, topk_weights: torch.Tensor, aux: torch.Tensor, meta: torch.Tensor, variant: str,
    config: str, needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, d gate_up_proj, d down_proj, d topk_weights); an empty tensor where `needs` says no."""
    if variant == "reference" or x.shape[0] == 0:
        grads = _reference_grads(dout, x, gate_up_proj, down_proj, topk_idx, topk_weights, needs)
    else:
        cfg = _bucket(x, gate_up_proj, topk_idx, variant, config)
        E = gate_up_proj.shape[0]
        P = aux.shape[0]
        rows, row_expert, start, count, pos = meta.split(_meta_sizes(P, E, topk_idx.numel()))
        routing = ExpertRows(rows, row_expert, start, count, pos.view(topk_idx.shape), P, cfg["block_m"])
        with torch.no_grad(), device_guard(x):
            grads = pipeline.backward(dout.contiguous(), x, gate_up_proj, down_proj, topk_weights, routing,
                                      aux, variant, cfg, tuple(needs))
    return tuple(g if g is not None else t.new_empty(0)
                 for g, t in zip(grads, (x, gate_up_proj, down_proj, topk_weights), strict=True))


@fused_experts_backward_op.register_fake
def _(dout, x, gate_up_proj, down_proj, topk_idx, topk_weights, aux, meta, variant, config, needs):
    return tuple(t.new_empty(t.shape) if need else t.new_empty(0)
                 for t, need in zip((x, gate_up_proj, down_proj, topk_weights), needs, strict=True))


def _reference_grads(dout, x, gate_up_proj, down_proj, topk_idx, topk_weights, needs) -> tuple:
    """The reference's gradients by torch.func.vjp: a custom op's body runs below the autograd
    dispatch key, where `torch.autograd.grad` would see no graph; functorch's transform still works."""
    tensors = (x, gate_up_proj, down_proj, topk_weights)
    wanted = [i for i, need in enumerate(needs) if need]

    def f(*args):
        full = list(tensors)
        for i, a in zip(wanted, args, strict=True):
            full[i] = a
        return reference_unchecked(full[0], full[1], full[2], topk_idx, full[3])

    if not wanted:
        return (None,) * 4
    _, vjp = torch.func.vjp(f, *(tensors[i] for i in wanted))
    # copies: with nothing routed the reference ties the inputs in by sums, and their gradients come
    # back as expanded views of one scalar, which a custom op may not return (they alias)
    found = iter(g.clone(memory_format=torch.contiguous_format) for g in vjp(dout))
    return tuple((next(found) if need else None) for need in needs)


def _setup(ctx, inputs, output) -> None:
    x, gate_up_proj, down_proj, topk_idx, topk_weights, variant, config = inputs
    _, aux, meta = output
    ctx.save_for_backward(x, gate_up_proj, down_proj, topk_idx, topk_weights, aux, meta)
    ctx.variant, ctx.config = variant, config
    ctx.mark_non_differentiable(aux, meta)


def _backward(ctx, dout, _daux, _dmeta):
    x, gate_up_proj, down_proj, topk_idx, topk_weights, aux, meta = ctx.saved_tensors
    n = ctx.needs_input_grad
    needs = [n[0], n[1], n[2], n[4]]
    grads = fused_experts_backward_op(dout, x, gate_up_proj, down_proj, topk_idx, topk_weights, aux, meta,
                                      ctx.variant, ctx.config, needs)
    dx, dgu, ddn, dw = (g if need else None for g, need in zip(grads, needs, strict=True))
    return dx, dgu, ddn, None, dw, None, None


fused_experts_train_op.register_autograd(_backward, setup_context=_setup)


@torch.compiler.assume_constant_result
def _config_json(config: dict) -> str:
    # run once while tracing (Dynamo cannot trace json.dumps); the result is a constant of the graph
    return json.dumps(config, sort_keys=True)


def compiled_fused_experts(x, gate_up_proj, down_proj, topk_idx, topk_weights, variant: str,
                           config: dict | None) -> torch.Tensor:
    """What `fused_experts` runs while torch.compile traces (variant resolved): one opaque op."""
    config_json = "" if config is None else _config_json(config)
    if torch.is_grad_enabled() and (x.requires_grad or gate_up_proj.requires_grad or down_proj.requires_grad
                                    or topk_weights.requires_grad):
        return fused_experts_train_op(x, gate_up_proj, down_proj, topk_idx, topk_weights, variant, config_json)[0]
    return fused_experts_op(x, gate_up_proj, down_proj, topk_idx, topk_weights, variant, config_json)
