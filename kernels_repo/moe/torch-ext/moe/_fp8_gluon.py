"""sm90 grouped GEMM on fp8 block-quantized operands written in Gluon (Triton's explicit dialect).

Why not plain Triton: with per-K-block scales, Triton waits for every MMA right after issuing it
(`tools/probe_fp8_promotion.py`: `warp_group_dot_wait` pendings 0 in every scaled form), and its
8-warp tiles synchronize both warpgroups at every K step, so the tensor cores idle while each
K-block's product is scaled. One warpgroup cannot hide that itself either: ptxas moves every read
of an MMA-written accumulator after the wait for all MMAs in flight. So this kernel is warp
specialized the way DeepGEMM's is: a 1-warp producer issues the TMA loads into a ring of stages,
and two 4-warp consumers each own 64 rows of the 128-row tile. A consumer scales its accumulator
(the RESCALE form of `_fp8_kernels`: kept divided by its last K-block's combined scale, multiplied
by previous / this scale before the MMA accumulates in place) and waits for its own MMA; with no
barrier between the consumers, one scales while the other's MMA runs.

C[p, n] = sum_k A[p, k] B[e(p), n, k] * sa[p, k // 128] * sb[e(p), n // 128, k // 128] over the
expert-aligned rows of `_experts_routing` (BLOCK_M = 128 = the alignment: each row block has one
expert), A [P, K] fp8 in row order and B [E, N, K] fp8 (seen as [E * N, K]) by TMA, C [P, N]
16-bit by TMA store. One persistent program per SM walks its tiles (M blocks fastest); the
producer runs up to STAGES K steps ahead, into the next tile. Scales that are not positive are
taken as 1 (their rows or blocks hold zeros). Constraints (`applies`): N % BLOCK_N == 0 (a tile
never reads the next expert's rows), BLOCK_N divides 128 (one weight scale per K step), K % 16 == 0
(TMA strides), a capability 9.0 device (wgmma, warp specialization).
"""

from __future__ import annotations

import torch

from kernelhub.device import device_capability

try:  # triton >= 3.5 ships Gluon with the Hopper wgmma and TMA builtins (3.6 on the GPU image, 3.7 in CI)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - older triton: the Triton kernels run instead
    gluon = None

BLOCK_M = 128  # two consumers of 64 rows
CONSUMER_ROWS = 64
# Launches so far: they bypass `CachedLaunch`, so a call that made one is not recorded for replay
launches = [0]

if gluon is not None:
    SCALE = gl.constexpr(128)  # rows and columns of a weight scale block, columns of an activation group
    BLOCK_K = gl.constexpr(128)  # one scale block per K step

    @gluon.jit
    def _tiles(start_ptr, count_ptr, N, E, BLOCK_N: gl.constexpr):
        """(tiles of this program, row blocks in use): the used rows are read on the device (no sync)."""
        used = gl.load(start_ptr + E - 1) + gl.cdiv(gl.load(count_ptr + E - 1), 128) * 128
        num_m = gl.cdiv(used, 128)
        num_tiles = num_m * (N // BLOCK_N)
        pid = gl.program_id(0)
        return gl.cdiv(gl.maximum(num_tiles - pid, 0), gl.num_programs(0)), num_m

    @gluon.jit
    def _producer(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, as_ptr, bs_ptr, row_expert_ptr,
                  start_ptr, count_ptr, P, N, K, E, stride_asm, stride_bse, stride_bsn):
        """One warp: the TMA loads of every K step of this program's tiles, STAGES ahead at most."""
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        my_tiles, num_m = _tiles(start_ptr, count_ptr, N, E, BLOCK_N)
        num_k = gl.cdiv(K, BLOCK_K)
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        g = 0
        for t in range(my_tiles):
            tile = pid + t * nprog
            m0 = (tile % num_m) * 128
            row_b = gl.load(row_expert_ptr + m0) * N + (tile // num_m) * BLOCK_N
            for kb in range(num_k):
                s = g % STAGES
                mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)  # (a fresh barrier: passes)
                bar = ready.index(s)
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [m0, kb * BLOCK_K], bar, a_bufs.index(s))
                tma.async_copy_global_to_shared(b_desc, [row_b, kb * BLOCK_K], bar, b_bufs.index(s))
                g += 1

    @gluon.jit
    def _consumer(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, as_ptr, bs_ptr, row_expert_ptr,
                  start_ptr, count_ptr, P, N, K, E, stride_asm, stride_bse, stride_bsn, HALF: gl.constexpr):
        """Rows [HALF * 64, +64) of every tile: wait for the stage, rescale, MMA, wait for it, free the stage."""
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        my_tiles, num_m = _tiles(start_ptr, count_ptr, N, E, BLOCK_N)
        num_k = gl.cdiv(K, BLOCK_K)
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        c_smem = c_bufs.index(HALF)
        g = 0
        for t in range(my_tiles):
            tile = pid + t * nprog
            m0 = (tile % num_m) * 128
            n0 = (tile // num_m) * BLOCK_N
            e = gl.load(row_expert_ptr + m0).to(gl.int64)
            rows = m0 + HALF * 64 + gl.arange(0, 64, layout=row_layout)
            a_at = as_ptr + rows.to(gl.int64) * stride_asm
            b_at = bs_ptr + e * stride_bse + (n0 // SCALE) * stride_bsn
            acc = gl.zeros((64, BLOCK_N), gl.float32, mma_layout)
            f = gl.full((64,), 1.0, gl.float32, row_layout)
            c = gl.load(a_at, mask=rows < P, other=1.0) * gl.load(b_at)
            for kb in range(num_k):
                c = gl.where(c > 0, c, 1.0)
                acc = acc * (f / c)[:, None]
                f = c
                s = g % STAGES
                mbarrier.wait(ready.index(s), (g // STAGES) & 1)
                tok = warpgroup_mma(a_bufs.index(s).slice(HALF * 64, 64), b_bufs.index(s).permute((1, 0)), acc,
                                    is_async=True)
                kn = gl.minimum(kb + 1, num_k - 1)  # (the next K-block's scales load while the MMA runs)
                c = gl.load(a_at + kn, mask=rows < P, other=1.0) * gl.load(b_at + kn)
                acc = warpgroup_mma_wait(0, deps=(tok,))
                mbarrier.arrive(empty.index(s), count=1)
                g += 1
            tma.store_wait(pendings=0)  # (this consumer's last store has left its buffer)
            c_smem.store((acc * f[:, None]).to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [m0 + HALF * 64, n0], c_smem)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _consumer_lo(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, as_ptr, bs_ptr, row_expert_ptr,
                     start_ptr, count_ptr, P, N, K, E, stride_asm, stride_bse, stride_bsn):
        _consumer(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, as_ptr, bs_ptr, row_expert_ptr,
                  start_ptr, count_ptr, P, N, K, E, stride_asm, stride_bse, stride_bsn, 0)

    @gluon.jit
    def _consumer_hi(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, as_ptr, bs_ptr, row_expert_ptr,
                     start_ptr, count_ptr, P, N, K, E, stride_asm, stride_bse, stride_bsn):
        _consumer(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, as_ptr, bs_ptr, row_expert_ptr,
                  start_ptr, count_ptr, P, N, K, E, stride_asm, stride_bse, stride_bsn, 1)

    @gluon.jit
    def _fp8_gemm_gluon_kernel(a_desc, b_desc, c_desc, as_ptr, bs_ptr, row_expert_ptr, start_ptr, count_ptr,
                               P, N, K, E, stride_asm, stride_bse, stride_bsn,
                               STAGES: gl.constexpr, num_warps: gl.constexpr):
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        gl.static_assert(a_desc.block_type.shape[0] == 128)
        gl.static_assert(a_desc.block_type.shape[1] == BLOCK_K)
        gl.static_assert(c_desc.block_type.shape[0] == 64)
        gl.static_assert(SCALE % BLOCK_N == 0)
        gl.static_assert(num_warps == 4)
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # (both consumers)
        args = (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, as_ptr, bs_ptr, row_expert_ptr,
                start_ptr, count_ptr, P, N, K, E, stride_asm, stride_bse, stride_bsn)
        gl.warp_specialize([
            (_consumer_lo, args),
            (_consumer_hi, args),
            (_producer, args),
        ], [4, 1], [232, 40])


def available() -> bool:
    return gluon is not None


def applies(device: torch.device, weight: torch.Tensor, block_m: int, block_n: int) -> bool:
    """Whether `gemm` can run a stage with this weight [E, N, K]: Gluon present, a capability 9.0
    device (wgmma; sm89 runs the Triton kernel), 128-row alignment, whole column tiles within each
    expert, a contiguous weight with TMA-aligned rows."""
    if gluon is None or device.type != "cuda" or device_capability(device) != 90:
        return False
    E, N, K = weight.shape
    return (block_m == BLOCK_M and 128 % block_n == 0 and N % block_n == 0 and K % 16 == 0 and K > 0
            and weight.is_contiguous() and weight.data_ptr() % 16 == 0)


def _descriptor(t: torch.Tensor, block: list[int]):
    """A Gluon TMA descriptor over 2-D t loading `block` boxes (the swizzle Triton picks for it)."""
    dtype = {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[t.dtype]
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def gemm(a, a_scale, weight, scale_inv, out, routing, sm_count: int, block_n: int = 128, stages: int = 5) -> None:
    """out[p, :] = A[p] @ W[e(p)]^T with the block scales, for the used rows of `routing` (128-row
    alignment); rows past them are not written. a [P, K] fp8 (row order), a_scale [P, cdiv(K, 128)],
    weight [E, N, K] fp8, scale_inv [E, cdiv(N, 128), cdiv(K, 128)] fp32, out [P, N] 16-bit."""
    E, N, K = weight.shape
    P = routing.num_rows
    tiles = (P // BLOCK_M) * (N // block_n)
    if tiles == 0:
        return
    a_desc = _descriptor(a, [BLOCK_M, 128])
    b_desc = _descriptor(weight.view(E * N, K), [block_n, 128])
    c_desc = _descriptor(out, [CONSUMER_ROWS, block_n])
    launches[0] += 1
    _fp8_gemm_gluon_kernel[(min(tiles, sm_count),)](
        a_desc, b_desc, c_desc, a_scale, scale_inv, routing.row_expert, routing.expert_start, routing.expert_count,
        P, N, K, E, a_scale.stride(0), scale_inv.stride(0), scale_inv.stride(1),
        STAGES=stages, num_warps=4, maxnreg=168)
