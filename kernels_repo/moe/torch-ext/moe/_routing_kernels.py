"""Triton kernels for MoE routing, and their launch configurations per compute capability.

Kernels only: nothing here touches devices. `routing.py` validates, allocates on the input's
device, enters `device_guard` and picks a `RoutingConfig` by the input device's capability.

get_fused_mapping runs as three kernels (count -> scan -> scatter) instead of TileKernels' single
cooperative kernel, because Triton has no grid-wide barrier that is safe in the interpreter.
Real rows keep token order inside an expert's range: tile j's rows come after tiles < j's
(the column scan), and inside a tile a row's rank is the number of earlier rows with its expert.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import triton
import triton.language as tl

from ._experts_kernels import _to

# The interpreter (CPU tests) casts fp32 -> bf16 by truncation, the GPU to nearest even: under the
# interpreter `_to` rounds on the bits first (a constexpr: the GPU code is unchanged).
_INTERPRETER_RNE = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@dataclass(frozen=True)
class RoutingConfig:
    """Launch parameters of one capability family; the SM count comes from the input's device."""

    name: str
    # get_fused_mapping: rows of topk_idx per sub-chunk (pairwise rank is SUB x SUB) and how many
    # programs per SM the count/scatter grids aim for.
    map_sub: int
    map_programs_per_sm: int
    map_warps: int
    # expand_to_fused / reduce_fused: hidden elements per program and warps.
    copy_block_h: int
    copy_warps: int
    reduce_block_h: int
    reduce_warps: int
    # histograms (group_count, aux_fi): programs per SM of the persistent grid.
    hist_programs_per_sm: int


# Both keep 16-byte vectors per thread for bf16 (1024 columns over 4 warps; 7168 = 7 x 1024).
# sm90 (132 SMs, HBM3): larger mapping sub-chunks (fewer serial steps per program) and wider
# reduce blocks; sm80 (108 SMs): half-size sub-chunks and reduce blocks. sm90 expand: 2048
# columns over 8 warps, the best of benchmarks/bench_moe_routing.py's sweep (docs/performance.md).
SM90 = RoutingConfig(
    name="sm90", map_sub=128, map_programs_per_sm=2, map_warps=4,
    copy_block_h=2048, copy_warps=8, reduce_block_h=1024, reduce_warps=4,
    hist_programs_per_sm=2,
)
SM80 = RoutingConfig(
    name="sm80", map_sub=64, map_programs_per_sm=2, map_warps=4,
    copy_block_h=1024, copy_warps=4, reduce_block_h=512, reduce_warps=4,
    hist_programs_per_sm=2,
)


# ----------------------------------------------------------------------------------------------
# get_fused_mapping
# ----------------------------------------------------------------------------------------------


@triton.jit
def _map_count_kernel(
    topk_ptr, tile_counts_ptr,
    pos_to_expert_ptr, pos_to_token_ptr, pos_to_token_topk_ptr,
    numel, num_experts, num_pos, nsub, fill_per_program,
    SUB: tl.constexpr, NB: tl.constexpr, FILL_BLOCK: tl.constexpr,
):
    """Per tile: histogram of expert ids and (column E) count of invalid ids; fill P with -1."""
    pid = tl.program_id(0).to(tl.int64)
    offs_sub = tl.arange(0, SUB)
    bins = tl.arange(0, NB)
    hist = tl.zeros([NB], dtype=tl.int32)
    bad = tl.zeros([SUB], dtype=tl.int32)
    tile_start = pid * nsub * SUB
    for s in range(nsub):
        offs = tile_start + s * SUB + offs_sub
        m = offs < numel
        ids = tl.load(topk_ptr + offs, mask=m, other=-1)
        valid = (ids >= 0) & (ids < num_experts)
        bad += (m & ((ids < -1) | (ids >= num_experts))).to(tl.int32)
        # invalid and -1 ids go to the dump bin `num_experts` (NB > num_experts), never counted.
        hist += tl.histogram(tl.where(valid, ids, num_experts).to(tl.int32), NB).to(tl.int32)
    row_ptr = tile_counts_ptr + pid * (num_experts + 1)
    tl.store(row_ptr + bins, hist, mask=bins < num_experts)
    tl.store(row_ptr + num_experts, tl.sum(bad, axis=0))
    # Every row of P starts as padding; the scatter kernel overwrites the real rows.
    neg = tl.full([FILL_BLOCK], -1, dtype=tl.int32)
    fill_start = pid * fill_per_program
    for f in range(0, fill_per_program, FILL_BLOCK):
        rows = fill_start + f + tl.arange(0, FILL_BLOCK)
        m = (rows < num_pos) & (rows < fill_start + fill_per_program)
        tl.store(pos_to_expert_ptr + rows, neg, mask=m)
        tl.store(pos_to_token_ptr + rows, neg, mask=m)
        tl.store(pos_to_token_topk_ptr + rows, neg, mask=m)


@triton.jit
def _map_scan_kernel(
    tile_counts_ptr, totals_ptr, n_tiles, width,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Per expert column: exclusive prefix of tile counts over tiles (in place), and the total."""
    cols = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    cmask = cols < width
    carry = tl.zeros([BLOCK_E], dtype=tl.int32)
    for t0 in range(0, n_tiles, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        ptrs = tile_counts_ptr + rows.to(tl.int64)[:, None] * width + cols[None, :]
        m = (rows < n_tiles)[:, None] & cmask[None, :]
        c = tl.load(ptrs, mask=m, other=0)
        incl = tl.cumsum(c, axis=0)
        tl.store(ptrs, incl - c + carry[None, :], mask=m)
        carry += tl.sum(c, axis=0)
    tl.store(totals_ptr + cols, carry, mask=cmask)


@triton.jit
def _map_scatter_kernel(
    topk_ptr, tile_counts_ptr, totals_ptr, meta_ptr,
    pos_to_expert_ptr, pos_to_token_ptr, pos_to_token_topk_ptr, token_topk_to_pos_ptr,
    expert_start_ptr, expert_end_ptr,
    numel, num_experts, num_pos, nsub, alignment, num_topk,
    SUB: tl.constexpr, NB: tl.constexpr,
):
    """Per tile: position of every (token, k) = expert start + earlier tiles + rank in the tile."""
    pid = tl.program_id(0).to(tl.int64)
    width = num_experts + 1
    bins = tl.arange(0, NB)
    emask = bins < num_experts
    cnt = tl.load(totals_ptr + bins, mask=emask, other=0)
    aligned = (cnt + alignment - 1) // alignment * alignment
    incl = tl.cumsum(aligned, axis=0)
    start = incl - aligned
    if pid == 0:
        tl.store(expert_start_ptr + bins, start, mask=emask)
        tl.store(expert_end_ptr + bins, incl, mask=emask)
        tl.store(meta_ptr + bins, aligned, mask=emask)  # num_tokens_per_expert
        n_bad = tl.load(totals_ptr + num_experts)
        needed = tl.sum(aligned, axis=0)
        tl.store(meta_ptr + num_experts, n_bad)
        tl.store(meta_ptr + num_experts + 1, needed)
        tl.store(meta_ptr + num_experts + 2, ((n_bad == 0) & (needed <= num_pos)).to(tl.int32))
    # This tile's row of tile_counts is private to this program: use it as the per-expert cursor.
    row_ptr = tile_counts_ptr + pid * width
    base = start + tl.load(row_ptr + bins, mask=emask, other=0)
    tl.store(row_ptr + bins, base, mask=emask)
    tl.debug_barrier()
    offs_sub = tl.arange(0, SUB)
    earlier = offs_sub[None, :] < offs_sub[:, None]
    tile_start = pid * nsub * SUB
    for s in range(nsub):
        offs = tile_start + s * SUB + offs_sub
        m = offs < numel
        ids = tl.load(topk_ptr + offs, mask=m, other=-1)
        valid = m & (ids >= 0) & (ids < num_experts)
        eid = tl.where(valid, ids, num_experts).to(tl.int32)
        rank = tl.sum(((eid[:, None] == eid[None, :]) & earlier).to(tl.int32), axis=1)
        # .cg: read the cursor from L2, past any stale L1 line of the row we just rewrote.
        pos = tl.load(row_ptr + eid, mask=valid, other=0, cache_modifier=".cg") + rank
        # Rows past P are never written; the host (or an async device assert) reports the overflow.
        ok = valid & (pos < num_pos)
        tl.store(token_topk_to_pos_ptr + offs, tl.where(ok, pos, -1), mask=m)
        tl.store(pos_to_expert_ptr + pos, eid, mask=ok)
        tl.store(pos_to_token_ptr + pos, (offs // num_topk).to(tl.int32), mask=ok)
        tl.store(pos_to_token_topk_ptr + pos, offs.to(tl.int32), mask=ok)
        base += tl.histogram(eid, NB).to(tl.int32)
        tl.debug_barrier()  # every thread has read the cursor before it moves
        tl.store(row_ptr + bins, base, mask=emask)
        tl.debug_barrier()


# ----------------------------------------------------------------------------------------------
# expand_to_fused / reduce_fused
# ----------------------------------------------------------------------------------------------


@triton.jit
def _expand_kernel(
    x_ptr, out_ptr, map_ptr, pos_to_expert_ptr, valid_ptr,
    num_tokens, num_pos, hidden, stride_xm, stride_mt,
    K: tl.constexpr, BLOCK_H: tl.constexpr, PAD_ROWS: tl.constexpr, PAD_R: tl.constexpr,
    SUB_H: tl.constexpr,
):
    """Programs < T copy token t's chunk to its K rows; the rest zero the padding rows.
    A position outside [-1, P) is not written and clears *valid_ptr (the caller asserts on it)."""
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < hidden
    if pid < num_tokens:
        v = tl.load(x_ptr + pid * stride_xm + cols, mask=cmask)
        for k in tl.static_range(K):
            pos = tl.load(map_ptr + pid * stride_mt + k).to(tl.int64)
            ok = (pos >= 0) & (pos < num_pos)
            tl.store(valid_ptr, 0, mask=(pos < -1) | (pos >= num_pos))
            tl.store(out_ptr + pos * hidden + cols, v, mask=cmask & ok)
    else:
        # PAD_ROWS rows per program; most such blocks lie inside real rows and stop after one load.
        rows = (pid - num_tokens) * PAD_ROWS + tl.arange(0, PAD_ROWS)
        pe = tl.load(pos_to_expert_ptr + rows, mask=rows < num_pos, other=0)
        if tl.sum(((rows < num_pos) & (pe < 0)).to(tl.int32), axis=0) > 0:
            # Small [PAD_R, SUB_H] tiles in runtime loops: unrolled or larger tiles raised the
            # whole kernel to 122-134 registers per thread on sm90 (ptxas -v), 32 with these.
            zero = tl.zeros([PAD_R, SUB_H], dtype=out_ptr.dtype.element_ty)
            for r0 in range(0, PAD_ROWS, PAD_R):
                r = (pid - num_tokens) * PAD_ROWS + r0 + tl.arange(0, PAD_R)
                pr = tl.load(pos_to_expert_ptr + r, mask=r < num_pos, other=0)
                pad = (r < num_pos) & (pr < 0)
                for h0 in range(0, BLOCK_H, SUB_H):
                    c = tl.program_id(1) * BLOCK_H + h0 + tl.arange(0, SUB_H)
                    tl.store(out_ptr + r[:, None] * hidden + c[None, :], zero,
                             mask=pad[:, None] & (c < hidden)[None, :])


@triton.jit
def _reduce_kernel(
    x_ptr, w_ptr, map_ptr, out_ptr, valid_ptr,
    num_pos, hidden, stride_xp, stride_wt, stride_wk, stride_mt, stride_ot,
    K: tl.constexpr, HAS_W: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[t] = sum_k w[t, k] * x[pos[t, k]] over pos >= 0, accumulated in fp32 in k order.
    A position outside [-1, P) is not read and clears *valid_ptr (the caller asserts on it)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(K):
        pos = tl.load(map_ptr + t * stride_mt + k).to(tl.int64)
        ok = (pos >= 0) & (pos < num_pos)
        tl.store(valid_ptr, 0, mask=(pos < -1) | (pos >= num_pos))
        v = tl.load(x_ptr + pos * stride_xp + cols, mask=cmask & ok, other=0.0).to(tl.float32)
        if HAS_W:
            # a dropped slot's weight is never read: a NaN/inf there would make 0 * w a NaN
            w = tl.load(w_ptr + t * stride_wt + k * stride_wk, mask=ok, other=0.0).to(tl.float32)
            v = v * w
        acc += v
    tl.store(out_ptr + t * stride_ot + cols, _to(acc, out_ptr.dtype.element_ty, _INTERPRETER_RNE), mask=cmask)


# ----------------------------------------------------------------------------------------------
# small routing ops
# ----------------------------------------------------------------------------------------------


@triton.jit
def _topk_gate_kernel(
    scores_ptr, out_ptr, num_tokens, num_experts, stride_st, stride_se,
    K: tl.constexpr, BLOCK_T: tl.constexpr, E_POW2: tl.constexpr,
):
    """K rounds of (max, smallest index holding it); a taken column never competes again.
    NaN ranks above every number, as in torch.sort / torch.topk: a row's NaNs are taken first."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_POW2)
    rmask = rows < num_tokens
    avail = rmask[:, None] & (cols < num_experts)[None, :]
    s = tl.load(scores_ptr + rows[:, None] * stride_st + cols[None, :] * stride_se, mask=avail,
                other=float("-inf"))
    for k in tl.static_range(K):
        nan = avail & (s != s)
        has_nan = tl.max(nan.to(tl.int32), axis=1) > 0
        m = tl.max(tl.where(avail & (s == s), s, float("-inf")), axis=1)
        hit = tl.where(has_nan[:, None], nan, avail & (s == m[:, None]))
        cand = tl.where(hit, cols[None, :], E_POW2)
        idx = tl.min(cand, axis=1)
        tl.store(out_ptr + rows * K + k, idx.to(tl.int64), mask=rmask)
        avail = avail & (cols[None, :] != idx[:, None])


@triton.jit
def _normalize_weight_kernel(
    w_ptr, denom_ptr, out_ptr, num_tokens, stride_wt, stride_wk,
    K: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """denominator = 1e-20 + w0 + w1 + ... in that order; normalized = w / denominator (IEEE)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    m = rows < num_tokens
    acc = tl.full([BLOCK_T], 1e-20, dtype=tl.float32)
    for k in tl.static_range(K):
        acc += tl.load(w_ptr + rows * stride_wt + k * stride_wk, mask=m, other=0.0)
    tl.store(denom_ptr + rows, acc, mask=m)
    for k in tl.static_range(K):
        w = tl.load(w_ptr + rows * stride_wt + k * stride_wk, mask=m, other=0.0)
        tl.store(out_ptr + rows * K + k, tl.math.div_rn(w, acc), mask=m)


@triton.jit
def _group_count_kernel(
    idx_ptr, out_ptr, numel, num_groups,
    BLOCK: tl.constexpr, NB: tl.constexpr,
):
    """Persistent histogram: out[g] += count of g; out[num_groups] += count of invalid ids."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    hist = tl.zeros([NB], dtype=tl.int32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    first = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    for start in range(0, numel, nprog * BLOCK):
        offs = first + start
        m = offs < numel
        g = tl.load(idx_ptr + offs, mask=m, other=-1)
        valid = (g >= 0) & (g < num_groups)
        bad += (m & ((g < -1) | (g >= num_groups))).to(tl.int32)
        hist += tl.histogram(tl.where(valid, g, num_groups).to(tl.int32), NB).to(tl.int32)
    bins = tl.arange(0, NB)
    tl.atomic_add(out_ptr + bins, hist, mask=(bins < num_groups) & (hist > 0))
    tl.atomic_add(out_ptr + num_groups, tl.sum(bad, axis=0))


@triton.jit
def _mask_indices_by_tp_kernel(
    idx_ptr, out_ptr, valid_ptr, numel, n, per_gpu, per_dp, num_tp_ranks, tp_rank,
    BLOCK: tl.constexpr,
):
    """Keep ids whose (id // per_gpu) % num_tp_ranks == tp_rank, renumbered locally; else -1.
    An id outside [-1, n) becomes -1 and clears *valid_ptr (the caller asserts on it)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    v = tl.load(idx_ptr + offs, mask=m, other=-1)
    bad = m & ((v < -1) | (v >= n))
    tl.store(valid_ptr, 0, mask=tl.max(bad.to(tl.int32), axis=0) > 0)
    nonneg = tl.where(v >= 0, v, 0)
    keep = (v >= 0) & (v < n) & ((nonneg // per_gpu) % num_tp_ranks == tp_rank)
    local = nonneg - tp_rank * per_gpu
    local = tl.where(local >= 0, local, 0)
    local = local - (local // per_dp) * (per_dp - per_gpu)
    tl.store(out_ptr + offs, tl.where(keep & (local >= 0), local, -1).to(v.dtype), mask=m)


@triton.jit
def _unique_group_kernel(
    g_ptr, num_tokens, stride_gt, stride_gk,
    K: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """A group id seen earlier in its row becomes -1 (the first occurrence stays)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    m = rows < num_tokens
    for j in tl.static_range(1, K):
        cj = tl.load(g_ptr + rows * stride_gt + j * stride_gk, mask=m, other=-1)
        dup = cj != cj  # all False, of the right shape
        for i in tl.static_range(j):
            # Column i may already be -1 (a duplicate); its value's first occurrence is intact
            # and earlier still, so the comparison against it catches cj all the same.
            ci = tl.load(g_ptr + rows * stride_gt + i * stride_gk, mask=m, other=-1)
            dup = dup | ((ci == cj) & (cj >= 0))
        tl.store(g_ptr + rows * stride_gt + j * stride_gk, tl.where(dup, -1, cj), mask=m & dup)
