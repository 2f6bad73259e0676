"""Private, sync-free alignment of (token, k) pairs to experts for `fused_experts`.

`fused_experts` needs only the `ExpertRows` below. Decode-sized batches are aligned by one
Triton program; larger ones by the public `get_fused_mapping` of `routing.py` with an explicit
row count. Neither synchronises with the host, so the whole thing can be captured in a CUDA graph.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .routing import get_fused_mapping, group_count

# Up to this many (token, k) pairs one Triton program aligns them in one launch (decode: T<=64,
# K<=8) instead of ~15 torch ops, whose launches would cost more than the expert GEMMs there.
SMALL_PAIRS = 512
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


class ExpertRows(NamedTuple):
    """Expert-major buffer of P rows; expert e owns rows [start[e], start[e] + align(count[e]))."""

    rows: torch.Tensor  # int32 [P]: flat index t*K+k of the pair held by each row, -1 on padding rows
    block_expert: torch.Tensor  # int32 [P // block_m]: expert of each block of rows, -1 past the end
    expert_start: torch.Tensor  # int32 [E]: first row of each expert (multiple of block_m)
    expert_count: torch.Tensor  # int32 [E]: real (unpadded) rows of each expert
    token_topk_to_pos: torch.Tensor  # int32 [T, K]: row of pair (t, k), -1 where the id is dropped
    num_rows: int  # P, a static upper bound: no host sync needed to size the buffers
    block_m: int


def _cdiv(a: int, b: int) -> int:
    # Plain ints: `triton.cdiv` is a jit function, ~5 us per host call through its dispatcher.
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the aligned rows: each expert pads < block_m rows, a pair costs <= block_m."""
    bound = min(num_pairs * block_m, num_pairs + num_experts * (block_m - 1))
    return max(block_m, -(-bound // block_m) * block_m)


@triton.jit
def _align_small_kernel(
    idx_ptr, rows_ptr, block_expert_ptr, start_ptr, count_ptr, pos_ptr,
    n, E, P, NUM_BLOCKS,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """One program: histogram, aligned exclusive cumsum, stable rank, scatter. Same as align_rows."""
    offs = tl.arange(0, BLOCK_N)
    in_range = offs < n
    key = tl.load(idx_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    valid = in_range & (key >= 0) & (key < E)
    key = tl.where(valid, key, E)  # dropped and out-of-range pairs: bin E (< BLOCK_E), ignored
    counts = tl.histogram(key, BLOCK_E)
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.where(offs_e < E, counts, 0)
    aligned = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(aligned, 0) - aligned
    tl.store(start_ptr + offs_e, starts, mask=offs_e < E)
    tl.store(count_ptr + offs_e, counts, mask=offs_e < E)
    for p0 in range(0, P, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        tl.store(rows_ptr + offs_p, tl.full((BLOCK_P,), -1, tl.int32), mask=offs_p < P)
        tl.store(block_expert_ptr + offs_p, tl.full((BLOCK_P,), -1, tl.int32), mask=offs_p < NUM_BLOCKS)
    tl.debug_barrier()  # the fills and `starts` above are read/overwritten below by other threads
    rank = tl.zeros((BLOCK_N,), dtype=tl.int32)
    for j0 in range(0, BLOCK_N, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        kj = tl.load(idx_ptr + offs_j, mask=offs_j < n, other=-1).to(tl.int32)
        earlier = (key[:, None] == kj[None, :]) & (offs_j[None, :] < offs[:, None])
        rank += tl.sum(earlier.to(tl.int32), axis=1)
    start = tl.load(start_ptr + key, mask=valid, other=0)
    pos = tl.where(valid, start + rank, -1)
    tl.store(pos_ptr + offs, pos, mask=in_range)
    tl.store(rows_ptr + pos, offs, mask=valid)
    # Every aligned block of an expert holds >= 1 real row, so scattering the expert id from each
    # pair's row labels every used block.
    tl.store(block_expert_ptr + pos // BLOCK_M, key, mask=valid)


def _align_small(topk_idx: torch.Tensor, num_experts: int, block_m: int) -> ExpertRows:
    T, K = topk_idx.shape
    n = T * K
    E = num_experts
    P = max_rows(n, E, block_m)
    nb = P // block_m
    buf = torch.empty(P + nb + 2 * E + n, dtype=torch.int32, device=topk_idx.device)
    rows, block_expert = buf[:P], buf[P:P + nb]
    start, count, pos = buf[P + nb:P + nb + E], buf[P + nb + E:P + nb + 2 * E], buf[P + nb + 2 * E:]
    _align_small_kernel[(1,)](
        topk_idx.reshape(-1), rows, block_expert, start, count, pos, n, E, P, nb,
        BLOCK_M=block_m, BLOCK_N=max(16, _next_pow2(n)),
        BLOCK_E=max(16, _next_pow2(E + 1)), BLOCK_J=32, BLOCK_P=256, num_warps=8,
    )
    return ExpertRows(rows, block_expert, start, count, pos.view(T, K), P, block_m)


def align_rows(topk_idx: torch.Tensor, num_experts: int, block_m: int) -> ExpertRows:
    """Group the T*K pairs by expert (stable: token order within an expert), padded to block_m.

    Ids outside [0, num_experts) (-1, or the EP sentinel >= E of transformers) are dropped: they get
    no row and `token_topk_to_pos` -1, so no kernel reads out of bounds whatever the ids are.
    """
    device = topk_idx.device
    T, K = topk_idx.shape
    n = T * K
    if 0 < n <= SMALL_PAIRS and (device.type == "cuda" or _INTERPRET):
        return _align_small(topk_idx.contiguous(), num_experts, block_m)
    # Larger batches: the routing kernels' get_fused_mapping (three launches, no host sync with an
    # explicit P). It replaced ~15 torch ops that took 0.5-1.1 ms on an H200 at T=512..16384
    # (benchmarks/bench_moe.py stage times, 2026-12-02) against ~37 us of GPU time for the kernels.
    E = num_experts
    P = max_rows(n, E, block_m)
    # get_fused_mapping rejects ids >= E (a device-side assert); fused_experts drops them instead.
    idx = torch.where((topk_idx >= 0) & (topk_idx < E), topk_idx, torch.full_like(topk_idx, -1))
    pos_to_expert, _, pos_to_token_topk, token_topk_to_pos, starts, _, _, _ = get_fused_mapping(
        idx, E, P, block_m
    )
    return ExpertRows(
        rows=pos_to_token_topk,
        # Each block's first row is a real row of its expert (ranges start at multiples of block_m
        # and pad < block_m rows), or -1 past the last expert.
        block_expert=pos_to_expert[::block_m].contiguous(),  # kernels index it densely
        expert_start=starts,
        expert_count=group_count(idx, E),  # real rows (the mapping's counts are aligned lengths)
        token_topk_to_pos=token_topk_to_pos,
        num_rows=P,
        block_m=block_m,
    )


def sorted_weights(routing: ExpertRows, topk_weights: torch.Tensor) -> torch.Tensor:
    """fp32 [P]: the routing weight of each row, 0 on padding rows."""
    flat_w = topk_weights.reshape(-1).to(torch.float32)
    rows = routing.rows.to(torch.int64)
    return torch.where(rows >= 0, flat_w[rows.clamp(min=0)], flat_w.new_zeros(()))
