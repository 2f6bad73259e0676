"""Triton kernels of `fused_experts`: grouped GEMMs over an expert-aligned row buffer.

Pipeline (rows are the P expanded (token, k) pairs, grouped by expert, each group padded to
BLOCK_M so that one M-block belongs to one expert, the layout of vLLM/SGLang's fused_moe):
  1. `_grouped_gemm_kernel` EPILOGUE=1: h = silu(x[tok] @ Wg^T) * (x[tok] @ Wu^T)      [P, I]
  2. `_grouped_gemm_kernel` EPILOGUE=0: y = h @ Wd^T                                  [P, H]
  3. `_combine_kernel`: out[t] = sum_k w[t, k] * y[pos[t, k]] (fp32)                    [T, H]
Backward reuses 1-3 with other operands plus `_grouped_wgrad_kernel` (dW[e] = A_e^T B_e).

These kernels serve both capabilities: the sm80 path loads weights with pointer arithmetic and
lets Triton software-pipeline the K loop (num_stages); the sm90 path sets B_TMA and passes a host
TensorDescriptor, so weight tiles arrive by TMA (see `_experts_sm90.py`). Kernels only here:
allocation, guards and launches live in `_experts_pipeline.py` and `_experts_launch.py`.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _to(v, dtype: tl.constexpr, RNE: tl.constexpr):
    """Cast fp32 -> dtype. The interpreter truncates fp32 -> bf16 (twice the GPU's rounding error,
    which uses round-to-nearest-even), so under RNE the rounding is done on the bits first."""
    if RNE and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        v = tl.where(v == v, rounded, v)  # a NaN's carry could reach the exponent: keep NaNs as they are
    return v.to(dtype)


@triton.jit
def _load_b_tile(b_ptr, b_desc, e, offs_k, offs_n, k_limit, n_limit, stride_be, stride_bn, stride_bk,
                 B_TMA: tl.constexpr, B_NCONTIG: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, n0, k0):
    """A [BLOCK_K, BLOCK_N] tile of expert e's weight; zero outside [k_limit) x [n_limit)."""
    if B_TMA:
        e32 = e.to(tl.int32)  # descriptor coordinates are 32-bit
        if B_NCONTIG:
            tile = b_desc.load([e32, k0, n0]).reshape(BLOCK_K, BLOCK_N)
        else:
            tile = tl.trans(b_desc.load([e32, n0, k0]).reshape(BLOCK_N, BLOCK_K))
    else:
        ptrs = (b_ptr + e * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn)
        mask = (offs_k[:, None] < k_limit) & (offs_n[None, :] < n_limit)
        tile = tl.load(ptrs, mask=mask, other=0.0)
    return tile


@triton.jit
def _grouped_gemm_kernel(
    # pointers
    a_ptr, b_ptr, c_ptr, aux_ptr, rows_ptr, row_expert_ptr, scale_ptr, dscale_ptr, h_ptr,
    expert_start_ptr, expert_count_ptr, pair_tiles_ptr,
    b_desc, a_desc, a_desc_tall,  # after the pointers: CachedLaunch.split's order (tensors, extras, ints, constexprs)
    # sizes
    P, N, K, B_N_TOTAL, E,
    # strides
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_xm, stride_hm,
    # meta
    EPILOGUE: tl.constexpr,     # 0: C = A@B; 1: C = silu(A@Bg)*(A@Bu) (+ aux = [g, u]); 2: SwiGLU bwd
    SAVE_AUX: tl.constexpr,     # EPILOGUE 1: also store the pre-activation [g | u] into aux
    SAVE_H: tl.constexpr,       # EPILOGUE 2: also store w * silu(g) * u (dW_down's operand) into h
    GATHER_A: tl.constexpr,     # A row of buffer row p is rows[p] // TOPK (a token id); else p
    TOPK: tl.constexpr,
    B_TMA: tl.constexpr,        # weights through a TensorDescriptor (sm90)
    B_NCONTIG: tl.constexpr,    # weight stored [E, K, N] (N contiguous) instead of [E, N, K]
    UPCAST: tl.constexpr,       # interpreter: bf16 tl.dot is wrong there, compute in fp32
    PRECISION: tl.constexpr,
    PAIR: tl.constexpr,         # two BLOCK_M blocks of one expert as one 2*BLOCK_M tile (see below)
    A_TMA: tl.constexpr,        # A (not gathered: rows in buffer order) by TMA (PAIR: a_desc_tall for tall tiles)
    PERSISTENT: tl.constexpr,   # programs loop over the tiles in one flattened loop (see below)
    EPI_HALVES: tl.constexpr,   # EPILOGUE 1 with SAVE_AUX: the epilogue in two column halves
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile (PAIR: [2*BLOCK_M, BLOCK_N] where it can) of a grouped GEMM.

    PAIR: rows stay padded to BLOCK_M per expert (the routing's alignment), but an expert's blocks
    0+1, 2+3, ... run as one tile of twice the height and only an odd last block alone. With
    BLOCK_M=64 an expert of 262 rows costs 320 rows of MMA work instead of 384 at BLOCK_M=128,
    while most of its tiles keep the taller shape's MMA rate.

    PERSISTENT: a grid of a few programs per SM, each looping over the tiles of the rows actually
    used (their count read on the device: start + aligned count of the last expert, so no host
    sync), with the tile loop and the fixed-length K loop flattened into one software-pipelined
    loop: the next tile's loads are in flight during this tile's last MMAs and epilogue, which a
    one-tile program cannot overlap (one 8-warp CTA per SM at these tiles' shared memory). With
    PAIR, one such loop over the tall tiles, then one over the lone blocks, each reading the first
    rows of its tiles from the list `_pair_tiles_kernel` wrote (one tile height per loop).
    """
    if PERSISTENT and PAIR:
        num_n = tl.cdiv(N, BLOCK_N)
        cap = P // (2 * BLOCK_M)  # the lone blocks' first rows follow the room for the tall tiles
        for tile in tl.range(tl.program_id(0), tl.load(pair_tiles_ptr) * num_n, tl.num_programs(0), flatten=True):
            t, pid_n = _grouped_tile(tile, tl.load(pair_tiles_ptr), num_n, GROUP_M)
            m0 = tl.load(pair_tiles_ptr + 2 + t).to(tl.int64)
            e = tl.load(row_expert_ptr + m0).to(tl.int64)
            _gemm_tile(m0, e, pid_n, a_ptr, b_ptr, b_desc, a_desc_tall, c_ptr, aux_ptr, rows_ptr, scale_ptr,
                       dscale_ptr, h_ptr, P, N, K, B_N_TOTAL, stride_am, stride_ak, stride_be, stride_bn,
                       stride_bk, stride_cm, stride_cn, stride_xm, stride_hm, EPILOGUE, SAVE_AUX, SAVE_H,
                       GATHER_A, TOPK, B_TMA, B_NCONTIG, A_TMA, EPI_HALVES, UPCAST, PRECISION, 2 * BLOCK_M, BLOCK_N,
                       BLOCK_K)
        for tile in tl.range(tl.program_id(0), tl.load(pair_tiles_ptr + 1) * num_n, tl.num_programs(0),
                             flatten=True):
            t, pid_n = _grouped_tile(tile, tl.load(pair_tiles_ptr + 1), num_n, GROUP_M)
            m0 = tl.load(pair_tiles_ptr + 2 + cap + t).to(tl.int64)
            e = tl.load(row_expert_ptr + m0).to(tl.int64)
            _gemm_tile(m0, e, pid_n, a_ptr, b_ptr, b_desc, a_desc, c_ptr, aux_ptr, rows_ptr, scale_ptr,
                       dscale_ptr, h_ptr, P, N, K, B_N_TOTAL, stride_am, stride_ak, stride_be, stride_bn,
                       stride_bk, stride_cm, stride_cn, stride_xm, stride_hm, EPILOGUE, SAVE_AUX, SAVE_H,
                       GATHER_A, TOPK, B_TMA, B_NCONTIG, A_TMA, EPI_HALVES, UPCAST, PRECISION, BLOCK_M, BLOCK_N,
                       BLOCK_K)
        return
    if PERSISTENT:
        used = tl.load(expert_start_ptr + E - 1) + tl.cdiv(tl.load(expert_count_ptr + E - 1), BLOCK_M) * BLOCK_M
        num_m = tl.cdiv(used, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _grouped_tile(tile, num_m, num_n, GROUP_M)
            m0 = pid_m.to(tl.int64) * BLOCK_M
            e = tl.load(row_expert_ptr + m0).to(tl.int64)  # every block below `used` has a real first row
            _gemm_tile(m0, e, pid_n, a_ptr, b_ptr, b_desc, a_desc, c_ptr, aux_ptr, rows_ptr, scale_ptr,
                       dscale_ptr, h_ptr, P, N, K, B_N_TOTAL, stride_am, stride_ak, stride_be, stride_bn,
                       stride_bk, stride_cm, stride_cn, stride_xm, stride_hm, EPILOGUE, SAVE_AUX, SAVE_H,
                       GATHER_A, TOPK, B_TMA, B_NCONTIG, A_TMA, EPI_HALVES, UPCAST, PRECISION, BLOCK_M, BLOCK_N,
                       BLOCK_K)
        return
    pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(P, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    # The first row of each block is a real row of the block's expert (or -1 past the last one).
    e = tl.load(row_expert_ptr + pid_m.to(tl.int64) * BLOCK_M).to(tl.int64)
    if e < 0:  # block past the last used row: nothing to do
        return
    m0 = pid_m.to(tl.int64) * BLOCK_M
    run = True
    tall = False
    if PAIR:
        blk = (m0 - tl.load(expert_start_ptr + e).to(tl.int64)) // BLOCK_M  # block index in the expert
        run = blk % 2 == 0  # an odd block is done by the program of the block before it
        tall = blk + 1 < tl.cdiv(tl.load(expert_count_ptr + e).to(tl.int64), BLOCK_M)
    if run:
        if PAIR and tall:  # (PAIR first: without it the tall tile is not even compiled)
            _gemm_tile(m0, e, pid_n, a_ptr, b_ptr, b_desc, a_desc_tall, c_ptr, aux_ptr, rows_ptr, scale_ptr, dscale_ptr,
                       h_ptr, P, N, K, B_N_TOTAL, stride_am, stride_ak, stride_be, stride_bn, stride_bk,
                       stride_cm, stride_cn, stride_xm, stride_hm, EPILOGUE, SAVE_AUX, SAVE_H, GATHER_A,
                       TOPK, B_TMA, B_NCONTIG, A_TMA, EPI_HALVES, UPCAST, PRECISION, 2 * BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            _gemm_tile(m0, e, pid_n, a_ptr, b_ptr, b_desc, a_desc, c_ptr, aux_ptr, rows_ptr, scale_ptr, dscale_ptr,
                       h_ptr, P, N, K, B_N_TOTAL, stride_am, stride_ak, stride_be, stride_bn, stride_bk,
                       stride_cm, stride_cn, stride_xm, stride_hm, EPILOGUE, SAVE_AUX, SAVE_H, GATHER_A,
                       TOPK, B_TMA, B_NCONTIG, A_TMA, EPI_HALVES, UPCAST, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _pair_tiles_kernel(start_ptr, count_ptr, tiles_ptr, E, P, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """The first row of every tile of a PAIR layout, for persistent programs: tiles[0] tall tiles
    (two blocks of one expert) and tiles[1] lone blocks (an expert's odd last block); the tall
    tiles' first rows from tiles[2], expert by expert, the lone blocks' from tiles[2 + P // (2 *
    BLOCK_M)] (a bound on the tall tiles). One program; no host sync."""
    offs = tl.arange(0, BLOCK_E)
    real = offs < E
    blocks = tl.cdiv(tl.load(count_ptr + offs, mask=real, other=0), BLOCK_M)
    start = tl.load(start_ptr + offs, mask=real, other=0)
    tall = blocks // 2
    lone = blocks % 2
    tall_first = tl.cumsum(tall, 0) - tall
    tl.store(tiles_ptr, tl.sum(tall, 0))
    tl.store(tiles_ptr + 1, tl.sum(lone, 0))
    for j in range(0, tl.max(tall, 0)):
        tl.store(tiles_ptr + 2 + tall_first + j, start + 2 * BLOCK_M * j, mask=real & (j < tall))
    tl.store(tiles_ptr + 2 + P // (2 * BLOCK_M) + tl.cumsum(lone, 0) - lone, start + (blocks - 1) * BLOCK_M,
             mask=real & (lone == 1))


@triton.jit
def _grouped_tile(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(M-block, N-block) of a tile index in grouped order: GROUP_M consecutive M-blocks (mostly one
    expert) sweep the N tiles together, so a weight tile is fetched from HBM once and re-read from L2."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    group_size = min(num_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_size, (tile % per_group) // group_size


@triton.jit
def _gemm_tile(
    m0, e, pid_n, a_ptr, b_ptr, b_desc, a_desc, c_ptr, aux_ptr, rows_ptr, scale_ptr, dscale_ptr, h_ptr,
    P, N, K, B_N_TOTAL,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_xm, stride_hm,
    EPILOGUE: tl.constexpr, SAVE_AUX: tl.constexpr, SAVE_H: tl.constexpr, GATHER_A: tl.constexpr,
    TOPK: tl.constexpr, B_TMA: tl.constexpr, B_NCONTIG: tl.constexpr, A_TMA: tl.constexpr, EPI_HALVES: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Rows [m0, m0 + BLOCK_M) of the buffer (all expert e's or padding) x column tile pid_n."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < P
    flat = tl.load(rows_ptr + offs_m, mask=m_mask, other=-1)
    row_valid = flat >= 0
    if GATHER_A:
        a_rows = tl.where(row_valid, flat // TOPK, 0).to(tl.int64)
        a_mask_m = row_valid
    else:
        a_rows = offs_m
        a_mask_m = m_mask
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_kk = tl.arange(0, BLOCK_K)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if EPILOGUE == 1:
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + offs_kk
        if A_TMA:  # rows past P and columns past K read as zeros, as the masked load's
            a = a_desc.load([m0.to(tl.int32), k0])
        else:
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                        mask=a_mask_m[:, None] & (offs_k[None, :] < K), other=0.0)
        b = _load_b_tile(b_ptr, b_desc, e, offs_k, offs_n, K, N, stride_be, stride_bn, stride_bk,
                         B_TMA, B_NCONTIG, BLOCK_N, BLOCK_K, n0, k0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if EPILOGUE == 1:
            bu = _load_b_tile(b_ptr, b_desc, e, offs_k, offs_n + N, K, B_N_TOTAL, stride_be, stride_bn,
                              stride_bk, B_TMA, B_NCONTIG, BLOCK_N, BLOCK_K, n0 + N, k0)
            if UPCAST:
                bu = bu.to(tl.float32)
            acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)

    c_mask = m_mask[:, None] & (offs_n[None, :] < N)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    if EPILOGUE == 0:
        tl.store(c_ptrs, _to(acc, c_ptr.dtype.element_ty, UPCAST), mask=c_mask)
    elif EPILOGUE == 1:
        if SAVE_AUX and EPI_HALVES:
            # Two column halves, as the dgrad epilogue: with both [g | u] tiles stored whole, ptxas
            # (sm90, 128x128 / 8 warps) takes 255 registers and spills; in halves 176 and none.
            g0, g1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            u0, u1 = tl.split(tl.permute(tl.reshape(acc_u, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            _swiglu_fwd_epilogue(g0, u0, n0 + tl.arange(0, BLOCK_N // 2), offs_m, m_mask, N, aux_ptr, c_ptr,
                                 stride_xm, stride_cm, stride_cn, UPCAST)
            _swiglu_fwd_epilogue(g1, u1, n0 + BLOCK_N // 2 + tl.arange(0, BLOCK_N // 2), offs_m, m_mask, N,
                                 aux_ptr, c_ptr, stride_xm, stride_cm, stride_cn, UPCAST)
        else:
            if SAVE_AUX:
                x_ptrs = aux_ptr + offs_m[:, None] * stride_xm + offs_n[None, :]
                tl.store(x_ptrs, _to(acc, aux_ptr.dtype.element_ty, UPCAST), mask=c_mask)
                tl.store(x_ptrs + N, _to(acc_u, aux_ptr.dtype.element_ty, UPCAST), mask=c_mask)
            h = acc * tl.sigmoid(acc) * acc_u
            tl.store(c_ptrs, _to(h, c_ptr.dtype.element_ty, UPCAST), mask=c_mask)
    else:
        # acc = dY[tok] @ Wd[e] = dL/dh before the routing weight; aux holds [g | u] of the forward.
        # scale = topk_weights and dscale = its fp32 gradient, both flat [T*K], indexed by rows[p].
        # Two column halves: the whole tile at once kept ~4 fp32 tiles live (ptxas, sm90, 128x128,
        # 8 warps: 255 registers and spills; in halves 183 and none) and ran slower (docs/performance.md).
        w = tl.load(scale_ptr + flat, mask=row_valid, other=0.0).to(tl.float32)
        acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        _swiglu_bwd_epilogue(acc0, n0 + tl.arange(0, BLOCK_N // 2), w, flat, row_valid, offs_m, m_mask, N,
                             aux_ptr, c_ptr, dscale_ptr, h_ptr, stride_xm, stride_cm, stride_cn, stride_hm,
                             SAVE_H, UPCAST)
        _swiglu_bwd_epilogue(acc1, n0 + BLOCK_N // 2 + tl.arange(0, BLOCK_N // 2), w, flat, row_valid,
                             offs_m, m_mask, N, aux_ptr, c_ptr, dscale_ptr, h_ptr, stride_xm, stride_cm,
                             stride_cn, stride_hm, SAVE_H, UPCAST)


@triton.jit
def _swiglu_fwd_epilogue(g, u, cols, offs_m, m_mask, N, aux_ptr, c_ptr, stride_xm, stride_cm, stride_cn,
                         UPCAST: tl.constexpr):
    mask = m_mask[:, None] & (cols[None, :] < N)
    x_ptrs = aux_ptr + offs_m[:, None] * stride_xm + cols[None, :]
    tl.store(x_ptrs, _to(g, aux_ptr.dtype.element_ty, UPCAST), mask=mask)
    tl.store(x_ptrs + N, _to(u, aux_ptr.dtype.element_ty, UPCAST), mask=mask)
    h = g * tl.sigmoid(g) * u
    tl.store(c_ptr + offs_m[:, None] * stride_cm + cols[None, :] * stride_cn, _to(h, c_ptr.dtype.element_ty, UPCAST),
             mask=mask)


@triton.jit
def _swiglu_bwd_epilogue(acc, cols, w, flat, row_valid, offs_m, m_mask, N, aux_ptr, c_ptr, dscale_ptr, h_ptr,
                         stride_xm, stride_cm, stride_cn, stride_hm, SAVE_H: tl.constexpr, UPCAST: tl.constexpr):
    """SwiGLU backward on the columns `cols` of a dgrad tile: d[gate | up], dL/dw, w * h."""
    mask = m_mask[:, None] & (cols[None, :] < N)
    x_ptrs = aux_ptr + offs_m[:, None] * stride_xm + cols[None, :]
    g = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptrs + N, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    h = silu * u
    # dL/dw[t, k] = <dY[t], y[p]> = <acc, h[p]>, summed over the column tiles by atomics.
    tl.atomic_add(dscale_ptr + flat, tl.sum(acc * h, axis=1), mask=row_valid)
    if SAVE_H:
        # dW_down[e] = sum_p (w_p dY[tok_p])^T h_p: computed here once per element instead of in
        # every M tile of the weight-gradient GEMM (where the sigmoid cost as much as the MMA).
        tl.store(h_ptr + offs_m[:, None] * stride_hm + cols[None, :],
                 _to(h * w[:, None], h_ptr.dtype.element_ty, UPCAST), mask=mask)
    dh = acc * w[:, None]
    dg = dh * u * sig * (1.0 + g * (1.0 - sig))
    du = dh * silu
    ptrs = c_ptr + offs_m[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(ptrs, _to(dg, c_ptr.dtype.element_ty, UPCAST), mask=mask)
    tl.store(ptrs + N * stride_cn, _to(du, c_ptr.dtype.element_ty, UPCAST), mask=mask)


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr, b_ptr, c_ptr, rows_ptr, expert_start_ptr, expert_count_ptr, a_desc, b_desc, c_desc,
    E, M, N, P,
    stride_am, stride_ak, stride_bm, stride_bk, stride_ce, stride_cm, stride_cn,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, TOPK: tl.constexpr,
    A_TMA: tl.constexpr, B_TMA: tl.constexpr, C_TMA: tl.constexpr, PERSISTENT: tl.constexpr,
    FLAT_STEPS: tl.constexpr, BLOCK_E: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """dW[e] = sum over e's rows p of A[p]^T B[p]: [M, N] per expert; experts with no rows get 0.

    A_TMA / B_TMA (sm90, an operand that is not gathered): its [BLOCK_K, BLOCK_M|N] tiles come by
    TMA from a 2-D descriptor over the [P, M|N] buffer. The box then also reads the expert's
    padding rows (finite: written by the dgrad kernel), which meet zeros in the gathered operand;
    the caller makes sure BLOCK_K divides the row alignment, so a box never leaves the expert.
    C_TMA (sm90): the tile is written by one TMA store through a 3-D descriptor over dW [E, M, N].
    PERSISTENT: a grid smaller than the tile count, each program looping over tiles, so that with
    C_TMA a tile's store could drain while the program loads the next tile (short K loops are
    store-bound). Alone the plain loop was slower at every point timed (docs/performance.md);
    buckets set it with FLAT_STEPS.
    FLAT_STEPS (PERSISTENT, both operands by TMA): while no expert has more than FLAT_STEPS K steps
    and E times the largest expert's step count is at most 1.5x the sum of all experts' step
    counts (so that skewed routing, or experts with no rows, cannot make the zero steps cost more
    than half the real ones), every tile runs exactly max-over-experts steps (a tile's steps past
    its own rows load boxes at row P, outside the buffers: zeros), so the K-loop bounds do not
    depend on the tile and Triton flattens tile loop and K loop into one software-pipelined loop:
    the next tile's loads are in flight during this tile's MMAs and store. Why: at <= 256 rows per
    expert the K loop is 2-5 steps and the kernel is latency-bound, well under the SM, L2 and DRAM
    limits (docs/performance.md). Otherwise: the plain persistent loop.
    """
    # Every branch test below is on constexprs, except the one on the device-side step counts: a
    # runtime `if` is traced on both sides, so it may only sit where both operands are descriptors.
    if FLAT_STEPS > 0 and PERSISTENT and A_TMA and B_TMA:
        offs_e = tl.arange(0, BLOCK_E)
        counts = tl.load(expert_count_ptr + offs_e, mask=offs_e < E, other=0)
        expert_steps = tl.cdiv(counts, BLOCK_K)
        steps = tl.max(expert_steps, axis=0)
        # flat: every tile runs `steps` steps; at most half again the steps of the plain loop
        if (steps <= FLAT_STEPS) & (2 * steps * E <= 3 * tl.sum(expert_steps, axis=0)):
            _wgrad_flat_tiles(a_desc, b_desc, c_ptr, c_desc, expert_start_ptr, expert_count_ptr, E, M, N, P,
                              steps, stride_ce, stride_cm, stride_cn, C_TMA, UPCAST, PRECISION, BLOCK_M, BLOCK_N,
                              BLOCK_K, GROUP_M)
        else:
            _wgrad_looped_tiles(a_ptr, b_ptr, a_desc, b_desc, c_ptr, c_desc, rows_ptr, expert_start_ptr,
                                expert_count_ptr, E, M, N, stride_am, stride_ak, stride_bm, stride_bk, stride_ce,
                                stride_cm, stride_cn, GATHER_A, GATHER_B, TOPK, A_TMA, B_TMA, C_TMA, UPCAST,
                                PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    elif PERSISTENT:
        _wgrad_looped_tiles(a_ptr, b_ptr, a_desc, b_desc, c_ptr, c_desc, rows_ptr, expert_start_ptr,
                            expert_count_ptr, E, M, N, stride_am, stride_ak, stride_bm, stride_bk, stride_ce,
                            stride_cm, stride_cn, GATHER_A, GATHER_B, TOPK, A_TMA, B_TMA, C_TMA, UPCAST,
                            PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    else:
        _wgrad_tile(tl.program_id(0), a_ptr, b_ptr, a_desc, b_desc, c_ptr, c_desc, rows_ptr, expert_start_ptr,
                    expert_count_ptr, M, N, stride_am, stride_ak, stride_bm, stride_bk, stride_ce, stride_cm,
                    stride_cn, GATHER_A, GATHER_B, TOPK, A_TMA, B_TMA, C_TMA, UPCAST, PRECISION,
                    BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


@triton.jit
def _wgrad_looped_tiles(
    a_ptr, b_ptr, a_desc, b_desc, c_ptr, c_desc, rows_ptr, expert_start_ptr, expert_count_ptr, E, M, N,
    stride_am, stride_ak, stride_bm, stride_bk, stride_ce, stride_cm, stride_cn,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, TOPK: tl.constexpr,
    A_TMA: tl.constexpr, B_TMA: tl.constexpr, C_TMA: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """The persistent programs' plain loop: one `_wgrad_tile` after another, each with its own K loop."""
    num_tiles = E * tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        _wgrad_tile(tile, a_ptr, b_ptr, a_desc, b_desc, c_ptr, c_desc, rows_ptr, expert_start_ptr,
                    expert_count_ptr, M, N, stride_am, stride_ak, stride_bm, stride_bk, stride_ce, stride_cm,
                    stride_cn, GATHER_A, GATHER_B, TOPK, A_TMA, B_TMA, C_TMA, UPCAST, PRECISION,
                    BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


@triton.jit
def _wgrad_tile_coords(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(expert, M-block, N-block) of an expert-major tile index. Within an expert, GROUP_M M-strips
    sweep the N tiles together (1: row by row), so that the CTAs in flight share their operand
    strips in L2 (an expert's gathered rows can pass 30 MB)."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # int64: e * stride_ce passes 2**31 for DeepSeek-V3's dW_gate_up ([256, 4096, 7168]); in int32
    # it wraps and writes out of bounds.
    e = (tile // (num_m * num_n)).to(tl.int64)
    rest = tile % (num_m * num_n)
    per_group = GROUP_M * num_n
    first_m = (rest // per_group) * GROUP_M
    group_size = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (rest % per_group) % group_size
    pid_n = (rest % per_group) // group_size
    return e, pid_m, pid_n


@triton.jit
def _wgrad_store(acc, e, pid_m, pid_n, c_ptr, c_desc, M, N, stride_ce, stride_cm, stride_cn,
                 C_TMA: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    if C_TMA:  # one bulk async store per tile (the box is clipped at M and N)
        c_desc.store([e.to(tl.int32), pid_m * BLOCK_M, pid_n * BLOCK_N],
                     _to(acc, c_desc.dtype, UPCAST).reshape(1, BLOCK_M, BLOCK_N))
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        c_ptrs = c_ptr + e * stride_ce + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(c_ptrs, _to(acc, c_ptr.dtype.element_ty, UPCAST), mask=c_mask)


@triton.jit
def _wgrad_flat_tiles(a_desc, b_desc, c_ptr, c_desc, expert_start_ptr, expert_count_ptr, E, M, N, P, steps,
                      stride_ce, stride_cm, stride_cn, C_TMA: tl.constexpr, UPCAST: tl.constexpr,
                      PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """The persistent tile loop of `_grouped_wgrad_kernel` with FLAT_STEPS: `steps` K steps per
    tile for every tile, both operands by TMA, tile loop and K loop flattened into one."""
    num_tiles = E * tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
        e, pid_m, pid_n = _wgrad_tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        start = tl.load(expert_start_ptr + e)  # int32: descriptor coordinates are 32-bit
        count = tl.load(expert_count_ptr + e)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(0, steps):
            # past the expert's rows: a box at row P, wholly outside both [P, *] buffers (zeros)
            row = tl.where(ks * BLOCK_K < count, start + ks * BLOCK_K, P)
            a = a_desc.load([row, pid_m * BLOCK_M])
            b = b_desc.load([row, pid_n * BLOCK_N])
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
        _wgrad_store(acc, e, pid_m, pid_n, c_ptr, c_desc, M, N, stride_ce, stride_cm, stride_cn, C_TMA, UPCAST,
                     BLOCK_M, BLOCK_N)


@triton.jit
def _wgrad_tile(
    tile, a_ptr, b_ptr, a_desc, b_desc, c_ptr, c_desc, rows_ptr, expert_start_ptr, expert_count_ptr, M, N,
    stride_am, stride_ak, stride_bm, stride_bk, stride_ce, stride_cm, stride_cn,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, TOPK: tl.constexpr,
    A_TMA: tl.constexpr, B_TMA: tl.constexpr, C_TMA: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of `_grouped_wgrad_kernel` (tile = expert-major tile index)."""
    e, pid_m, pid_n = _wgrad_tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    start32 = tl.load(expert_start_ptr + e)  # int32: descriptor coordinates are 32-bit
    start = start32.to(tl.int64)
    end = start + tl.load(expert_count_ptr + e).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for p0 in range(start, end, BLOCK_K):
        p = p0 + offs_kk
        p_mask = p < end
        flat = tl.load(rows_ptr + p, mask=p_mask, other=-1)
        valid = flat >= 0
        tok = tl.where(valid, flat // TOPK, 0).to(tl.int64)
        ra = tok if GATHER_A else p
        rb = tok if GATHER_B else p
        if A_TMA:
            a = a_desc.load([start32 + (p0 - start).to(tl.int32), pid_m * BLOCK_M])
        else:
            a = tl.load(a_ptr + ra[:, None] * stride_am + offs_m[None, :] * stride_ak,
                        mask=valid[:, None] & (offs_m[None, :] < M), other=0.0)  # [BLOCK_K, BLOCK_M]
        if B_TMA:
            b = b_desc.load([start32 + (p0 - start).to(tl.int32), pid_n * BLOCK_N])
        else:
            b_mask = valid[:, None] & (offs_n[None, :] < N)
            b_ptrs = b_ptr + rb[:, None] * stride_bm + offs_n[None, :] * stride_bk
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
    _wgrad_store(acc, e, pid_m, pid_n, c_ptr, c_desc, M, N, stride_ce, stride_cm, stride_cn, C_TMA, UPCAST,
                 BLOCK_M, BLOCK_N)


@triton.jit
def _gather_rows_kernel(src_ptr, rows_ptr, row_expert_ptr, out_ptr, P, H, stride_s, stride_sh, stride_o,
                        TOPK: tl.constexpr, ALIGN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[p] = src[rows[p] // TOPK], zero on an expert's padding rows; blocks past the last expert
    are left alone (no kernel reads them). Makes a wgrad operand that TMA can load (no gather)."""
    r0 = tl.program_id(0) * BLOCK_R  # BLOCK_R divides ALIGN: one expert per program
    if tl.load(row_expert_ptr + (r0 // ALIGN) * ALIGN) < 0:
        return
    offs_r = r0 + tl.arange(0, BLOCK_R)
    flat = tl.load(rows_ptr + offs_r, mask=offs_r < P, other=-1)
    valid = flat >= 0
    src_rows = tl.where(valid, flat // TOPK, 0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h[None, :] < H
    v = tl.load(src_ptr + src_rows[:, None] * stride_s + offs_h[None, :] * stride_sh, mask=valid[:, None] & h_mask,
                other=0.0)
    tl.store(out_ptr + offs_r.to(tl.int64)[:, None] * stride_o + offs_h[None, :], v,
             mask=(offs_r[:, None] < P) & h_mask)


@triton.jit
def _combine_kernel(
    y_ptr, pos_ptr, w_ptr, out_ptr, H, stride_ym, stride_wt, stride_wk, stride_om,
    TOPK: tl.constexpr, HAS_W: tl.constexpr, RNE: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[t] = sum_k w[t, k] * y[pos[t, k]] over pos >= 0, in fp32, rounded once."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOPK):
        p = tl.load(pos_ptr + t * TOPK + k).to(tl.int64)
        if p >= 0:
            v = tl.load(y_ptr + p * stride_ym + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                v = v * tl.load(w_ptr + t * stride_wt + k * stride_wk).to(tl.float32)
            acc += v
    tl.store(out_ptr + t * stride_om + offs, _to(acc, out_ptr.dtype.element_ty, RNE), mask=mask)
