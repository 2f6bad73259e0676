"""SwiGLU kernels for capability 90 (H100/H200): a persistent grid of SM-resident programs.

Hopper's 3.3-4.8 TB/s needs ~30 KiB in flight per SM (bandwidth x ~0.8 us latency / 132 SMs).
Each program streams tiles of 8 KiB per tensor in the forward pass (8 warps: two 16-byte vectors
per thread and tensor) and 4 KiB in the backward pass (three inputs: one vector each, so the
live registers stay under the cap), walking the tiles with a grid stride. The grid is exactly
`CTAS_PER_SM` programs per SM, so every program is resident from the start (no late second
wave): 4 x 256 threads per SM, with registers capped at 64 (`maxnreg`) so the four always fit
(65536 registers / 1024 threads). In flight per SM: 4 x 2 x 8 KiB = 64 KiB forward, 4 x 3 x
4 KiB = 48 KiB backward. Kernels and launch configs only: devices are handled in `ops.py`.
"""

import triton
import triton.language as tl

from ._sm80 import tile_shape, warps_for
from ._tiles import swiglu_bwd_tile, swiglu_fwd_tile

TILE_BYTES = 8192
BWD_TILE_BYTES = 4096
MIN_TILE_BYTES = 2048
NUM_WARPS = 8
CTAS_PER_SM = 4
# maxnreg guarantees the residency the persistent grid assumes; num_stages=1 keeps the loop's loads
# in registers (no shared-memory staging that would cut residency). GPU-only options.
OPTIONS: dict = {"maxnreg": 65536 // (CTAS_PER_SM * NUM_WARPS * 32), "num_stages": 1}


@triton.jit
def _swiglu_fwd_persistent_kernel(
    g_ptr, u_ptr, o_ptr,
    M, N,
    stride_gm, stride_gn, stride_um, stride_un, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, PACKED: tl.constexpr,
):
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        swiglu_fwd_tile(
            g_ptr, u_ptr, o_ptr, tile, M, N,
            stride_gm, stride_gn, stride_um, stride_un, stride_om,
            BLOCK_M, BLOCK_N, EVEN_N, PACKED,
        )


@triton.jit
def _swiglu_bwd_persistent_kernel(
    dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr,
    M, N,
    stride_dym, stride_dyn, stride_gm, stride_gn, stride_um, stride_un, stride_dgm, stride_dum,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, PACKED: tl.constexpr,
):
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        swiglu_bwd_tile(
            dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, tile, M, N,
            stride_dym, stride_dyn, stride_gm, stride_gn, stride_um, stride_un, stride_dgm, stride_dum,
            BLOCK_M, BLOCK_N, EVEN_N, PACKED,
        )


def config(M: int, N: int, elem_bytes: int, sm_count: int, backward: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, grid): grid = min(tiles, CTAS_PER_SM * sm_count)."""
    tile = (BWD_TILE_BYTES if backward else TILE_BYTES) // elem_bytes
    min_tile = MIN_TILE_BYTES // elem_bytes
    slots = CTAS_PER_SM * sm_count
    # a small problem (e.g. 64 x 14336) gets smaller tiles rather than idle SMs
    while tile > min_tile and M * N < tile * slots:
        tile //= 2
    block_m, block_n = tile_shape(M, N, tile)
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    return block_m, block_n, warps_for(block_m * block_n, elem_bytes, NUM_WARPS), min(tiles, slots)


fwd_kernel = _swiglu_fwd_persistent_kernel
bwd_kernel = _swiglu_bwd_persistent_kernel
