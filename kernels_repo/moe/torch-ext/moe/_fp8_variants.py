"""The variant for fp8 block-quantized expert weights per capability: the table kernel.toml's
MoEExpertsFP8 classes name (`dispatch = "dispatch_fp8"`).

A table of its own because fp8 tensor cores exist from sm89, so its ranges differ from the 16-bit
weights' [dispatch] (sm89: W8A16 would waste them). Read by `_variants` (the one reader of
kernel.toml, shared byte for byte with the other kernels); its schema is [dispatch]'s. The table's
name is data too: this reads the one the layer names, as kernelhub's default mapping does.
"""

from __future__ import annotations

import functools

from ._variants import auto_variant, layer_table

__all__ = ["auto_variant_fp8"]

LAYER = "MoEExpertsFP8"


@functools.cache  # the package's declarations: read once, not per fused_experts call
def _table_name() -> str:
    return layer_table(LAYER)


def auto_variant_fp8(capability: int | None) -> str:
    """The fp8 variant on a CUDA GPU of `capability` (None: the CPU), remembered per capability."""
    return auto_variant(capability, _table_name())
