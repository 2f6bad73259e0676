"""Token-major Triton kernels of `fused_experts` for a few tokens (a bucket's "decode" key).

Why: at decode (T of 1 to a few) the grouped-GEMM pipeline is four launches - align rows, gate/up,
down, combine - over MMA tiles at least 16 rows tall of which one row is real, and ~200 tiles of
[16, 32] do not keep an H200's 132 SMs streaming weights. Here each (token, k) pair reads its
expert's weight rows directly, as a matrix-vector product on the CUDA cores with many small
programs resident at once, and the down projection sums the K experts of a token in the same
program, so there is no row alignment and no combine:
  1. `_decode_gate_up_kernel`, grid (T*K, I / BLOCK_N): h[t*K + k] = silu(Wg[e] @ x[t]) * (Wu[e] @ x[t])
  2. `_decode_down_kernel`, grid (T, H / BLOCK_N): out[t] = sum_k w[t, k] * (Wd[e] @ h[t*K + k])
fp32 accumulation; h rounded to x's dtype (as the grouped path stores it); the output rounded once.
Ids outside [0, E) contribute nothing (their h rows are never written nor read). A weight read
once per (token, k): for T = 1 that is each touched expert once; where tokens share experts
(larger T, few experts) the grouped path reads less, hence the bucket's `max_tokens`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._experts_sm80 import _to


@triton.jit
def _decode_gate_up_kernel(
    x_ptr, w_ptr, idx_ptr, h_ptr, H, I, E,
    stride_xt, stride_xh, stride_it, stride_ik, stride_we, stride_wn, stride_wk, stride_hm,
    TOPK: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
    x_ptrs = x_ptr + t * stride_xt + offs_k * stride_xh
    # elementwise products in a 2-D accumulator, reduced once after the loop
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_mask = offs_k < H - k0
        xv = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        mask = n_mask[:, None] & k_mask[None, :]
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
    TOPK: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk
    for k0 in range(0, I, BLOCK_K):
        k_mask = offs_k < I - k0
        # the K experts' tiles of this chunk are independent loads, all in flight together (no
        # software pipelining here: the loads do not feed an MMA, so Triton keeps them in registers)
        for k in tl.static_range(TOPK):
            e = tl.load(idx_ptr + t * stride_it + k * stride_ik).to(tl.int64)
            valid = (e >= 0) & (e < E)
            wt = tl.load(wts_ptr + t * stride_wt + k * stride_wtk).to(tl.float32)
            hv = tl.load(h_ptr + (t * TOPK + k) * stride_hm + k0 + offs_k, mask=k_mask & valid,
                         other=0.0).to(tl.float32)
            wv = tl.load(w_rows + tl.where(valid, e, 0) * stride_we + k0 * stride_wk,
                         mask=n_mask[:, None] & (k_mask & valid)[None, :], other=0.0).to(tl.float32)
            acc += wv * (hv * wt)[None, :]
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + t * stride_om + offs_n, _to(out, out_ptr.dtype.element_ty, UPCAST), mask=n_mask)
