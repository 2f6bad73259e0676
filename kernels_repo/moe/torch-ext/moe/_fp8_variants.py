"""The variant for fp8 block-quantized expert weights per capability: kernel.toml's [dispatch_fp8].

A table of its own because fp8 tensor cores exist from sm89, so its ranges differ from the 16-bit
weights' [dispatch] (sm89: W8A16 would waste them). Read by `_variants` (the one reader of
kernel.toml, shared byte for byte with the other kernels); its schema is [dispatch]'s.
"""

from __future__ import annotations

from ._variants import auto_variant

__all__ = ["auto_variant_fp8"]


def auto_variant_fp8(capability: int | None) -> str:
    """The fp8 variant on a CUDA GPU of `capability` (None: the CPU), remembered per capability."""
    return auto_variant(capability, "dispatch_fp8")
