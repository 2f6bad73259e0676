"""Argument checks of `fused_experts`: types, devices, shapes, ids, variant and tile config.

Every check raises a TypeError/ValueError naming `fused_experts` and the argument, before any
kernel sees the input (a bad shape must not surface as a Triton or reshape error).
"""

from __future__ import annotations

import os

import torch

from kernelhub.device import device_guard

from ._experts_configs import check_bucket

FN = "fused_experts"
VARIANTS = ("sm90", "sm80", "reference")
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Read once, like Triton itself (which decides interpretation when a @jit function is defined).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Offsets within one row of x / one expert of a weight are 32-bit in the kernels.
INNER_OFFSET_MAX = 2**31 - 1


def validate_inputs(x, gate_up_proj, down_proj, topk_idx, topk_weights, check_indices: bool, fn: str = FN,
                    weight_dtype: torch.dtype | None = None) -> None:
    """Types, devices, dtypes and shapes of the five tensors; the ids' range if `check_indices`.
    `fn`: the function named in the errors (`fused_experts_reference` checks the same way);
    `weight_dtype`: the weights' dtype if not x's (float8_e4m3fn experts)."""
    named = (("x", x), ("gate_up_proj", gate_up_proj), ("down_proj", down_proj), ("topk_idx", topk_idx),
             ("topk_weights", topk_weights))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    dev = x.device
    for name, t in named[1:]:
        if t.device != dev:
            raise ValueError(f"{fn}: `{name}` must be on {dev} like `x`, got {t.device}")
    if dev.type == "meta":  # routing reads the ids: there is no data to route
        raise ValueError(f"{fn}: `x` and the other tensors must hold data, got device {dev}")
    if x.dtype not in (*TRITON_DTYPES, torch.float64):
        raise TypeError(f"{fn}: `x` must be float16/bfloat16/float32/float64, got {x.dtype}")
    for name, t in named[1:3]:
        if weight_dtype is not None:
            if t.dtype != weight_dtype:
                raise TypeError(f"{fn}: `{name}` must be {weight_dtype}, got {t.dtype}")
        elif t.dtype != x.dtype:
            raise TypeError(f"{fn}: `{name}` must have the dtype of `x` ({x.dtype}), got {t.dtype}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{fn}: `topk_idx` must be int32 or int64, got {topk_idx.dtype}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"{fn}: `topk_weights` must be floating point, got {topk_weights.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{fn}: `x` must be [T, H], got shape {tuple(x.shape)}")
    T, H = x.shape
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[2] != H or gate_up_proj.shape[1] % 2:
        raise ValueError(
            f"{fn}: `gate_up_proj` must be [E, 2I, H={H}], got shape {tuple(gate_up_proj.shape)}"
        )
    E, two_i = gate_up_proj.shape[:2]
    if E == 0 or two_i == 0:
        raise ValueError(
            f"{fn}: `gate_up_proj` needs E >= 1 and I >= 1, got shape {tuple(gate_up_proj.shape)}"
        )
    if tuple(down_proj.shape) != (E, H, two_i // 2):
        raise ValueError(
            f"{fn}: `down_proj` must be [E={E}, H={H}, I={two_i // 2}], got {tuple(down_proj.shape)}"
        )
    if topk_idx.dim() != 2 or topk_idx.shape[0] != T or topk_idx.shape[1] == 0:
        raise ValueError(f"{fn}: `topk_idx` must be [T={T}, K>=1], got shape {tuple(topk_idx.shape)}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"{fn}: `topk_weights` must have the shape of `topk_idx` {tuple(topk_idx.shape)}, "
            f"got {tuple(topk_weights.shape)}"
        )
    if check_indices:
        check_ids(x, topk_idx, E, fn)


def check_config(config: object) -> None:
    """A pinned tile `config` is checked on every variant, also where it is not used (the
    reference), so a bad one fails on the CPU as it would on the GPU."""
    if config is not None:
        check_bucket(config, f"{FN}: `config`")


def checked_variant(x: torch.Tensor, variant: object) -> str:
    """`variant` if x can run it (a Triton variant: CUDA, or the CPU under the interpreter; 16/32-bit)."""
    if variant not in VARIANTS:
        raise ValueError(f"{FN}: `variant` must be one of {VARIANTS}, got {variant!r}")
    if variant == "reference":
        return variant
    dev = x.device
    if not (dev.type == "cuda" or (dev.type == "cpu" and INTERPRET)):
        raise ValueError(f"{FN}: variant {variant!r} needs a CUDA tensor (or a CPU one with "
                         f"TRITON_INTERPRET=1), `x` is on {dev}")
    if x.dtype not in TRITON_DTYPES:
        raise TypeError(f"{FN}: variant {variant!r} supports float16/bfloat16/float32 `x`, got {x.dtype}")
    return variant


def inner_offset(t: torch.Tensor) -> int:
    """The largest element offset within one row of x / one expert of a weight (every dim but the
    first), which the kernels compute in 32 bits; the first dim's offsets are 64-bit."""
    return sum((n - 1) * s for n, s in zip(t.shape[1:], t.stride()[1:], strict=True))


def inner_offset_too_large(t: torch.Tensor) -> bool:
    return inner_offset(t) > INNER_OFFSET_MAX


def check_ids(x: torch.Tensor, topk_idx: torch.Tensor, E: int, fn: str = FN) -> None:
    if topk_idx.numel() and not capturing(x):
        # One host sync; skipped while capturing a CUDA graph (the kernels drop ids outside [0, E)
        # instead of reading out of bounds, so skipping it is safe, only silent).
        bad = (topk_idx < -1) | (topk_idx >= E)
        if bool(bad.any()):
            value = int(topk_idx[bad][0])
            raise ValueError(f"{fn}: `topk_idx` entries must be in [-1, {E}), got {value}")


def needs_grad(*tensors: object) -> bool:
    """Whether this call records a graph (the training path); non-tensors (rejected later) do not."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def capturing(x: torch.Tensor) -> bool:
    """Whether x's device's current stream is capturing a CUDA graph (asked with x's device current:
    torch answers for the current device only)."""
    if torch.compiler.is_compiling():
        return True
    if x.device.type != "cuda":
        return False
    with device_guard(x):
        return torch.cuda.is_current_stream_capturing()
