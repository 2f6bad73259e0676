"""Argument checks of `fused_experts` on float8_e4m3fn expert weights with 128x128 block scales.

The layout of DeepSeek-V3 checkpoints and transformers' `FP8Experts`: weight [E, N, K] in
float8_e4m3fn, `*_scale_inv` [E, ceil(N/bn), ceil(K/bk)] fp32 (dequantized weight = value x the
scale_inv of its block). Every check raises a TypeError/ValueError naming `fused_experts` and the
argument before a kernel sees the input.
"""

from __future__ import annotations

import torch

from ._experts_validate import FN, validate_inputs

FP8 = torch.float8_e4m3fn
BLOCK = (128, 128)  # the block size the Triton kernels support (every published checkpoint's)
# scale dtypes: fp32, or UE8M0 powers of two as transformers stores them (scale_fmt="ue8m0")
SCALE_DTYPES = (torch.float32,) + ((torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ())


def check_block_size(block_size: object, fn: str = FN) -> tuple[int, int]:
    if (not isinstance(block_size, (tuple, list)) or len(block_size) != 2
            or not all(type(b) is int and b > 0 for b in block_size)):
        raise ValueError(f"{fn}: `block_size` must be two positive ints (rows, columns), got {block_size!r}")
    return int(block_size[0]), int(block_size[1])


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def validate_fp8_inputs(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv,
                        down_proj_scale_inv, block_size, check_indices: bool, fn: str = FN) -> tuple[int, int]:
    """The checks of `validate_inputs` with fp8 weights, plus the scales and `block_size`;
    returns the block size as (rows, columns)."""
    for name, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if isinstance(w, torch.Tensor) and w.dtype is not FP8:
            raise TypeError(f"{fn}: `{name}` must be float8_e4m3fn when block scales are given (fp8 experts), "
                            f"got {w.dtype}")
    validate_inputs(x, gate_up_proj, down_proj, topk_idx, topk_weights, check_indices, fn=fn, weight_dtype=FP8)
    bn, bk = check_block_size(block_size, fn)
    E, two_i, H = gate_up_proj.shape
    inter = two_i // 2
    for name, s, rows, cols in (("gate_up_proj_scale_inv", gate_up_proj_scale_inv, two_i, H),
                                ("down_proj_scale_inv", down_proj_scale_inv, H, inter)):
        weight = name.removesuffix("_scale_inv")
        if s is None:
            raise ValueError(f"{fn}: float8_e4m3fn `{weight}` needs `{name}` (its fp32 block scales)")
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"{fn}: `{name}` must be a torch.Tensor, got {type(s).__name__}")
        if s.device != x.device:
            raise ValueError(f"{fn}: `{name}` must be on {x.device} like `x`, got {s.device}")
        if s.dtype not in SCALE_DTYPES:
            raise TypeError(f"{fn}: `{name}` must be float32 (or float8_e8m0fnu: power-of-two UE8M0 scales), "
                            f"got {s.dtype}")
        want = (E, _cdiv(rows, bn), _cdiv(cols, bk))
        if tuple(s.shape) != want:
            raise ValueError(f"{fn}: `{name}` must be [E, ceil({rows}/{bn}), ceil({cols}/{bk})] = {list(want)} "
                             f"for block_size {(bn, bk)}, got {list(s.shape)}")
    return bn, bk


WEIGHT_NAMES = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")


def refuse_weight_gradients(needs: tuple[bool, bool, bool, bool]) -> None:
    """In backward: autograd asks for the gradient of an fp8 weight or scale (a leaf that requires
    grad, e.g. transformers' FP8Experts parameters left trainable); they are frozen here."""
    asked = [name for name, need in zip(WEIGHT_NAMES, needs, strict=True) if need]
    if asked:
        raise ValueError(f"{FN}: gradients for float8 expert weights are not supported ({', '.join(asked)} "
                         "require grad); the fp8 weights are frozen, gradients flow to `x` and `topk_weights`: "
                         "call requires_grad_(False) on them")


def check_no_fp8_arguments(block_size, fn: str = FN) -> None:
    """A block size given with weights that are not fp8: an error, not silently ignored (given
    scales take the fp8 path, whose checks then reject the weights' dtype)."""
    if block_size is not BLOCK and tuple(check_block_size(block_size, fn)) != BLOCK:
        raise ValueError(f"{fn}: `block_size` applies to float8_e4m3fn weights only, got {block_size!r} "
                         "with weights that are not fp8")
