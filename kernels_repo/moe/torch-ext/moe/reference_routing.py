"""Torch references of the routing ops: the CPU path (when not interpreting) and the test oracle.

Inputs are assumed validated by `routing.py`; these functions follow TileKernels' torch
references (`tile_kernels/torch/moe.py`) and fix the order of real rows to token order.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "topk_gate_ref",
    "normalize_weight_ref",
    "group_count_ref",
    "aux_fi_ref",
    "mask_indices_by_tp_ref",
    "inplace_unique_group_indices_ref",
    "get_fused_mapping_ref",
    "expand_to_fused_ref",
    "reduce_fused_ref",
]


def topk_gate_ref(scores: Tensor, num_topk: int) -> Tensor:
    """Indices of the num_topk largest scores per row; ties go to the smaller index (stable sort)."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    return order[:, :num_topk].contiguous()


def normalize_weight_ref(topk_weights: Tensor) -> tuple[Tensor, Tensor]:
    """(1e-20 + w0 + w1 + ..., w / that), summed left to right in fp32."""
    t, k = topk_weights.shape
    denom = torch.full((t,), 1e-20, dtype=torch.float32, device=topk_weights.device)
    for j in range(k):
        denom = denom + topk_weights[:, j]
    return denom, topk_weights / denom.unsqueeze(1)


def group_count_ref(group_idx: Tensor, num_groups: int) -> Tensor:
    """int32 histogram of the entries >= 0."""
    valid = group_idx[group_idx >= 0].long()
    return torch.bincount(valid, minlength=num_groups).to(torch.int32)


def aux_fi_ref(topk_idx: Tensor, num_experts: int, num_aux_topk: int) -> Tensor:
    """count[e] * E / (T * num_aux_topk) in fp32; zeros for T == 0."""
    t = topk_idx.shape[0]
    if t == 0:
        return torch.zeros(num_experts, dtype=torch.float32, device=topk_idx.device)
    counts = group_count_ref(topk_idx, num_experts)
    return counts.float() * num_experts / (t * num_aux_topk)


def mask_indices_by_tp_ref(indices: Tensor, n: int, num_ep_ranks: int, tp_rank: int,
                           num_tp_ranks: int) -> Tensor:
    """TileKernels' rule: keep ids of this TP rank's slices, renumbered into the local range."""
    per_gpu = n // num_ep_ranks
    per_dp = num_tp_ranks * per_gpu
    value = indices.clone()
    invalid = (value < 0) | ((value // per_gpu) % num_tp_ranks != tp_rank)
    value = value - tp_rank * per_gpu
    value = value - (value // per_dp) * (per_dp - per_gpu)
    value[invalid | (value < 0)] = -1
    return value


def inplace_unique_group_indices_ref(group_indices: Tensor, num_groups: int) -> None:
    """Repeated ids in a row become -1, the first (leftmost) occurrence stays; in place."""
    del num_groups  # kept for signature parity with TileKernels
    _, k = group_indices.shape
    g = group_indices.clone()
    for j in range(1, k):
        dup = (g[:, :j] == g[:, j : j + 1]).any(dim=1) & (g[:, j] >= 0)
        group_indices[:, j] = torch.where(dup, torch.full_like(g[:, j], -1), g[:, j])


def _align(n: Tensor, alignment: int) -> Tensor:
    return (n + alignment - 1) // alignment * alignment


def get_fused_mapping_ref(topk_idx: Tensor, num_experts: int, num_pos: int, alignment: int):
    """The fused mapping for a P of `num_pos` rows (validated to be large enough), token order.

    Returns the first seven outputs of `get_fused_mapping`, all int32.
    """
    dev = topk_idx.device
    t, k = topk_idx.shape
    flat = topk_idx.reshape(-1).long()
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts)
    aligned = _align(counts, alignment)
    end = torch.cumsum(aligned, 0)
    start = end - aligned
    valid = flat >= 0
    ids = torch.nonzero(valid).flatten()  # (token, k) in token order
    experts = flat[ids]
    # Stable sort by expert keeps token order inside each expert's range.
    order = torch.sort(experts, stable=True).indices
    ids, experts = ids[order], experts[order]
    counts_before = torch.cumsum(counts, 0) - counts
    rank = torch.arange(ids.numel(), device=dev) - counts_before[experts]
    pos = start[experts] + rank
    pos_to_expert = torch.full((num_pos,), -1, dtype=torch.int32, device=dev)
    pos_to_token = torch.full_like(pos_to_expert, -1)
    pos_to_token_topk = torch.full_like(pos_to_expert, -1)
    token_topk_to_pos = torch.full((t * k,), -1, dtype=torch.int32, device=dev)
    pos_to_expert[pos] = experts.to(torch.int32)
    pos_to_token[pos] = (ids // max(k, 1)).to(torch.int32)
    pos_to_token_topk[pos] = ids.to(torch.int32)
    token_topk_to_pos[ids] = pos.to(torch.int32)
    return (pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos.view(t, k),
            start.to(torch.int32), end.to(torch.int32), aligned.to(torch.int32))


def expand_to_fused_ref(x: Tensor, token_topk_to_pos: Tensor, num_pos: int) -> Tensor:
    """Row t of x copied to every position token_topk_to_pos[t, :] >= 0; other rows zero."""
    out = torch.zeros((num_pos, x.shape[1]), dtype=x.dtype, device=x.device)
    t_idx, k_idx = torch.nonzero(token_topk_to_pos >= 0, as_tuple=True)
    out[token_topk_to_pos[t_idx, k_idx].long()] = x[t_idx]
    return out


def reduce_fused_ref(x: Tensor, topk_weights: Tensor | None, token_topk_to_pos: Tensor,
                     acc_dtype: torch.dtype = torch.float32) -> Tensor:
    """sum_k w[t, k] * x[pos[t, k]] in `acc_dtype` (k order), slots with pos -1 skipped.

    A skipped slot's weight and the row it would read are selected away, never multiplied by 0: a
    NaN/inf weight there changes neither the result nor, through autograd, any gradient.
    """
    t, k = token_topk_to_pos.shape
    acc = torch.zeros((t, x.shape[1]), dtype=acc_dtype, device=x.device)
    if x.shape[0] == 0:  # every position -1 (checked by the caller): nothing to gather
        return acc
    zero = torch.zeros((), dtype=acc_dtype, device=x.device)
    for j in range(k):
        pos = token_topk_to_pos[:, j].long()
        valid = pos >= 0
        rows = x[pos.clamp(min=0)].to(acc_dtype)
        if topk_weights is not None:
            # (where() alone would still send 0 * w back to the gathered row of x)
            rows = rows * torch.where(valid, topk_weights[:, j].to(acc_dtype), zero).unsqueeze(1)
        acc += torch.where(valid.unsqueeze(1), rows, zero)
    return acc
