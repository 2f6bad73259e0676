"""MoE kernels: routing (this file's names from `routing`) and fused experts (merged by the lead)."""

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
    "aux_fi",
    "expand_to_fused",
    "get_fused_mapping",
    "get_num_sms",
    "group_count",
    "inplace_unique_group_indices",
    "mask_indices_by_tp",
    "normalize_weight",
    "reduce_fused",
    "set_num_sms",
    "topk_gate",
]
