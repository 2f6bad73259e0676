"""sm90 grouped GEMMs of `fused_experts` written in Gluon (Triton's explicit dialect): on fp8
block-quantized operands, and on 16-bit ones.

Why not plain Triton: with per-K-block scales, Triton waits for every MMA right after issuing it
(`tools/probe_fp8_promotion.py`: `warp_group_dot_wait` pendings 0 in every scaled form), and its
8-warp tiles synchronize both warpgroups at every K step, so the tensor cores idle while each
K-block's product is scaled. One warpgroup cannot hide that itself either: ptxas moves every read
of an MMA-written accumulator after the wait for all MMAs in flight. So these kernels are warp
specialized the way DeepGEMM's are: a 1-warp producer issues the TMA loads into a ring of stages,
and two 4-warp consumers each own 64 rows of the 128-row tile. fp8: a consumer scales its
accumulators (the RESCALE form of `_fp8_kernels`: kept divided by the last K-block's combined
scale, multiplied by previous / this scale before the MMAs accumulate in place) and waits for its
own MMAs; with no barrier between the consumers, one scales while the other's MMAs run. 16-bit
(no scales): a consumer keeps one K step's MMAs in flight while it waits for the previous step's,
the software pipelining Triton does, in the same warp-specialized frame (the producer never waits
for the math to issue loads).

Each tile holds two [128, 128] accumulators over one [256, BK] weight stage (two TMA boxes; BK =
128 bytes of K: 128 fp8 or 64 16-bit columns):
  GATED (gate/up): the gate rows and the up rows of 128 columns of h; the epilogue makes
    h = silu(gate) * up and stores it (fp8: with one scale per row, one quantization group, as the
    Triton kernel's QUANT_C epilogue does; 16-bit: as is), so no fp32 intermediate reaches memory;
  else (down): 256 consecutive output columns, stored 16-bit.
Rows are the expert-aligned rows of `_experts_routing` (128-row alignment: each row block has one
expert); A [P, K] in row order and the weight [E, N, K] (seen as [E * N, K]) by TMA, outputs by TMA
store. One persistent program per SM walks its tiles in groups of `group_m` row blocks, column
tiles within a group and row blocks fastest within a column (group_m 1: column tiles fastest);
the producer runs up to STAGES K steps ahead, into the next tile. fp8 scales that are not positive
are taken as 1 (their rows or blocks hold zeros). Constraints (`applies`): whole 128-column tiles
of h / 256-column tiles of the output within each expert, TMA-aligned K, a capability 9.0 device
(wgmma, warp specialization).
"""

from __future__ import annotations

import functools

import torch

from kernelhub.device import CachedLaunch, device_capability

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
SMEM = 232448  # shared memory per block on an H100 (227 KB)
# registers a thread: 12 warps of 168 fill the register file, which the partitions' setmaxnreg
# splits 232 / 232 / 40 (consumers, producer)
MAXNREG = 168
# Launches so far: a call that made one is not recorded for replay (its weight descriptors view the
# weights as [E * N, K], which a replay's plan does not rebuild)
launches = [0]

if gluon is not None:
    SCALE = gl.constexpr(128)  # rows and columns of a weight scale block, columns of an activation group

    @gluon.jit
    def _tile_coords(tile, num_m, N, group_m, GATED: gl.constexpr):
        """(first row, first output column, weight rows of the two boxes within the expert). Tiles in
        groups of `group_m` row blocks: the programs running at once share a few row blocks (A read
        from memory once) and a few column tiles of their experts' weights. group_m 1 (the fp8 shapes,
        whose few column tiles all run at once): column tiles fastest; Mixtral-sized weights (112
        column tiles) need groups, or each row block would stream the whole expert again."""
        n_tiles = N // 256
        first = (tile // (group_m * n_tiles)) * group_m
        rows = gl.minimum(num_m - first, group_m)
        within = tile % (group_m * n_tiles)
        m0 = (first + within % rows) * 128
        tn = within // rows
        if GATED:
            col = tn * 128
            return m0, col, col, N // 2 + col
        col = tn * 256
        return m0, col, col, col + 128

    @gluon.jit
    def _num_tiles(start_ptr, count_ptr, N, E, GATED: gl.constexpr):
        """(tiles of this program, row blocks used): the used rows are read on the device (no sync)."""
        used = gl.load(start_ptr + E - 1) + gl.cdiv(gl.load(count_ptr + E - 1), 128) * 128
        num_m = gl.cdiv(used, 128)
        num_tiles = num_m * (N // 256)  # (GATED: N // 2 // 128 columns of h)
        pid = gl.program_id(0)
        return gl.cdiv(gl.maximum(num_tiles - pid, 0), gl.num_programs(0)), num_m

    @gluon.jit
    def _producer(args):
        """One warp: the TMA loads of every K step of this program's tiles, STAGES ahead at most."""
        (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, as_ptr, bs_ptr, cs_ptr, row_expert_ptr,
         start_ptr, count_ptr, P, N, K, E, stride_asm, stride_bse, stride_bsn, stride_csm, group_m) = args
        # gate/up writes two 64-row halves of h, down four [64, 128] quarters: GATED from the buffers'
        # type (triton 3.6 passes a worker partition's constexpr argument as a runtime value)
        GATED: gl.constexpr = c_bufs.type.shape[0] == 2
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        BK: gl.constexpr = a_bufs.type.shape[2]
        my_tiles, num_m = _num_tiles(start_ptr, count_ptr, N, E, GATED)
        num_k = gl.cdiv(K, BK)
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        g = 0
        for t in range(my_tiles):
            m0, col, r0, r1 = _tile_coords(pid + t * nprog, num_m, N, group_m, GATED)
            base = gl.load(row_expert_ptr + m0) * N
            for kb in range(num_k):
                s = g % STAGES
                mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)  # (a fresh barrier: passes)
                bar = ready.index(s)
                mbarrier.expect(bar, a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [m0, kb * BK], bar, a_bufs.index(s))
                b = b_bufs.index(s)
                tma.async_copy_global_to_shared(b_desc, [base + r0, kb * BK], bar, b.slice(0, 128))
                tma.async_copy_global_to_shared(b_desc, [base + r1, kb * BK], bar, b.slice(128, 128))
                g += 1

    @gluon.jit
    def _positive(v):
        return gl.where(v > 0, v, 1.0)

    @gluon.jit
    def _mainloop_scaled(a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, rows, P, e, r0, r1, stride_asm, stride_bse,
                         stride_bsn, num_k, g, acc0, acc1, HALF: gl.constexpr):
        """fp8: per K-block rescale, wait for the stage, MMAs, wait for them, free it. Returns the
        accumulators with the last scales applied and the stage counter."""
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        row_layout: gl.constexpr = gl.SliceLayout(1, acc0.type.layout)
        a_at = as_ptr + rows.to(gl.int64) * stride_asm
        b_at = bs_ptr + e * stride_bse
        b0_at = b_at + (r0 // SCALE) * stride_bsn
        b1_at = b_at + (r1 // SCALE) * stride_bsn
        fa = gl.full((64,), 1.0, gl.float32, row_layout)
        f0 = gl.to_tensor(1.0)
        f1 = gl.to_tensor(1.0)
        ca = gl.load(a_at, mask=rows < P, other=1.0)
        c0 = gl.load(b0_at)
        c1 = gl.load(b1_at)
        for kb in range(num_k):
            ca = _positive(ca)
            c0 = _positive(c0)
            c1 = _positive(c1)
            ra = fa / ca
            acc0 = acc0 * (ra * (f0 / c0))[:, None]
            acc1 = acc1 * (ra * (f1 / c1))[:, None]
            fa = ca
            f0 = c0
            f1 = c1
            s = g % STAGES
            mbarrier.wait(ready.index(s), (g // STAGES) & 1)
            a = a_bufs.index(s).slice(HALF * 64, 64)
            b = b_bufs.index(s)
            tok0 = warpgroup_mma(a, b.slice(0, 128).permute((1, 0)), acc0, is_async=True)
            tok1 = warpgroup_mma(a, b.slice(128, 128).permute((1, 0)), acc1, is_async=True)
            kn = gl.minimum(kb + 1, num_k - 1)  # (the next K-block's scales load while the MMAs run)
            ca = gl.load(a_at + kn, mask=rows < P, other=1.0)
            c0 = gl.load(b0_at + kn)
            c1 = gl.load(b1_at + kn)
            acc0, acc1 = warpgroup_mma_wait(0, deps=(tok0, tok1))
            mbarrier.arrive(empty.index(s), count=1)
            g += 1
        return acc0 * (fa * f0)[:, None], acc1 * (fa * f1)[:, None], g

    @gluon.jit
    def _mainloop_16bit(a_bufs, b_bufs, ready, empty, num_k, g, acc0, acc1, HALF: gl.constexpr):
        """16-bit: this K step's MMAs in flight while the previous step's finish; a stage is freed
        once its MMAs are done. Returns the accumulators and the stage counter."""
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        for kb in range(num_k):
            s = g % STAGES
            mbarrier.wait(ready.index(s), (g // STAGES) & 1)
            a = a_bufs.index(s).slice(HALF * 64, 64)
            b = b_bufs.index(s)
            tok0 = warpgroup_mma(a, b.slice(0, 128).permute((1, 0)), acc0, is_async=True)
            tok1 = warpgroup_mma(a, b.slice(128, 128).permute((1, 0)), acc1, is_async=True)
            acc0, acc1 = warpgroup_mma_wait(2, deps=(tok0, tok1))  # (the previous step's two are done)
            if kb > 0:
                mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), count=1)
            g += 1
        acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
        mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), count=1)
        return acc0, acc1, g

    @gluon.jit
    def _pass_stages(ready, empty, num_k, g):
        """A half tile of padding rows only: no MMAs, but each stage still waited for and freed in
        turn (an early arrival would count towards an earlier use of the stage)."""
        STAGES: gl.constexpr = ready.type.shape[0]
        for _ in range(num_k):
            s = g % STAGES
            mbarrier.wait(ready.index(s), (g // STAGES) & 1)
            mbarrier.arrive(empty.index(s), count=1)
            g += 1
        return g

    @gluon.jit
    def _epilogue(acc0, acc1, c_desc, c_bufs, cs_ptr, rows, P, m0, col, stride_csm, GATED: gl.constexpr,
                  SCALED: gl.constexpr, HALF: gl.constexpr):
        """The half tile's outputs by TMA store (gated: h, fp8 with its scales or 16-bit)."""
        tma.store_wait(pendings=0)  # (this consumer's last stores have left its buffers)
        if GATED:
            h = acc0 / (1.0 + gl.exp(-acc0)) * acc1  # h = silu(gate) * up
            c = c_bufs.index(HALF)
            if SCALED:  # one quantization group per row (amax floor: reference_fp8's)
                amax = gl.maximum(gl.max(gl.abs(h), axis=1), 1e-4)
                c.store((h * (448.0 / amax)[:, None]).to(c_desc.dtype))
                gl.store(cs_ptr + rows.to(gl.int64) * stride_csm + col // 128, amax / 448.0, mask=rows < P)
            else:
                c.store(h.to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [m0 + HALF * 64, col], c)
        else:
            c = c_bufs.index(2 * HALF)
            c.store(acc0.to(c_desc.dtype))
            d = c_bufs.index(2 * HALF + 1)
            d.store(acc1.to(c_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [m0 + HALF * 64, col], c)
            tma.async_copy_shared_to_global(c_desc, [m0 + HALF * 64, col + 128], d)

    @gluon.jit
    def _consumer(args, HALF: gl.constexpr):
        """Rows [HALF * 64, +64) of every tile: the main loop, then the epilogue; a half holding only
        padding rows (the expert's last row block, often at medium loads) skips both, so the other
        half's MMAs have the tensor cores to themselves. Those rows of the output are not written."""
        (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, as_ptr, bs_ptr, cs_ptr, row_expert_ptr,
         start_ptr, count_ptr, P, N, K, E, stride_asm, stride_bse, stride_bsn, stride_csm, group_m) = args
        GATED: gl.constexpr = c_bufs.type.shape[0] == 2  # (as in _producer)
        BK: gl.constexpr = a_bufs.type.shape[2]
        BITS: gl.constexpr = a_desc.dtype.primitive_bitwidth
        SCALED: gl.constexpr = BITS == 8
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, 128, 256 // BITS])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        my_tiles, num_m = _num_tiles(start_ptr, count_ptr, N, E, GATED)
        num_k = gl.cdiv(K, BK)
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        g = 0
        for t in range(my_tiles):
            m0, col, r0, r1 = _tile_coords(pid + t * nprog, num_m, N, group_m, GATED)
            e = gl.load(row_expert_ptr + m0)
            first = m0 + HALF * 64
            if first < gl.load(start_ptr + e) + gl.load(count_ptr + e):
                rows = first + gl.arange(0, 64, layout=row_layout)
                acc0 = gl.zeros((64, 128), gl.float32, mma_layout)
                acc1 = gl.zeros((64, 128), gl.float32, mma_layout)
                if SCALED:
                    acc0, acc1, g = _mainloop_scaled(a_bufs, b_bufs, ready, empty, as_ptr, bs_ptr, rows, P,
                                                     e.to(gl.int64), r0, r1, stride_asm, stride_bse, stride_bsn,
                                                     num_k, g, acc0, acc1, HALF)
                else:
                    acc0, acc1, g = _mainloop_16bit(a_bufs, b_bufs, ready, empty, num_k, g, acc0, acc1, HALF)
                _epilogue(acc0, acc1, c_desc, c_bufs, cs_ptr, rows, P, m0, col, stride_csm, GATED, SCALED, HALF)
            else:
                g = _pass_stages(ready, empty, num_k, g)
        tma.store_wait(pendings=0)

    # The two consumers: worker functions take no constexpr (triton 3.6 would pass it as a runtime
    # value), so each half is its own function over the one args tuple.
    @gluon.jit
    def _consumer_lo(args):
        _consumer(args, 0)

    @gluon.jit
    def _consumer_hi(args):
        _consumer(args, 1)

    @gluon.jit
    def _gluon_grouped_gemm_kernel(as_ptr, bs_ptr, cs_ptr, row_expert_ptr, start_ptr, count_ptr,
                                   a_desc, b_desc, c_desc,  # (CachedLaunch.split's order: tensors, extras, ints)
                                   P, N, K, E, stride_asm, stride_bse, stride_bsn, stride_csm, group_m,
                                   GATED: gl.constexpr, STAGES: gl.constexpr):
        """Launched with num_warps=4: the default partition is the first consumer. fp8 operands
        (scales as_ptr, bs_ptr; gated: h's scales to cs_ptr) or 16-bit ones (those pointers unread)."""
        BK: gl.constexpr = a_desc.block_type.shape[1]
        gl.static_assert(a_desc.block_type.shape[0] == 128)
        gl.static_assert(BK * a_desc.dtype.primitive_bitwidth == 1024)  # (128 bytes: the 128B swizzle)
        gl.static_assert(b_desc.block_type.shape[0] == 128)
        gl.static_assert(b_desc.block_type.shape[1] == BK)
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, 128, BK], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, 256, BK], b_desc.layout)
        c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2 if GATED else 4, 64, 128], c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # (both consumers)
        args = (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, as_ptr, bs_ptr, cs_ptr, row_expert_ptr,
                start_ptr, count_ptr, P, N, K, E, stride_asm, stride_bse, stride_bsn, stride_csm, group_m)
        gl.warp_specialize([(_consumer_lo, (args,)), (_consumer_hi, (args,)), (_producer, (args,))], [4, 1],
                           [232, 40])


# (a cached launcher: Triton's `kernel[grid]` costs tens of us of Python per launch)
_launch = CachedLaunch(_gluon_grouped_gemm_kernel, maxnreg=MAXNREG) if gluon is not None else None


def available() -> bool:
    return gluon is not None


def applies(device: torch.device, weight: torch.Tensor, scale_inv: torch.Tensor | None, block_m: int,
            gated: bool) -> bool:
    """Whether `gemm` can run a stage with this weight [E, N, K]: Gluon present, a capability 9.0
    device (wgmma; sm89 runs the Triton kernel), 128-row alignment, whole tiles within each expert
    (gated: N // 2 a multiple of 128; else N of 256), a contiguous fp8 (with scales of unit K-block
    stride) or 16-bit weight with TMA-aligned rows."""
    if gluon is None or device.type != "cuda" or device_capability(device) != 90:
        return False
    if weight.dtype not in _GL_DTYPES or (weight.dtype == torch.float8_e4m3fn) != (scale_inv is not None):
        return False
    E, N, K = weight.shape
    tiles_fit = (N % 2 == 0 and (N // 2) % 128 == 0) if gated else N % 256 == 0
    return (block_m == BLOCK_M and tiles_fit and (K * weight.element_size()) % 16 == 0 and K > 0
            and weight.is_contiguous() and weight.data_ptr() % 16 == 0
            and (scale_inv is None or scale_inv.stride(2) == 1))


def stages_that_fit(gated: bool, out_bytes: int, wanted: int) -> int:
    """`wanted` K-step stages, fewer where they and the output buffers exceed shared memory."""
    per_stage = (128 + 256) * 128 + 16  # A and two weight boxes of 128 bytes a row, and two barriers
    out = (2 if gated else 4) * 64 * 128 * out_bytes
    return max(2, min(wanted, (SMEM - out - 1024) // per_stage))


_GL_DTYPES = {torch.float8_e4m3fn: "float8e4nv", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@functools.cache
def _smem_layout(block: tuple[int, int], dtype: torch.dtype):
    """The swizzle Triton picks for a `block` box of `dtype` (once per kind: `gemm` is on the call path)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, _GL_DTYPES[dtype]))


def _descriptor(t: torch.Tensor, block: list[int]):
    """A Gluon TMA descriptor over 2-D t loading `block` boxes."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _smem_layout(tuple(block), t.dtype))


def gemm(a, a_scale, weight, scale_inv, out, out_scale, routing, sm_count: int, stages: int = 4,
         group_m: int = 1, gated: bool | None = None) -> None:
    """For the used rows of `routing` (128-row alignment; rows past them, and 64-row halves of
    padding rows only, are not written), a [P, K] in row order:
      down (not gated): out[p] = A[p] @ W[e(p)]^T (out [P, N] 16-bit);
      gate/up (gated, W [E, 2I, K]): h = silu(A W_gate^T) * (A W_up^T) as out [P, I].
    fp8 (a and weight float8_e4m3fn): a_scale [P, cdiv(K, 128)] and scale_inv
    [E, cdiv(N, 128), cdiv(K, 128)] fp32, and gated means out_scale is given (h as fp8 with
    out_scale [P, I // 128]). 16-bit: the scales None, `gated` says which GEMM. `group_m`: row
    blocks per group of the tile order. Call with a's device current."""
    E, N, K = weight.shape
    scaled = a.dtype == torch.float8_e4m3fn
    if gated is None:
        gated = out_scale is not None
    tiles = (routing.num_rows // BLOCK_M) * (N // 256)
    if tiles == 0:
        return
    bk = 128 // a.element_size()
    a_desc = _descriptor(a, [BLOCK_M, bk])
    b_desc = _descriptor(weight.view(E * N, K), [128, bk])
    c_desc = _descriptor(out, [64, 128])
    stages = stages_that_fit(gated, out.element_size(), stages)
    launches[0] += 1
    # (16-bit: the scale pointers are not read; any tensor of the device stands in)
    a_scale = a_scale if scaled else routing.expert_count
    _launch.split(
        (min(tiles, sm_count),), a.get_device(),
        (a_scale, scale_inv if scaled else a_scale, out_scale if scaled and gated else a_scale, routing.row_expert,
         routing.expert_start, routing.expert_count),
        (routing.num_rows, N, K, E, a_scale.stride(0) if scaled else 0, scale_inv.stride(0) if scaled else 0,
         scale_inv.stride(1) if scaled else 0, out_scale.stride(0) if scaled and gated else 0, group_m),
        (gated, stages), num_warps=4, extras=(a_desc, b_desc, c_desc))
