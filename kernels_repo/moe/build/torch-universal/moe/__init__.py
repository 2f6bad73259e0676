"""MoE kernels: fused routed experts (this helper's part; routing is merged in by the lead)."""

from . import layers
from .experts import VARIANTS, fused_experts, select_variant
from .layers import (
    MoEExperts,
    MoEExpertsReference,
    MoEExpertsSm80,
    MoEExpertsSm90,
    experts_forward,
    unsupported_reason,
)
from .reference_experts import fused_experts_reference

__all__ = [
    "fused_experts",
    "fused_experts_reference",
    "select_variant",
    "VARIANTS",
    "layers",
    "MoEExperts",
    "MoEExpertsSm90",
    "MoEExpertsSm80",
    "MoEExpertsReference",
    "experts_forward",
    "unsupported_reason",
]
