"""SwiGLU kernels for capability 80 and the generic GPU path: one tile per program.

Ampere (A100: 1.5-2 TB/s, 108 SMs) saturates HBM with modest bytes in flight per SM, so a plain
grid of small tiles lets the hardware scheduler balance the tail. Forward: 4 KiB per tensor and
tile, 8 warps (one 16-byte vector per thread and tensor); backward (five tensors): 8 KiB, 8 warps.
Tile sizes were chosen by sweep (`tools/sweep_tiles.py`; docs/history/performance-log.md):
1x2048-element forward tiles beat 2x2048 and whole-row tiles (Liger-Kernel's shape).
Kernels and launch configs only: devices are handled in `ops.py`.
"""

import triton
import triton.language as tl

from ._tiles import swiglu_bwd_tile, swiglu_fwd_tile

TILE_BYTES = 4096  # forward
BWD_TILE_BYTES = 8192
NUM_WARPS = 8
MIN_TILE_BYTES = 1024
CTAS_PER_SM_SMALL = 2  # below this many tiles per SM, shrink tiles so every SM gets work


@triton.jit
def _swiglu_fwd_kernel(
    g_ptr, u_ptr, o_ptr,
    M, N,
    stride_gm, stride_gn, stride_um, stride_un, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, PACKED: tl.constexpr,
):
    swiglu_fwd_tile(
        g_ptr, u_ptr, o_ptr, tl.program_id(0), M, N,
        stride_gm, stride_gn, stride_um, stride_un, stride_om,
        BLOCK_M, BLOCK_N, EVEN_N, PACKED,
    )


@triton.jit
def _swiglu_bwd_kernel(
    dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr,
    M, N,
    stride_dym, stride_dyn, stride_gm, stride_gn, stride_um, stride_un, stride_dgm, stride_dum,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, PACKED: tl.constexpr,
):
    swiglu_bwd_tile(
        dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, tl.program_id(0), M, N,
        stride_dym, stride_dyn, stride_gm, stride_gn, stride_um, stride_un, stride_dgm, stride_dum,
        BLOCK_M, BLOCK_N, EVEN_N, PACKED,
    )


def tile_shape(M: int, N: int, tile_elems: int) -> tuple[int, int]:
    """[BLOCK_M, BLOCK_N] of about `tile_elems`: whole power-of-two column blocks where N allows.

    BLOCK_N is the largest power of two dividing N when that is >= 256 (14336 = 7 * 2048, 6144 =
    3 * 2048: no ragged tile), else the next power of two of N, masked.
    """
    pow2_divisor = N & -N
    if pow2_divisor >= 256:
        block_n = min(tile_elems, pow2_divisor)
    else:
        block_n = min(tile_elems, max(16, triton.next_power_of_2(N)))
    block_m = max(1, tile_elems // block_n)
    if M < block_m:
        block_m = triton.next_power_of_2(M)
    return block_m, block_n


def warps_for(block_elems: int, elem_bytes: int, max_warps: int) -> int:
    """Warps such that each thread still moves at least one 16-byte vector per tensor."""
    return max(1, min(max_warps, block_elems * elem_bytes // (16 * 32)))


def config(M: int, N: int, elem_bytes: int, sm_count: int, backward: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, grid) for an [M, N] problem on a device with `sm_count` SMs.

    No register cap: occupancy adapts by itself.
    """
    tile = (BWD_TILE_BYTES if backward else TILE_BYTES) // elem_bytes
    min_tile = MIN_TILE_BYTES // elem_bytes
    while tile > min_tile and M * N < tile * sm_count * CTAS_PER_SM_SMALL:
        tile //= 2
    block_m, block_n = tile_shape(M, N, tile)
    grid = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    return block_m, block_n, warps_for(block_m * block_n, elem_bytes, NUM_WARPS), grid


fwd_kernel = _swiglu_fwd_kernel
bwd_kernel = _swiglu_bwd_kernel
OPTIONS: dict = {}
