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

from kernelhub.device import CachedLaunch

from .routing import _int32_views, _mapping

# Up to this many (token, k) pairs one Triton program aligns them in one launch (decode: T<=64,
# K<=8) instead of ~15 torch ops, whose launches would cost more than the expert GEMMs there.
SMALL_PAIRS = 512
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


class ExpertRows(NamedTuple):
    """Expert-major buffer of P rows; expert e owns rows [start[e], start[e] + align(count[e]))."""

    rows: torch.Tensor  # int32 [P]: flat index t*K+k of the pair held by each row, -1 on padding rows
    row_expert: torch.Tensor  # int32 [P]: expert of each row; the first row of every block of
    # block_m rows is a real row of its expert (or -1 past the last expert), kernels read only those
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
    # a symbolic count (torch.compile, dynamic shapes: the training op's fake) takes the SymInt-aware
    # min/max: Python's would guard on T*K < E and recompile whenever a batch crosses it
    lo, hi = (min, max) if type(num_pairs) is int else (torch.sym_min, torch.sym_max)
    bound = lo(num_pairs * block_m, num_pairs + num_experts * (block_m - 1))
    return hi(block_m, -(-bound // block_m) * block_m)


@triton.jit
def _align_small_kernel(
    idx_ptr, rows_ptr, row_expert_ptr, start_ptr, count_ptr, pos_ptr,
    n, E, P,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """One program: histogram, aligned exclusive cumsum, stable rank, scatter. Same as align_rows."""
    offs = tl.arange(0, BLOCK_N)
    in_range = offs < n
    raw = tl.load(idx_ptr + offs, mask=in_range, other=-1)  # int64 ids: range-checked before any cast
    valid = in_range & (raw >= 0) & (raw < E)
    key = tl.where(valid, raw, E).to(tl.int32)  # dropped and out-of-range pairs: bin E (< BLOCK_E), ignored
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
        tl.store(row_expert_ptr + offs_p, tl.full((BLOCK_P,), -1, tl.int32), mask=offs_p < P)
    tl.debug_barrier()  # the fills and `starts` above are read/overwritten below by other threads
    rank = tl.zeros((BLOCK_N,), dtype=tl.int32)
    for j0 in range(0, BLOCK_N, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        kj = tl.load(idx_ptr + offs_j, mask=offs_j < n, other=-1)
        kj = tl.where((kj >= 0) & (kj < E), kj, E).to(tl.int32)
        earlier = (key[:, None] == kj[None, :]) & (offs_j[None, :] < offs[:, None])
        rank += tl.sum(earlier.to(tl.int32), axis=1)
    start = tl.load(start_ptr + key, mask=valid, other=0)
    pos = tl.where(valid, start + rank, -1)
    tl.store(pos_ptr + offs, pos, mask=in_range)
    tl.store(rows_ptr + pos, offs, mask=valid)
    tl.store(row_expert_ptr + pos, key, mask=valid)


_align_small_launch = CachedLaunch(_align_small_kernel)


def _align_small(topk_idx: torch.Tensor, num_experts: int, block_m: int) -> ExpertRows:
    T, K = topk_idx.shape
    n = T * K
    E = num_experts
    P = max_rows(n, E, block_m)
    # one allocation, five views (each 16-byte aligned, as the launches' cached path needs)
    rows, row_expert, start, count, pos = _int32_views((P, P, E, E, n), topk_idx.device)
    _align_small_launch.split(
        (1,), topk_idx.device.index if topk_idx.is_cuda else -1,
        (topk_idx.reshape(-1), rows, row_expert, start, count, pos), (n, E, P),
        # BLOCK_M, BLOCK_N, BLOCK_E, BLOCK_J, BLOCK_P
        (block_m, max(16, _next_pow2(n)), max(16, _next_pow2(E + 1)), 32, 256), num_warps=8,
    )
    return ExpertRows(rows, row_expert, start, count, pos.view(T, K), P, block_m)


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
    # Larger batches: the three mapping kernels of `get_fused_mapping` with the static bound P (no
    # host sync). They drop ids outside [0, E) as this function must, and count real rows per
    # expert on the way, so nothing else is launched (~15 torch ops would cost far more host and
    # GPU time than the kernels; docs/performance.md).
    m = _mapping(topk_idx, num_experts, max_rows(n, num_experts, block_m), block_m)
    return ExpertRows(
        rows=m.pos_to_token_topk,
        row_expert=m.pos_to_expert,
        expert_start=m.expert_start,
        expert_count=m.counts,
        token_topk_to_pos=m.token_topk_to_pos,
        num_rows=m.pos_to_expert.shape[0],
        block_m=block_m,
    )

