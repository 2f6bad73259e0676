"""Private, sync-free alignment of (token, k) pairs to experts for `fused_experts`.

Narrow on purpose: `fused_experts` needs only the `ExpertRows` below, so the public
`get_fused_mapping` of `routing.py` can replace `align_rows` later if it is faster.
Only torch ops with static output shapes are used (sort, scatter, cumsum, searchsorted), so no
host synchronisation happens and the whole thing can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class ExpertRows(NamedTuple):
    """Expert-major buffer of P rows; expert e owns rows [start[e], start[e] + align(count[e]))."""

    rows: torch.Tensor  # int32 [P]: flat index t*K+k of the pair held by each row, -1 on padding rows
    block_expert: torch.Tensor  # int32 [P // block_m]: expert of each block of rows, -1 past the end
    expert_start: torch.Tensor  # int32 [E]: first row of each expert (multiple of block_m)
    expert_count: torch.Tensor  # int32 [E]: real (unpadded) rows of each expert
    token_topk_to_pos: torch.Tensor  # int32 [T, K]: row of pair (t, k), -1 where the id is dropped
    num_rows: int  # P, a static upper bound: no host sync needed to size the buffers
    block_m: int


def max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the aligned rows: each expert pads < block_m rows, a pair costs <= block_m."""
    bound = min(num_pairs * block_m, num_pairs + num_experts * (block_m - 1))
    return max(block_m, -(-bound // block_m) * block_m)


def align_rows(topk_idx: torch.Tensor, num_experts: int, block_m: int) -> ExpertRows:
    """Group the T*K pairs by expert (stable: token order within an expert), padded to block_m.

    Ids outside [0, num_experts) (-1, or the EP sentinel >= E of transformers) are dropped: they get
    no row and `token_topk_to_pos` -1, so no kernel reads out of bounds whatever the ids are.
    """
    device = topk_idx.device
    T, K = topk_idx.shape
    n = T * K
    E = num_experts
    P = max_rows(n, E, block_m)
    flat = topk_idx.reshape(-1).to(torch.int64)
    key = torch.where((flat >= 0) & (flat < E), flat, torch.full_like(flat, E))
    counts = torch.zeros(E + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    aligned = (counts[:E] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(aligned, 0)
    starts = ends - aligned
    sorted_key, order = torch.sort(key, stable=True)
    first = torch.cumsum(counts, 0) - counts  # first sorted index of each key
    rank = torch.arange(n, device=device) - first[sorted_key]
    starts_ext = torch.cat([starts, starts.new_zeros(1)])
    pos_sorted = torch.where(sorted_key < E, starts_ext[sorted_key] + rank, torch.full_like(rank, -1))
    token_topk_to_pos = torch.empty(n, dtype=torch.int64, device=device)
    token_topk_to_pos.scatter_(0, order, pos_sorted)
    rows = torch.full((P + 1,), -1, dtype=torch.int64, device=device)
    rows.scatter_(0, torch.where(pos_sorted >= 0, pos_sorted, torch.full_like(pos_sorted, P)), order)
    block_first_row = torch.arange(0, P, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_first_row, right=True)
    block_expert = torch.where(block_expert < E, block_expert, torch.full_like(block_expert, -1))
    return ExpertRows(
        rows=rows[:P].to(torch.int32),
        block_expert=block_expert.to(torch.int32),
        expert_start=starts.to(torch.int32),
        expert_count=counts[:E].to(torch.int32),
        token_topk_to_pos=token_topk_to_pos.view(T, K).to(torch.int32),
        num_rows=P,
        block_m=block_m,
    )


def sorted_weights(routing: ExpertRows, topk_weights: torch.Tensor) -> torch.Tensor:
    """fp32 [P]: the routing weight of each row, 0 on padding rows."""
    flat_w = topk_weights.reshape(-1).to(torch.float32)
    rows = routing.rows.to(torch.int64)
    return torch.where(rows >= 0, flat_w[rows.clamp(min=0)], flat_w.new_zeros(()))
