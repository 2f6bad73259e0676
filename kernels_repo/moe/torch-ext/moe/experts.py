"""`fused_experts`: routed SwiGLU experts as grouped Triton GEMMs, with autograd.

The public entry point and its dispatch: while torch.compile traces, one custom op per call
(`_experts_custom_ops`); otherwise the eager path (`_experts_eager`: replay, checks, then the
reference, the autograd Function of `_experts_autograd` or the inference pipeline of
`_experts_pipeline`, whose launches live in `_experts_launch` and kernels in `_experts_kernels`).
The variant is chosen per call from the capability of x's device (`select_variant`: sm90: TMA
weight loads; sm80: pointer loads; CPU: the torch reference).
"""

from __future__ import annotations

import torch

from kernelhub.device import device_capability

from . import _experts_eager as eager
from ._experts_custom_ops import compiled_fused_experts
from ._experts_validate import FN, VARIANTS, check_config, checked_variant, needs_grad, validate_inputs
from ._fp8_validate import BLOCK, FP8, check_no_fp8_arguments
from ._fp8_variants import auto_variant_fp8
from ._variants import auto_variant

__all__ = ["fused_experts", "select_variant", "select_variant_fp8", "VARIANTS"]


def select_variant(device: torch.device) -> str:
    """The variant for `device`'s capability as kernel.toml's [dispatch] declares (CPU: the reference)."""
    return auto_variant(device_capability(device) if device.type == "cuda" else None)


def select_variant_fp8(device: torch.device) -> str:
    """The variant for fp8 block-quantized weights on `device` (kernel.toml's [dispatch_fp8]): fp8
    tensor cores ("sm90") on sm89-sm99, W8A16 ("sm80") on sm80-sm88 and Blackwell, the reference on the CPU."""
    return auto_variant_fp8(device_capability(device) if device.type == "cuda" else None)


@torch.compiler.assume_constant_result
def _traced_variant(device: torch.device) -> str:
    """`select_variant` run once while torch.compile traces (its device queries are not traced)."""
    return select_variant(device)


@torch.compiler.assume_constant_result
def _traced_variant_fp8(device: torch.device) -> str:
    return select_variant_fp8(device)


def fused_experts(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    variant: str | None = None,
    config: dict | None = None,
    check_indices: bool | None = None,
    gate_up_proj_scale_inv: torch.Tensor | None = None,
    down_proj_scale_inv: torch.Tensor | None = None,
    block_size: tuple[int, int] = BLOCK,
) -> torch.Tensor:
    """Routed SwiGLU experts: sum_k w[t,k] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])).

    gate = gate_up_proj[e, :I], up = gate_up_proj[e, I:] (transformers v5 `*Experts` layout).

    Args:
        x: [T, H], float16/bfloat16/float32 (float64: reference variant only).
        gate_up_proj: [E, 2I, H], dtype of `x`.
        down_proj: [E, H, I], dtype of `x`.
        topk_idx: [T, K], int32/int64, entries in [0, E) or -1 (dropped).
        topk_weights: [T, K], floating point.
        variant: "sm90", "sm80" or "reference"; default: by the capability of x's device (under a
            torch.func transform the reference; a Triton variant raises there).
        config: tile config (a bucket of `configs/sm*.json`); default: the bucket for this shape.
            Checked on every variant, also the reference, which does not use it.
        check_indices: raise on ids outside [-1, E). On a GPU that check is one host sync, so the
            default (None) makes it only where no sync is promised away: on the CPU and on the
            training path, not on a CUDA inference call (no gradient), which stays free of host
            synchronisation and capturable. True checks every call (skipped while capturing a CUDA
            graph or compiling), False never. Unchecked, the kernels drop such ids like -1 rather
            than read out of bounds.
        gate_up_proj_scale_inv, down_proj_scale_inv: fp8 experts (DeepSeek-V3 / transformers
            `FP8Experts` layout): with float8_e4m3fn weights, their fp32 inverse scales per block,
            [E, ceil(2I/bn), ceil(H/bk)] and [E, ceil(H/bn), ceil(I/bk)] (dequantized weight = value x
            the scale of its block; power-of-two UE8M0 scales as fp32). Variants (default by
            capability, kernel.toml [dispatch_fp8]): "sm90" fp8 tensor cores, activations quantized
            per token and 128-column group; "sm80" weights dequantized in registers (W8A16);
            "reference" torch. Gradients for x and topk_weights only (the fp8 weights are frozen).
            `config` here is a bucket of `configs/fp8_<variant>.json` (keys: `_fp8_configs.py`),
            checked on every variant as above; an sm90 bucket may choose the W8A16 math ("w8a16",
            or its "decode" kernels for a few tokens), where weight bytes bound the time.
        block_size: (bn, bk) of the weight scale blocks; the Triton variants take (128, 128).

    Returns:
        [T, H] in x.dtype on x.device; differentiable in x, both weights and topk_weights.

    Raises:
        TypeError: a non-tensor argument or unsupported dtype.
        ValueError: shapes, devices, index range, variant or config are wrong.
    """
    if check_indices is not None and type(check_indices) is not bool:  # (checked on both paths)
        raise TypeError(f"{FN}: `check_indices` must be True, False or None, got {check_indices!r}")
    # the fp8 path: scales given or fp8 weights (the 16-bit path pays these three identity checks)
    if (gate_up_proj_scale_inv is not None or down_proj_scale_inv is not None
            or getattr(gate_up_proj, "dtype", None) is FP8):
        return _fused_experts_fp8(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv,
                                  down_proj_scale_inv, block_size, variant, config, check_indices)
    if block_size is not BLOCK:
        check_no_fp8_arguments(block_size)
    # one opaque custom op per call (no graph breaks); under a torch.func transform the eager path
    # below runs (its default variant is then the reference, which the transforms trace)
    if torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active():
        validate_inputs(x, gate_up_proj, down_proj, topk_idx, topk_weights, False)
        check_config(config)  # on every variant, as the eager path does
        variant = checked_variant(x, _traced_variant(x.device) if variant is None else variant)
        return compiled_fused_experts(x, gate_up_proj, down_proj, topk_idx, topk_weights, variant, config)
    if check_indices is None:  # no sync on a CUDA inference call (DESIGN.md: capturable, no host sync)
        check_indices = not (isinstance(x, torch.Tensor) and x.is_cuda) or needs_grad(
            x, gate_up_proj, down_proj, topk_weights)
    if variant is None and torch._C._are_functorch_transforms_active():
        variant = "reference"  # (vmap, grad, ...: batched tensors have no addresses for the kernels)
    return eager.run(x, gate_up_proj, down_proj, topk_idx, topk_weights, variant, config, check_indices,
                     select_variant)


def _fused_experts_fp8(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv,
                       down_proj_scale_inv, block_size, variant, config, check_indices):
    """The fp8-weights path of `fused_experts` (imported on first use: the 16-bit path never loads it)."""
    from . import _fp8_experts

    _fp8_experts.check_config(config)
    if torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active():
        from . import _fp8_custom_ops, _fp8_validate

        bs = _fp8_validate.validate_fp8_inputs(x, gate_up_proj, down_proj, topk_idx, topk_weights,
                                               gate_up_proj_scale_inv, down_proj_scale_inv, block_size, False)
        variant = checked_variant(x, _traced_variant_fp8(x.device) if variant is None else variant)
        if variant != "reference" and bs != BLOCK:
            raise ValueError(f"{FN}: variant {variant!r} supports fp8 `block_size` {BLOCK}, got {bs}")
        grad = torch.is_grad_enabled()
        _fp8_experts.check_config(config, variant)
        weight_needs = [grad and t.requires_grad for t in (gate_up_proj, down_proj, gate_up_proj_scale_inv,
                                                           down_proj_scale_inv)]
        if not (any(weight_needs) or needs_grad(x, topk_weights)):
            return _fp8_custom_ops.fused_experts_fp8_infer_op(
                x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv, down_proj_scale_inv,
                variant, list(bs), _fp8_custom_ops.config_arg(config))
        return _fp8_custom_ops.fused_experts_fp8_op(x, gate_up_proj, down_proj, topk_idx, topk_weights,
                                                    gate_up_proj_scale_inv, down_proj_scale_inv, variant, list(bs),
                                                    weight_needs, _fp8_custom_ops.config_arg(config))
    if check_indices is None:
        check_indices = not (isinstance(x, torch.Tensor) and x.is_cuda) or needs_grad(x, topk_weights)
    return _fp8_experts.run(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv,
                            down_proj_scale_inv, block_size, variant, check_indices, select_variant_fp8, config)
