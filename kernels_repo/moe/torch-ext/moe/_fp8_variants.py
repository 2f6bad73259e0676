"""The variant for fp8 block-quantized expert weights per capability: kernel.toml's [dispatch_fp8].

A table of its own because fp8 tensor cores exist from sm89, so its ranges differ from the 16-bit
weights' [dispatch] (sm89: W8A16 would waste them). Read through `_variants` (the one parser of
kernel.toml, shared byte for byte with the other kernels); its schema is [dispatch]'s.
"""

from __future__ import annotations

from ._variants import _table, kernel_toml

__all__ = ["auto_variant_fp8"]

_chosen: dict[int | None, str] = {}


def auto_variant_fp8(capability: int | None) -> str:
    """The fp8 variant on a CUDA GPU of `capability` (None: the CPU), remembered per capability."""
    hit = _chosen.get(capability)
    if hit is None:
        hit = _chosen[capability] = _lookup(capability)
    return hit


def _lookup(capability: int | None) -> str:
    table = _table().get("dispatch_fp8")
    if not isinstance(table, dict):
        raise ValueError(f"{kernel_toml()}: needs a [dispatch_fp8] table (the variants for fp8 expert weights)")
    key = "cpu"
    if capability is not None:
        for entry in table.get("cuda", ()):
            low, high = entry["capability"]
            if low <= capability <= high:
                return entry["variant"]
        key = "other_cuda"
    if not isinstance(table.get(key), str):
        where = "the CPU" if capability is None else f"capability {capability}"
        raise ValueError(f"{kernel_toml()}: [dispatch_fp8] needs `{key}` (the variant for {where})")
    return table[key]
