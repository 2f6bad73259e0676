"""Triton grouped GEMM of `fused_experts` on fp8 block-quantized expert weights.

One kernel, two maths (rows: the expert-aligned buffer of `_experts_routing`, as the bf16 path):
  W8A16 (sm80, no fp8 tensor cores): fp8 weight tile -> activation dtype in registers (exact: every
    e4m3 value is a bf16/fp16 value), tl.dot with the 16-bit activations, then the K-block's
    weight scales per output column: acc += dot(a, w) * s_w[None, :]. Triton refuses fp8e4nv
    pointers below sm89, so these weights arrive as uint8 and are converted by bits (`_e4m3_bits`).
  FP8 (sm89/sm90 fp8 tensor cores): activations quantized per row and 128-column group, either in
    the load (QUANT_A: the gate/up GEMM reads x and quantizes each tile, once per column tile) or
    before (fp8 A with its scales: x from `_quantize_x_kernel`, one pass per token; the down GEMM
    reads the h that the gate/up epilogue stored as fp8 with its scales, QUANT_C), then
    acc += dot(a_fp8, w_fp8) * s_a[:, None] * s_w[None, :] per K-block of 128 (fp32 accumulation of
    each scaled K-block product). sm90: weights (B_TMA) and the down GEMM's h (A_TMA) by TMA.
BLOCK_K divides the scale block's 128 columns (SCALE_K; = 128 where x is quantized in the load),
so each K step has one weight scale per output column and one activation scale per row.
EPILOGUE 1 (gate/up): h = silu(gate) * up in fp32, stored in the activation dtype or (QUANT_C,
BLOCK_N = 128 columns = one group) as fp8 plus a scale per row.

EMULATE (the CPU interpreter): triton 3.7.1's interpreter loads fp8 and converts fp8 -> wider
types exactly, and its fp8 tl.dot is exact, but its fp32 -> fp8 conversion drops the carry of a
round-up into the next binade (127.8 -> 64 instead of 128). There the quantization rounds to the
e4m3 grid in fp32 bit arithmetic (`_round_e4m3`) and dots run on fp32 operands holding fp8 values
(bf16 tl.dot is wrong in the interpreter too).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._experts_kernels import _to


@triton.jit
def _round_e4m3(v):
    """fp32 v (|v| <= 448) rounded to the nearest e4m3fn value (ties to even), kept in fp32."""
    bits = v.to(tl.uint32, bitcast=True)
    # normal e4m3 (|v| >= 2**-6): 3 mantissa bits, round the other 20 away (a carry moves the exponent)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # subnormal e4m3: multiples of 2**-9; adding 1.5 * 2**14 rounds there (fp32 spacing 2**-9)
    magic = 24576.0
    sub = (v + magic) - magic
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def _e4m3_bits(b):
    """uint8 e4m3fn bits -> fp16 holding value / 256, exactly: the sign moved to bit 15 and the 7
    exponent+mantissa bits to bits 7-13 (an fp16 exponent bias 8 above e4m3's; e4m3 subnormals land
    on fp16 subnormals). NaN (0x7F) is not kept (checkpoints hold none). The caller scales by 256."""
    h = b.to(tl.uint16)
    return (((h & 0x80) << 8) | ((h & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def _to_fp8(v, EMULATE: tl.constexpr):
    if EMULATE:
        return _round_e4m3(v)
    return v.to(tl.float8e4nv)


@triton.jit
def _quantize_rows(v, EMULATE: tl.constexpr):
    """(fp8 values, fp32 scale per row) of an fp32 [BM, 128] tile: one group per row. 448: e4m3fn's
    largest value; 1e-4: the smallest amax (reference_fp8's AMAX_MIN: zeros get a finite scale)."""
    amax = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-4)
    return _to_fp8(v * (448.0 / amax)[:, None], EMULATE), amax / 448.0


@triton.jit
def _weight_tile(b_ptr, bs_ptr, b_desc, e, offs_k, offs_n, n0, k0, k_blk, n_limit, K, stride_be, stride_bn,
                 stride_bk, stride_bse, stride_bsn, stride_bsk, SCALE_N: tl.constexpr, B_TMA: tl.constexpr,
                 ONE_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp8 (or its uint8 bits) tile [BLOCK_K, BLOCK_N] of expert e's weight [N, K] and its scales per
    column (zero past n_limit), or (ONE_SCALE: the tile's columns lie in one scale block) that one
    scale, shape [1] (it broadcasts as the columns' would). B_TMA: one TMA copy of the
    [1, BLOCK_N, BLOCK_K] box at (e, n0, k0);
    out-of-box rows and columns read zero, rows of the next half (gate past N: up rows) only
    where the caller's columns are discarded or multiplied by zero (see the kernel)."""
    n_ok = offs_n < n_limit
    if B_TMA:
        b = tl.trans(b_desc.load([e.to(tl.int32), n0, k0]).reshape(BLOCK_N, BLOCK_K))
    else:
        ptrs = b_ptr + e * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
        b = tl.load(ptrs, mask=(offs_k[:, None] < K) & n_ok[None, :], other=0.0)
    if ONE_SCALE:  # (columns past n_limit: zero weights, or discarded; see the kernel)
        s = tl.load(bs_ptr + e * stride_bse + (n0 // SCALE_N) * stride_bsn + k_blk * stride_bsk + tl.arange(0, 1))
    else:
        s = tl.load(bs_ptr + e * stride_bse + (offs_n // SCALE_N) * stride_bsn + k_blk * stride_bsk, mask=n_ok,
                    other=0.0)
    return b, s


@triton.jit
def _k_step(acc, a, b, a_s, s, pa, prev, FP8_DOT: tl.constexpr, RESCALE: tl.constexpr, PRECISION: tl.constexpr):
    """acc after one K step: a @ b scaled by the activations' scales a_s (per row; fp8 math) and the
    weights' s (per column, or shape [1] where the tile lies in one scale block), the factor formed
    before it meets the [BLOCK_M, BLOCK_N] product (with [1] scales a column: one multiply per
    element). RESCALE (see `_fp8_gemm_kernel`): acc kept divided by this step's scales, pa and prev
    the last step's; a zero (masked) scale taken as 1. Returns (acc, this step's s)."""
    if FP8_DOT and RESCALE:
        s = tl.where(s > 0, s, 1.0)
        acc = tl.dot(a, b.to(a.dtype), acc * ((pa / a_s)[:, None] * (prev / s)[None, :]), input_precision=PRECISION)
    elif FP8_DOT:  # (EMULATE: fp32 from fp8, exact; else fp8 stays fp8)
        acc += tl.dot(a, b.to(a.dtype), input_precision=PRECISION) * (a_s[:, None] * s[None, :])
    else:  # uint8 bits -> fp16 (value / 256) -> activation dtype, both exact
        acc += tl.dot(a, _e4m3_bits(b).to(a.dtype), input_precision=PRECISION) * (s * 256.0)[None, :]
    return acc, s


@triton.jit
def _quantize_x_kernel(x_ptr, q_ptr, s_ptr, rows_ptr, T, H, stride_xt, stride_qt, stride_st,
                       EMULATE: tl.constexpr, ROWS: tl.constexpr, TOPK: tl.constexpr, BLOCK_T: tl.constexpr,
                       GROUP: tl.constexpr):
    """x [T, H] -> fp8 [T, H] and fp32 scales [T, cdiv(H, GROUP)], per token and GROUP-column group:
    the rounding of the GEMM's in-load quantization (`_quantize_rows`), done once per token instead
    of once per column tile of the gate/up GEMM. ROWS: T counts the aligned buffer's rows instead,
    row p holding token rows[p] // TOPK (zeros, with a finite scale, for a padding row), so that
    the gate/up GEMM reads A rows in order, by TMA, without a gather. Grid (cdiv(T, BLOCK_T),
    cdiv(H, GROUP))."""
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    g = tl.program_id(1)
    offs_h = g * GROUP + tl.arange(0, GROUP)
    h_ok = offs_h[None, :] < H
    if ROWS:
        flat = tl.load(rows_ptr + offs_t, mask=offs_t < T, other=-1)
        src = tl.where(flat >= 0, flat // TOPK, 0).to(tl.int64)
        load_ok = (flat >= 0)[:, None] & h_ok
    else:
        src = offs_t
        load_ok = (offs_t[:, None] < T) & h_ok
    v = tl.load(x_ptr + src[:, None] * stride_xt + offs_h[None, :], mask=load_ok, other=0.0).to(tl.float32)
    q, s = _quantize_rows(v, EMULATE)
    tl.store(q_ptr + offs_t[:, None] * stride_qt + offs_h[None, :], q.to(q_ptr.dtype.element_ty),
             mask=(offs_t[:, None] < T) & h_ok)
    tl.store(s_ptr + offs_t * stride_st + g, s, mask=offs_t < T)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, cs_ptr, rows_ptr, row_expert_ptr, start_ptr, count_ptr,
    b_desc, a_desc,  # after the pointers: CachedLaunch.split's order (tensors, extras, ints, constexprs)
    P, N, K, B_N_TOTAL, E,
    stride_am, stride_ak, stride_asm, stride_be, stride_bn, stride_bk, stride_bse, stride_bsn, stride_bsk,
    stride_cm, stride_cn, stride_csm,
    EPILOGUE: tl.constexpr,   # 0: C = A @ B^T; 1: C = silu(A @ Bg^T) * (A @ Bu^T), Bu = rows N.. of B
    GATHER_A: tl.constexpr,   # A row of buffer row p: rows[p] // TOPK (a token); else p
    TOPK: tl.constexpr,
    FP8_DOT: tl.constexpr,    # fp8 x fp8 products (activations quantized); else W8A16
    QUANT_A: tl.constexpr,    # FP8_DOT: A is 16/32-bit, quantized per row and K-block in the load
    QUANT_C: tl.constexpr,    # EPILOGUE 1: store h as fp8 with a scale per row and column tile
    EMULATE: tl.constexpr,    # interpreter: fp8 casts rounded in fp32, dots on fp32 operands
    PRECISION: tl.constexpr,
    SCALE_N: tl.constexpr,    # rows of a weight scale block
    SCALE_K: tl.constexpr,    # its columns (and an activation scale's): BLOCK_K divides it
    B_TMA: tl.constexpr,      # weights through b_desc (sm90), a TMA descriptor over [E, N, K]
    A_TMA: tl.constexpr,      # A (not gathered, already fp8 or 16-bit) through a_desc over [P, K]
    RESCALE: tl.constexpr,    # FP8_DOT: the accumulator kept divided by the current K-block's scales (below)
    ONE_SCALE: tl.constexpr,  # each tile's columns lie in one weight scale block: one scalar scale per K step
    FUSED: tl.constexpr,      # EPILOGUE 1, ONE_SCALE: gate and up tiles as one B tile, one MMA (below)
    PERSISTENT: tl.constexpr,  # a grid of a few programs per SM looping over the tiles (below)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile: rows [pid_m * BLOCK_M, +BLOCK_M) (one expert's or padding).

    FUSED: b_desc is a 4-D descriptor over the gate/up weight as [E, 2, N, K] whose [1, 2, BLOCK_N,
    BLOCK_K] box holds the gate rows and the up rows of this tile's columns: one [BLOCK_K, 2 BLOCK_N]
    B tile, one MMA group per K step into one [BLOCK_M, 2 BLOCK_N] accumulator (columns: gate, then
    up, each half with its one scale), split into gate and up for the epilogue. Without it the gate
    and up MMAs are two groups, and the first is waited for before the second is issued.

    PERSISTENT (BLOCK_M = the routing's alignment, so every block below the used rows has a real
    first row): min(tiles, n * SMs) programs, each looping over the tiles of the used rows (their
    count read on the device, no host sync) in one flattened, software-pipelined loop, so the next
    tile's loads are in flight during this tile's last MMAs and epilogue. Tiles in the one-program-
    per-tile grid's order (M blocks fastest: consecutive tiles share an expert's weight tile)."""
    if PERSISTENT:
        used = tl.load(start_ptr + E - 1) + tl.cdiv(tl.load(count_ptr + E - 1), BLOCK_M) * BLOCK_M
        num_m = tl.cdiv(used, BLOCK_M)
        for tile in tl.range(tl.program_id(0), num_m * tl.cdiv(N, BLOCK_N), tl.num_programs(0), flatten=True):
            m0 = (tile % num_m).to(tl.int64) * BLOCK_M
            e = tl.load(row_expert_ptr + m0).to(tl.int64)
            _fp8_tile(m0, e, tile // num_m, a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, cs_ptr, rows_ptr, b_desc, a_desc,
                      P, N, K, B_N_TOTAL,
                      stride_am, stride_ak, stride_asm, stride_be, stride_bn, stride_bk, stride_bse, stride_bsn,
                      stride_bsk, stride_cm, stride_cn, stride_csm, EPILOGUE, GATHER_A, TOPK, FP8_DOT, QUANT_A,
                      QUANT_C, EMULATE, PRECISION, SCALE_N, SCALE_K, B_TMA, A_TMA, RESCALE, ONE_SCALE, FUSED,
                      BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        m0 = tl.program_id(0).to(tl.int64) * BLOCK_M
        e = tl.load(row_expert_ptr + m0).to(tl.int64)
        if e >= 0:  # (else a block past the last used row)
            _fp8_tile(m0, e, tl.program_id(1), a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, cs_ptr, rows_ptr, b_desc,
                      a_desc, P, N, K, B_N_TOTAL,
                      stride_am, stride_ak, stride_asm, stride_be, stride_bn, stride_bk, stride_bse, stride_bsn,
                      stride_bsk, stride_cm, stride_cn, stride_csm, EPILOGUE, GATHER_A, TOPK, FP8_DOT, QUANT_A,
                      QUANT_C, EMULATE, PRECISION, SCALE_N, SCALE_K, B_TMA, A_TMA, RESCALE, ONE_SCALE, FUSED,
                      BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _fp8_tile(
    m0, e, pid_n, a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, cs_ptr, rows_ptr, b_desc, a_desc, P, N, K, B_N_TOTAL,
    stride_am, stride_ak, stride_asm, stride_be, stride_bn, stride_bk, stride_bse, stride_bsn, stride_bsk,
    stride_cm, stride_cn, stride_csm,
    EPILOGUE: tl.constexpr, GATHER_A: tl.constexpr, TOPK: tl.constexpr, FP8_DOT: tl.constexpr,
    QUANT_A: tl.constexpr, QUANT_C: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, B_TMA: tl.constexpr, A_TMA: tl.constexpr,
    RESCALE: tl.constexpr, ONE_SCALE: tl.constexpr, FUSED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Rows [m0, m0 + BLOCK_M) of the buffer (expert e's, some maybe padding) x column tile pid_n."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < P
    flat = tl.load(rows_ptr + offs_m, mask=m_mask, other=-1)
    if GATHER_A:
        row_ok = flat >= 0
        a_rows = tl.where(row_ok, flat // TOPK, 0).to(tl.int64)
    else:
        row_ok = m_mask
        a_rows = offs_m
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_kk = tl.arange(0, BLOCK_K)
    if FUSED:
        acc2 = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        pc = tl.full((2 * BLOCK_N,), 1.0, tl.float32)
        left = tl.arange(0, 2 * BLOCK_N) < BLOCK_N
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if EPILOGUE == 1:
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # RESCALE: acc holds sum_k dot_k * c_k / c_last (c_k = s_a[:, None] * s_w[None, :] of K-block k),
    # so each K-block's MMA accumulates in place (acc = dot(a, b, acc * c_prev / c_k)) instead of into
    # a second [BLOCK_M, BLOCK_N] fp32 product: half the accumulator registers. The same sum (the
    # rescaling costs one fp32 rounding per K-block); scales must be positive (every checkpoint's; a
    # masked row's or column's zero is taken as 1: its products are zero).
    pa = tl.full((BLOCK_M,), 1.0, tl.float32)
    if ONE_SCALE:
        pg = tl.full((1,), 1.0, tl.float32)
        pu = tl.full((1,), 1.0, tl.float32)
    else:
        pg = tl.full((BLOCK_N,), 1.0, tl.float32)
        pu = tl.full((BLOCK_N,), 1.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_blk = k0 // SCALE_K  # (QUANT_A: BLOCK_K = SCALE_K, its amax spans one group)
        offs_k = k0 + offs_kk
        if A_TMA:
            a = a_desc.load([m0.to(tl.int32), k0])
        else:
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                        mask=row_ok[:, None] & (offs_k[None, :] < K), other=0.0)
        if FP8_DOT:
            if QUANT_A:
                a, a_s = _quantize_rows(a.to(tl.float32), EMULATE)
            else:  # fp8 A with one scale per row and K-block (x's quantize pass or the gate/up epilogue)
                a_s = tl.load(as_ptr + a_rows * stride_asm + k_blk, mask=row_ok, other=0.0)
                if EMULATE:
                    a = a.to(tl.float32)
        elif EMULATE:
            a = a.to(tl.float32)
        if FP8_DOT and RESCALE:
            a_s = tl.where(a_s > 0, a_s, 1.0)
        elif not FP8_DOT:
            a_s = pa  # (W8A16 scales by the weights' scales alone)
        if FUSED:
            bb = tl.trans(b_desc.load([e.to(tl.int32), 0, n0, k0]).reshape(2 * BLOCK_N, BLOCK_K))
            s_at = bs_ptr + e * stride_bse + k_blk * stride_bsk
            col = tl.where(left, tl.load(s_at + (n0 // SCALE_N) * stride_bsn),
                           tl.load(s_at + ((N + n0) // SCALE_N) * stride_bsn))
            acc2, pc = _k_step(acc2, a, bb, a_s, col, pa, pc, FP8_DOT, RESCALE, PRECISION)
        else:
            b, s = _weight_tile(b_ptr, bs_ptr, b_desc, e, offs_k, offs_n, n0, k0, k_blk, N, K, stride_be,
                                stride_bn, stride_bk, stride_bse, stride_bsn, stride_bsk, SCALE_N, B_TMA, ONE_SCALE,
                                BLOCK_N, BLOCK_K)
            acc, pg = _k_step(acc, a, b, a_s, s, pa, pg, FP8_DOT, RESCALE, PRECISION)
            if EPILOGUE == 1:
                # (B_TMA: gate columns past N read up rows; those columns are never stored and their
                # up columns read zero past 2N, so h is 0 there, as QUANT_C's amax needs)
                bu, su = _weight_tile(b_ptr, bs_ptr, b_desc, e, offs_k, offs_n + N, n0 + N, k0, k_blk, B_N_TOTAL,
                                      K, stride_be, stride_bn, stride_bk, stride_bse, stride_bsn, stride_bsk,
                                      SCALE_N, B_TMA, ONE_SCALE, BLOCK_N, BLOCK_K)
                acc_u, pu = _k_step(acc_u, a, bu, a_s, su, pa, pu, FP8_DOT, RESCALE, PRECISION)
        if FP8_DOT and RESCALE:
            pa = a_s
    if FUSED:  # (no column past N: ONE_SCALE with gate/up means N is a multiple of BLOCK_N)
        if FP8_DOT and RESCALE:
            acc2 = acc2 * pa[:, None] * pc[None, :]
        acc, acc_u = tl.split(tl.permute(tl.reshape(acc2, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    elif FP8_DOT and RESCALE:  # back from the last K-block's scales; columns past N to 0 as without
        acc = acc * pa[:, None] * tl.where(offs_n < N, pg, 0.0)[None, :]
        if EPILOGUE == 1:
            acc_u = acc_u * pa[:, None] * tl.where(offs_n + N < B_N_TOTAL, pu, 0.0)[None, :]
    c_mask = m_mask[:, None] & (offs_n[None, :] < N)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    if EPILOGUE == 1:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_u  # silu(gate) * up; columns past N are 0
        if QUANT_C:  # BLOCK_N = 128: this tile's columns are one quantization group of h
            q, q_s = _quantize_rows(acc, EMULATE)
            tl.store(c_ptrs, q.to(c_ptr.dtype.element_ty), mask=c_mask)
            tl.store(cs_ptr + offs_m * stride_csm + pid_n, q_s, mask=m_mask)
        else:
            tl.store(c_ptrs, _to(acc, c_ptr.dtype.element_ty, EMULATE), mask=c_mask)
    else:
        tl.store(c_ptrs, _to(acc, c_ptr.dtype.element_ty, EMULATE), mask=c_mask)
