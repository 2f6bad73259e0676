"""Choosing and launching a variant on the input's own device.

The variant is chosen per call from the capability of the input's device index, as kernel.toml's
`[dispatch]` declares (`_variants.auto_variant`, the table kernelhub's default mapping is built from);
CPU tensors run the Triton kernels under TRITON_INTERPRET=1 (tests) and the torch reference otherwise.
Launches run with the input's device current, so on its current stream.
"""

from __future__ import annotations

import os

import torch

from kernelhub.device import CachedLaunch, cuda_properties, device_cache, device_guard

from . import _sm80, _sm90
from ._variants import auto_variant

IMPLS = ("sm90", "sm80", "reference")
# What `impl=None` runs on capability 90: kernel.toml says (docs/performance.md says why);
# impl="sm90" (or layer SwiGLUMLPSm90) forces the persistent kernels whatever it says.
_AUTO_SM90 = auto_variant(90)
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
        self._collapsed: dict[tuple, tuple | None] = {}
        self.fwd = CachedLaunch(module.fwd_kernel, **module.OPTIONS)
        self.bwd = CachedLaunch(module.bwd_kernel, **module.OPTIONS)

    def config(self, M: int, N: int, elem_bytes: int, sm_count: int,
               backward: bool) -> tuple[int, int, int, int]:
        """(BLOCK_M, BLOCK_N, num_warps, grid) from the generation's tile rule."""
        return self._config(M, N, elem_bytes, sm_count, backward)

    def plan(self, M: int, N: int, elem_bytes: int, sm_count: int, backward: bool,
             packed: bool) -> tuple[tuple[int], tuple, int]:
        """(grid, constexprs, num_warps) of a launch, cached: an eager call pays one dict lookup."""
        key = (M, N, elem_bytes, sm_count, backward, packed)
        plan = self._configs.get(key)
        if plan is None:
            if len(self._configs) >= _MAX_CONFIGS:
                self._configs.clear()
            block_m, block_n, num_warps, grid = self._config(M, N, elem_bytes, sm_count, backward)
            plan = self._configs[key] = ((grid,), (block_m, block_n, N % block_n == 0, packed), num_warps)
        return plan

    def collapse(self, backward: bool, packed: bool, N: int, shape: torch.Size,
                 tensors: tuple[torch.Tensor, ...]) -> tuple[int, ...] | str | None:
        """The ints of a launch over [..., N] tensors with leading batch dims, seen as [M, N] rows
        without a copy; None where no single row stride spans them, `_COPY` where an input's column
        offsets need 64 bits. Cached by shape and strides: a model's MLP calls with [batch, seq, I]
        tensors, where the collapse costs ~10 us of Python."""
        strides = tuple([t.stride() for t in tensors])
        key = (backward, packed, N, shape, strides)
        hit = self._collapsed.get(key, False)
        if hit is not False:
            return hit
        rows = None if _wide_columns(strides, backward, packed, N) else [_rows(shape, st) for st in strides]
        if rows is None:
            ints = _COPY
        elif None in rows:
            ints = None
        else:
            rs = [r[1] for r in rows]
            # forward: (gate, up, out); backward: (dy, gate, up, d gate, d up), the gradients ours
            ints = (rows[0][0], N, rs[0], strides[0][-1], rs[1], strides[1][-1], rs[2])
            if backward:
                ints += (strides[2][-1], rs[3], rs[4])
        if len(self._collapsed) >= _MAX_CONFIGS:
            self._collapsed.clear()
        self._collapsed[key] = ints
        return ints

    def __repr__(self) -> str:
        return f"<swiglu variant {self.name}>"


# ROCm reports capabilities like 94 but takes none of the sm90 options: the generic path there.
_VARIANTS = {"sm90": _Variant("sm90", _sm90), "sm80": _Variant("sm80", _sm80)}
if torch.version.hip is not None:
    _VARIANTS["sm90"] = _VARIANTS["sm80"]


# impl=None targets per CUDA device index: one dict lookup per eager call
_AUTO_TARGETS: dict[int, tuple] = device_cache()
_CPU_TARGET = (_VARIANTS["sm80"], -1, _INTERPRETER_SM_COUNT)


def _resolve(fn: str, x: torch.Tensor, impl: str | None) -> tuple[_Variant, int, int] | None:
    """(variant, device index, SM count) for x's device; None means the torch reference."""
    if impl is None:
        variant = None
    elif impl == "reference":
        return None
    else:
        variant = _forced(fn, x, impl)
    if x.is_cuda:
        index = x.get_device()
        if variant is not None:
            return variant, index, cuda_properties(index).sm_count
        target = _AUTO_TARGETS.get(index)
        if target is None:
            props = cuda_properties(index)
            target = _AUTO_TARGETS[index] = _auto_target(index, props.capability, props.sm_count)
        return target or None
    if not _INTERPRET or not x.is_cpu:  # other device types (meta, mps, ...): torch ops
        return None
    return _CPU_TARGET if variant is None else (variant, -1, _INTERPRETER_SM_COUNT)


def _auto_target(index: int, capability: int, sm_count: int) -> tuple:
    """What impl=None runs on a GPU of `capability`: kernel.toml's variant (an empty tuple: the reference)."""
    name = auto_variant(capability)
    if name == "reference":
        return ()
    if name not in _VARIANTS:
        raise ValueError(f"swiglu: kernel.toml's [dispatch] names variant {name!r} for capability "
                         f"{capability}; this package has {IMPLS}")
    return (_VARIANTS[name], index, sm_count)


def _forced(fn: str, x: torch.Tensor, impl: object) -> _Variant:
    variant = _VARIANTS.get(impl) if isinstance(impl, str) else None
    if variant is None:
        raise ValueError(f"{fn}: `impl` must be one of {IMPLS} or None, got {impl!r}")
    if not x.is_cuda and not (_INTERPRET and x.device.type == "cpu"):
        raise ValueError(
            f"{fn}: `impl` {impl!r} needs a CUDA tensor (or a CPU one with TRITON_INTERPRET=1), got {x.device}"
        )
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


_COPY = "copy"
_INT32_MAX = 2**31 - 1


def _wide_columns(strides: tuple, backward: bool, packed: bool, N: int) -> bool:
    """Whether an input's largest column offset (column * last stride; packed: up starts N columns
    in) overflows the kernels' 32-bit column arithmetic (rows are 64-bit): a transposed view of a
    tensor of more than 2**31 elements. The outputs are contiguous."""
    span = 2 * N if packed else N
    return any((span - 1) * st[-1] > _INT32_MAX for st in strides[:3 if backward else 2])


def _contiguous_inputs(backward: bool, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The launch's inputs as contiguous copies (one per distinct tensor), its outputs as they are."""
    n = 3 if backward else 2
    copies: dict[int, torch.Tensor] = {}
    return tuple(copies.setdefault(id(t), t.contiguous()) if i < n else t for i, t in enumerate(tensors))


def _launch(target: tuple[_Variant, int, int], backward: bool, packed: bool, N: int,
            tensors: tuple[torch.Tensor, ...]) -> None:
    """Launch over [..., N] tensors (inputs then outputs) viewed as rows; loop where no view exists.

    Packed: the up (and d up) tensor is the packed [..., 2N] one, offset N columns in the kernel.
    """
    variant, device_index, sm_count = target
    shape = tensors[-1].shape
    if len(shape) == 2:  # the common case, without the general collapse below
        M = shape[0]
        s0, s1, s2 = tensors[0].stride(), tensors[1].stride(), tensors[2].stride()
        if (s0[1] != 1 or s1[1] != 1 or s2[1] != 1) and _wide_columns((s0, s1, s2), backward, packed, N):
            _launch(target, backward, packed, N, _contiguous_inputs(backward, tensors))
            return
        if backward:  # (dy, gate, up, d gate, d up); the gradients are ours, contiguous
            ints = (M, N, s0[0], s0[1], s1[0], s1[1], s2[0], s2[1], tensors[3].stride(0),
                    tensors[4].stride(0))
        else:  # (gate, up, out); out is contiguous (ours, or checked)
            ints = (M, N, s0[0], s0[1], s1[0], s1[1], s2[0])
    else:
        ints = variant.collapse(backward, packed, N, shape, tensors)
        if ints is _COPY:
            _launch(target, backward, packed, N, _contiguous_inputs(backward, tensors))
            return
        if ints is None:
            # leading dims that no single row stride spans (rare): one launch per outer index
            for i in range(shape[0]):
                _launch(target, backward, packed, N, tuple(t[i] for t in tensors))
            return
        M = ints[0]
    grid, constexprs, num_warps = variant.plan(M, N, tensors[0].element_size(), sm_count, backward, packed)
    (variant.bwd if backward else variant.fwd).split(grid, device_index, tensors, ints, constexprs,
                                                     num_warps=num_warps)


def _run(target: tuple[_Variant, int, int], backward: bool, packed: bool, N: int,
         tensors: tuple[torch.Tensor, ...]) -> None:
    """Launch with the tensors' device current (so on its current stream); restore the caller's."""
    if tensors[-1].numel() == 0:
        return
    with device_guard(tensors[0]):  # a reused no-op where the device is current already
        _launch(target, backward, packed, N, tensors)


def _empty(like: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of like's shape, dtype and device (empty_like parses ~1.5 us faster
    than torch.empty(shape, dtype=, device=), and ~1 us faster again without a memory_format
    where `like` is contiguous already, which it then keeps)."""
    if like.is_contiguous():
        return torch.empty_like(like)
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
