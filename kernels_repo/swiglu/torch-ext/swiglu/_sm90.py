"""SwiGLU kernels for capability 90 (H100/H200): a persistent grid of SM-resident programs.

Hopper's 3.3-4.8 TB/s needs ~30 KiB in flight per SM (bandwidth x ~0.8 us latency / 132 SMs).
The grid is exactly `CTAS_PER_SM` programs per SM, each walking tiles with a grid stride, so
every program is resident from the start (no late second wave) and no CTA is launched per tile.
Residency is guaranteed by capping registers (`maxnreg`): 10 programs x 128 threads x 48
registers fit the 65536 of an SM. Per thread and tensor, the forward moves two 16-byte vectors
per tile (4 KiB tiles), the backward one (2 KiB tiles, three inputs); at 48 registers ptxas
issues all of a tile's loads before the first use (checked in the SASS: more vectors, or a
32-register cap, serialise them). In flight per SM: 1280 threads x 64 B = 80 KiB forward,
x 48 B = 60 KiB backward. `tools/compile_probe.py` checks the cap holds without spills.
Kernels and launch configs only: devices are handled in `ops.py`.
"""

import triton
import triton.language as tl

from ._sm80 import tile_shape, warps_for
from ._tiles import swiglu_bwd_tile, swiglu_fwd_tile

TILE_BYTES = 4096
BWD_TILE_BYTES = 2048
MIN_TILE_BYTES = 1024
NUM_WARPS = 4
CTAS_PER_SM = 10
# maxnreg guarantees the residency the persistent grid assumes; num_stages=1 keeps the loop's loads
# in registers (no shared-memory staging that would cut residency). GPU-only options.
OPTIONS: dict = {"maxnreg": 65536 // (CTAS_PER_SM * NUM_WARPS * 32) // 8 * 8, "num_stages": 1}


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
