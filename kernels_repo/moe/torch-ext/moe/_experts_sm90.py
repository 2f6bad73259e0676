"""sm90 (Hopper) specifics of `fused_experts`: expert weights through TMA tensor descriptors.

The kernels are those of `_experts_kernels.py` with `B_TMA=True`: the weight tile of each K step is
one TMA copy described by a host-side `TensorDescriptor` over the 3-D weight [E, N, K] (or [E, K, N]),
so no `triton.set_allocator` scratch is needed (only in-kernel `tl.make_tensor_descriptor` needs one:
`set_allocator` stores it in a ContextVar in triton 3.6 and 3.7, so a kernel library setting it would
override the caller's allocator, and a new thread would not see it).
Out-of-box rows and columns of a 3-D descriptor read as zero, which is what the masked pointer
loads of sm80 do, so both paths compute the same tiles. TMA needs 16-byte aligned base and strides;
weights that are not fall back to pointer loads (`tma_ok`).
"""

from __future__ import annotations

import torch

try:  # triton >= 3.4 (3.6 on the GPU image, 3.7 in CI)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: sm90 runs the pointer path
    TensorDescriptor = None


def tma_ok(weight: torch.Tensor) -> bool:
    """TMA constraints: no empty dim, last dim contiguous, base and other strides 16-byte aligned and
    nonzero (an expanded view, stride 0, or a zero-size dim, e.g. H = 0, is no tensor map: the
    pointer path reads it, looping over nothing)."""
    if TensorDescriptor is None or weight.dim() < 2 or weight.stride(-1) != 1 or weight.numel() == 0:
        return False
    size = weight.element_size()
    if weight.data_ptr() % 16:
        return False
    return all(s > 0 and (s * size) % 16 == 0 for s in weight.stride()[:-1])


def weight_descriptor(weight: torch.Tensor, block_rows: int, block_cols: int):
    """Descriptor over weight [E, R, C] loading [1, block_rows, block_cols] boxes."""
    return TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [1, block_rows, block_cols])


def rows_descriptor(t: torch.Tensor, block_rows: int, block_cols: int):
    """Descriptor over a 2-D row buffer [P, C] loading [block_rows, block_cols] boxes."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [block_rows, block_cols])
