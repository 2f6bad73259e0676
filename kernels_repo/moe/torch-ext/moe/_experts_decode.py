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
Ids outside [0, E) contribute nothing (their h rows are never written nor read). A weight read
once per (token, k): for T = 1 that is each touched expert once; where tokens share experts
(larger T, few experts) the grouped path reads less, hence the bucket's `max_tokens`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._experts_kernels import _to


@triton.jit
def _decode_gate_up_kernel(
    x_ptr, w_ptr, idx_ptr, h_ptr, H, I, E,
    stride_xt, stride_xh, stride_it, stride_ik, stride_we, stride_wn, stride_wk, stride_hm,
    TOPK: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    LOAD_STAGES: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)  # t * TOPK + k
    t = pair // TOPK
    e = tl.load(idx_ptr + t * stride_it + (pair % TOPK) * stride_ik).to(tl.int64)
    if (e < 0) | (e >= E):
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk
    u_ptrs = g_ptrs + I * stride_wn
    # x in the weight tile's layout (constant along BLOCK_N), as in the down kernel: no shared-memory
    # re-layout of a [BLOCK_K] vector every step
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
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + pair * stride_hm + offs_n, _to(h, h_ptr.dtype.element_ty, UPCAST), mask=n_mask)


@triton.jit
def _decode_down_kernel(
    h_ptr, w_ptr, idx_ptr, wts_ptr, out_ptr, H, I, E,
    stride_hm, stride_it, stride_ik, stride_we, stride_wn, stride_wk, stride_wt, stride_wtk, stride_om,
    TOPK: tl.constexpr, TOPK_P: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, LOAD_STAGES: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
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
