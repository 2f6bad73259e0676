"""Token-major Triton kernels of `fused_experts` for a few tokens (a bucket's "decode" key).

Why: at decode (T of 1 to a few) the grouped-GEMM pipeline is four launches - align rows, gate/up,
down, combine - over MMA tiles at least 16 rows tall of which one row is real, and ~200 tiles of
[16, 32] do not keep a Hopper's 132 SMs streaming weights. Here each (token, k) pair reads its
expert's weight rows directly, as a matrix-vector product on the CUDA cores with many small
programs resident at once, and the down projection sums the K experts of a token in the same
program, so there is no row alignment and no combine:
  1. `_decode_gate_up_kernel`, grid (T*K, I / BLOCK_N): h[t*K + k] = silu(Wg[e] @ x[t]) * (Wu[e] @ x[t])
  2. `_decode_down_kernel`, grid (T, H / BLOCK_N): out[t] = sum_k w[t, k] * (Wd[e] @ h[t*K + k])
fp32 accumulation; h rounded to x's dtype (as the grouped path stores it); the output rounded once.
LOAD_STAGES > 1: the K loop's loads software-pipelined by Triton (cp.async into shared memory,
LOAD_STAGES - 1 steps ahead); Triton pipelines loads that feed no MMA only where the loop asks.
VEC > 0: the K step as runs of VEC columns (a thread's own vector where VEC is its share of the
tile), products summed over each run in registers, so the accumulators hold one value per run, not
per weight (the down kernel with the K experts' rows as one axis): far fewer registers at the wide
tiles (sm90 ptxas: down (8, 256, 8 warps) holds 166 a thread without it).
Ids outside [0, E) contribute nothing (their h rows are never written nor read). A weight read
once per (token, k): for T = 1 that is each touched expert once; where tokens share experts
(larger T, few experts) the grouped path reads less, hence the bucket's `max_tokens`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._experts_kernels import _to


@triton.jit
def _token_expert_rows(idx_ptr, wts_ptr, t, stride_it, stride_ik, stride_wt, stride_wtk, E, H,
                       TOPK: tl.constexpr, TOPK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """A down program's K experts' weight rows as one axis, r = slot * BLOCK_N + n (the VEC tiles
    of both dtypes): each row's slot, output column, expert (0 where dropped), whether it counts
    (a real slot, an id in [0, E), a column below H) and its routing weight."""
    r = tl.arange(0, TOPK_P * BLOCK_N)
    slot_r = r // BLOCK_N
    n_r = tl.program_id(1) * BLOCK_N + r % BLOCK_N
    e_r = tl.load(idx_ptr + t * stride_it + slot_r * stride_ik, mask=slot_r < TOPK, other=-1).to(tl.int64)
    ok_r = (slot_r < TOPK) & (e_r >= 0) & (e_r < E) & (n_r < H)
    wt_r = tl.load(wts_ptr + t * stride_wt + slot_r * stride_wtk, mask=ok_r, other=0.0).to(tl.float32)
    return slot_r, n_r, tl.where(ok_r, e_r, 0), ok_r, wt_r


@triton.jit
def _decode_gate_up_kernel(
    x_ptr, w_ptr, idx_ptr, h_ptr, H, I, E,
    stride_xt, stride_xh, stride_it, stride_ik, stride_we, stride_wn, stride_wk, stride_hm,
    TOPK: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    LOAD_STAGES: tl.constexpr, VEC: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)  # t * TOPK + k
    t = pair // TOPK
    e = tl.load(idx_ptr + t * stride_it + (pair % TOPK) * stride_ik).to(tl.int64)
    if (e < 0) | (e >= E):
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    if VEC > 0:  # [BLOCK_N, BLOCK_K // VEC, VEC] tiles, summed over each run in registers
        offs_v = (tl.arange(0, BLOCK_K // VEC) * VEC)[:, None] + tl.arange(0, VEC)[None, :]
        gv_ptrs = (w_ptr + e * stride_we + offs_n[:, None, None].to(tl.int64) * stride_wn
                   + offs_v[None, :, :] * stride_wk)
        uv_ptrs = gv_ptrs + I * stride_wn
        xv_ptrs = x_ptr + t * stride_xt + (offs_n * 0)[:, None, None] + offs_v[None, :, :] * stride_xh
        acc_g = tl.zeros((BLOCK_N, BLOCK_K // VEC), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K // VEC), dtype=tl.float32)
        for k0 in tl.range(0, H, BLOCK_K, num_stages=LOAD_STAGES):
            mask_v = n_mask[:, None, None] & (offs_v < H - k0)[None, :, :]
            xvv = tl.load(xv_ptrs, mask=mask_v, other=0.0).to(tl.float32)
            acc_g += tl.sum(tl.load(gv_ptrs, mask=mask_v, other=0.0).to(tl.float32) * xvv, axis=2)
            acc_u += tl.sum(tl.load(uv_ptrs, mask=mask_v, other=0.0).to(tl.float32) * xvv, axis=2)
            gv_ptrs += BLOCK_K * stride_wk
            uv_ptrs += BLOCK_K * stride_wk
            xv_ptrs += BLOCK_K * stride_xh
    else:
        offs_k = tl.arange(0, BLOCK_K)
        g_ptrs = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk
        u_ptrs = g_ptrs + I * stride_wn
        # x in the weight tile's layout (constant along BLOCK_N), as in the down kernel: no
        # shared-memory re-layout of a [BLOCK_K] vector every step
        x_ptrs = x_ptr + t * stride_xt + (offs_n * 0)[:, None] + offs_k[None, :] * stride_xh
        # elementwise products in a 2-D accumulator, reduced once after the loop
        acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, H, BLOCK_K, num_stages=LOAD_STAGES):
            k_mask = offs_k < H - k0
            mask = n_mask[:, None] & k_mask[None, :]
            xv = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
            acc_g += tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32) * xv
            acc_u += tl.load(u_ptrs, mask=mask, other=0.0).to(tl.float32) * xv
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_wk
            x_ptrs += BLOCK_K * stride_xh
    g = tl.sum(acc_g, axis=1)  # (a value per run or per weight: both [BLOCK_N, n])
    u = tl.sum(acc_u, axis=1)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + pair * stride_hm + offs_n, _to(h, h_ptr.dtype.element_ty, UPCAST), mask=n_mask)


@triton.jit
def _decode_down_kernel(
    h_ptr, w_ptr, idx_ptr, wts_ptr, out_ptr, H, I, E,
    stride_hm, stride_it, stride_ik, stride_we, stride_wn, stride_wk, stride_wt, stride_wtk, stride_om,
    TOPK: tl.constexpr, TOPK_P: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, LOAD_STAGES: tl.constexpr, VEC: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    if VEC > 0:  # the K experts' rows as one axis of [R, BLOCK_K // VEC, VEC] tiles
        slot_r, n_r, e_r, ok_r, wt_r = _token_expert_rows(idx_ptr, wts_ptr, t, stride_it, stride_ik, stride_wt,
                                                          stride_wtk, E, H, TOPK, TOPK_P, BLOCK_N)
        offs_v = (tl.arange(0, BLOCK_K // VEC) * VEC)[:, None] + tl.arange(0, VEC)[None, :]
        hv_ptrs = h_ptr + (t * TOPK + slot_r)[:, None, None] * stride_hm + offs_v[None, :, :]
        wv_ptrs = (w_ptr + e_r[:, None, None] * stride_we + n_r[:, None, None].to(tl.int64) * stride_wn
                   + offs_v[None, :, :] * stride_wk)
        acc_v = tl.zeros((TOPK_P * BLOCK_N, BLOCK_K // VEC), dtype=tl.float32)
        for k0 in tl.range(0, I, BLOCK_K, num_stages=LOAD_STAGES):
            mask_v = ok_r[:, None, None] & (offs_v < I - k0)[None, :, :]
            hvv = tl.load(hv_ptrs, mask=mask_v, other=0.0).to(tl.float32)
            wvv = tl.load(wv_ptrs, mask=mask_v, other=0.0).to(tl.float32)
            acc_v += tl.sum(wvv * hvv, axis=2) * wt_r[:, None]
            hv_ptrs += BLOCK_K
            wv_ptrs += BLOCK_K * stride_wk
        out = tl.sum(tl.reshape(tl.sum(acc_v, axis=1), (TOPK_P, BLOCK_N)), axis=0)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        # the token's K experts side by side (TOPK_P: K rounded up to a power of two, the rest masked),
        # so that each chunk's [K, BLOCK_N, BLOCK_K] weight tile is one load: all K experts' bytes in
        # flight together (these loads feed no MMA: Triton pipelines them only with LOAD_STAGES > 1)
        slot = tl.arange(0, TOPK_P)
        e = tl.load(idx_ptr + t * stride_it + slot * stride_ik, mask=slot < TOPK, other=-1).to(tl.int64)
        valid = (slot < TOPK) & (e >= 0) & (e < E)
        wt = tl.load(wts_ptr + t * stride_wt + slot * stride_wtk, mask=valid, other=0.0).to(tl.float32)
        # h in the weight tile's layout ([K, BLOCK_N, BLOCK_K], constant along BLOCK_N): each warp loads
        # the rows it multiplies (L1 hits), where a [K, BLOCK_K] load would be re-laid out through
        # shared memory every step
        h_ptrs = (h_ptr + (t * TOPK + slot)[:, None, None] * stride_hm + (offs_n * 0)[None, :, None]
                  + offs_k[None, None, :])
        w_ptrs = (w_ptr + tl.where(valid, e, 0)[:, None, None] * stride_we
                  + offs_n[None, :, None].to(tl.int64) * stride_wn + offs_k[None, None, :] * stride_wk)
        w_mask = valid[:, None, None] & n_mask[None, :, None]
        # one accumulator per expert, summed once after the loop: a sum over the experts' axis in the
        # loop would go through shared memory (with barriers) on every step
        acc = tl.zeros((TOPK_P, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, I, BLOCK_K, num_stages=LOAD_STAGES):
            k_mask = offs_k < I - k0
            mask = w_mask & k_mask[None, None, :]
            hv = tl.load(h_ptrs, mask=mask, other=0.0).to(tl.float32)
            wv = tl.load(w_ptrs, mask=mask, other=0.0).to(tl.float32)
            acc += wv * (hv * wt[:, None, None])
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        out = tl.sum(tl.sum(acc, axis=2), axis=0)
    tl.store(out_ptr + t * stride_om + offs_n, _to(out, out_ptr.dtype.element_ty, UPCAST), mask=n_mask)
