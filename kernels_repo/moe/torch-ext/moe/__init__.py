"""MoE kernels: routing (DeepSeek TileKernels semantics) and fused routed experts, in Triton."""

from . import layers
from .experts import VARIANTS, fused_experts, select_variant, select_variant_fp8
from .layers import (
    MoEExperts,
    MoEExpertsReference,
    MoEExpertsSm80,
    MoEExpertsSm90,
    experts_forward,
    fp8_experts_forward,
    fp8_unsupported_reason,
    unsupported_reason,
)
from .reference_experts import fused_experts_reference
from .reference_fp8 import dequantize_blocks, fused_experts_fp8_reference, quantize_blocks
from .routing import (
    aux_fi,
    expand_to_fused,
    get_fused_mapping,
    get_num_sms,
    group_count,
    inplace_unique_group_indices,
    mask_indices_by_tp,
    normalize_weight,
    reduce_fused,
    set_num_sms,
    topk_gate,
)

__all__ = [
    "VARIANTS",
    "MoEExperts",
    "MoEExpertsReference",
    "MoEExpertsSm80",
    "MoEExpertsSm90",
    "aux_fi",
    "dequantize_blocks",
    "expand_to_fused",
    "experts_forward",
    "fp8_experts_forward",
    "fp8_unsupported_reason",
    "fused_experts",
    "fused_experts_fp8_reference",
    "fused_experts_reference",
    "get_fused_mapping",
    "get_num_sms",
    "group_count",
    "inplace_unique_group_indices",
    "layers",
    "mask_indices_by_tp",
    "normalize_weight",
    "quantize_blocks",
    "reduce_fused",
    "select_variant",
    "select_variant_fp8",
    "set_num_sms",
    "topk_gate",
    "unsupported_reason",
]
