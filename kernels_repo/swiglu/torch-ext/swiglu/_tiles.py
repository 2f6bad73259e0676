"""The per-tile math shared by both variants: load [BLOCK_M, BLOCK_N], fp32 math, one rounding.

Only the scheduling around a tile differs between generations (`_sm80.py`, `_sm90.py`); the math
must be bit-identical across them, so it lives here once.
"""

import os

import triton
import triton.language as tl

# The interpreter (CPU tests) casts fp32 -> bf16 by truncation, the GPU by round-to-nearest-even; under
# the interpreter the rounding is done on the bits first, so the CPU checks the GPU's one rounding.
# A constexpr: the GPU code is unchanged.
_INTERPRETER_RNE = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _round(v, dtype: tl.constexpr):
    """fp32 -> dtype, rounded to nearest even (the interpreter's bf16 cast truncates)."""
    if _INTERPRETER_RNE and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        v = tl.where(v == v, rounded, v)  # a NaN's carry could reach the exponent: keep NaNs as they are
    return v.to(dtype)


@triton.jit
def _tile_offsets(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
    """Row (int64) and column indices of tile `tile` in row-major tile order, and its mask."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = tile // tiles_n
    pid_n = tile % tiles_n
    # int64 rows: row * stride overflows int32 past 2**31 elements (e.g. 32768 x 65536)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_N:
        # BLOCK_N divides N: a row mask only, constant along the row, so loads stay vectorised
        mask = (rows < M)[:, None]
    else:
        mask = (rows < M)[:, None] & (cols < N)[None, :]
    return rows, cols, mask


@triton.jit
def swiglu_fwd_tile(
    g_ptr, u_ptr, o_ptr,
    tile, M, N,
    stride_gm, stride_gn, stride_um, stride_un, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, PACKED: tl.constexpr,
):
    """out = silu(g) * u on one tile; the output's last dimension is contiguous.

    PACKED: `u_ptr` is the packed [..., 2N] tensor and up starts N columns in.
    """
    rows, cols, mask = _tile_offsets(tile, M, N, BLOCK_M, BLOCK_N, EVEN_N)
    if PACKED:
        u_ptr += N * stride_un
    g = tl.load(g_ptr + rows[:, None] * stride_gm + cols[None, :] * stride_gn, mask=mask, other=0.0)
    u = tl.load(u_ptr + rows[:, None] * stride_um + cols[None, :] * stride_un, mask=mask, other=0.0)
    g = g.to(tl.float32)
    y = g * tl.sigmoid(g) * u.to(tl.float32)
    tl.store(o_ptr + rows[:, None] * stride_om + cols[None, :], _round(y, o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_tile(
    dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr,
    tile, M, N,
    stride_dym, stride_dyn, stride_gm, stride_gn, stride_um, stride_un, stride_dgm, stride_dum,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, PACKED: tl.constexpr,
):
    """dg = dy * u * s * (1 + g * (1 - s)), du = dy * g * s with s = sigmoid(g), recomputed.

    PACKED: `u_ptr` and `du_ptr` are the packed input and gradient; their up halves start N in.
    """
    rows, cols, mask = _tile_offsets(tile, M, N, BLOCK_M, BLOCK_N, EVEN_N)
    if PACKED:
        u_ptr += N * stride_un
        du_ptr += N
    r = rows[:, None]
    c = cols[None, :]
    dy = tl.load(dy_ptr + r * stride_dym + c * stride_dyn, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + r * stride_gm + c * stride_gn, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r * stride_um + c * stride_un, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    silu = g * s
    dg = dy * u * (s + silu * (1.0 - s))
    du = dy * silu
    tl.store(dg_ptr + r * stride_dgm + c, _round(dg, dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + r * stride_dum + c, _round(du, du_ptr.dtype.element_ty), mask=mask)
