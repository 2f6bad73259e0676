"""Token-major Triton kernels of `fused_experts` on fp8 weights for a few tokens (a bucket's "decode").

Why, as for the 16-bit path (`_experts_decode`): at decode (T of 1 to a few) the time is the
weight bytes, and the grouped pipeline's four launches over 16-row MMA tiles with one real row
leave the SMs short of bytes in flight. Here each (token, k) pair reads its expert's fp8 weight
rows directly as a matrix-vector product on the CUDA cores (many small programs resident), and
the down projection sums the token's K experts in one program, so there is no row alignment, no
activation quantization (W8A16 math, on every capability) and no combine:
  1. `_fp8_decode_gate_up_kernel`, grid (T*K, I / BLOCK_N): h[t*K + k] = silu(Wg[e] x[t]) * (Wu[e] x[t])
  2. `_fp8_decode_down_kernel`, grid (T, H / BLOCK_N): out[t] = sum_k w[t, k] * (Wd[e] h[t*K + k])
Weights: fp8 pointers where Triton has them (sm89+, the interpreter), else uint8 bits converted
exactly (`_e4m3_bits`, W_BITS). A K step is BLOCK_K columns: a divisor of the 128-column scale
block, or whole scale blocks (their loads are not software-pipelined, so a wide step is what keeps
bytes in flight); the tile is [.., NB, KC] with one scale per weight row and KC-column chunk:
acc += w * (x * s). PREFETCH: the loads of step k+1 are issued before step k's math (registers
carry them across the loop; down: the weights and scales, h being small and in L2), two steps'
bytes in flight per program without a wider step's registers. LOAD_STAGES > 1: the K loop's
loads software-pipelined by Triton (cp.async into shared memory, LOAD_STAGES - 1 steps ahead),
bytes in flight without the registers to hold them; Triton pipelines loads that feed no MMA only
in a loop that asks for it (`tl.range(num_stages=)`).
PDL (down, sm90): the down kernel is launched as a programmatic dependent of gate/up (which lets
it launch from its start, TRIGGER): its programs start while gate/up's last ones run, read the
token's expert ids and weights, and wait for h (`griddepcontrol.wait`) before their first load of
it; with PREFETCH (which carries the weights and scales, not h) the first step's weight tile is
loaded before that wait, so a wide first step streams most of a program's weights while gate/up
finishes. Inline PTX: off in the interpreter (the launcher passes False there).
fp32 accumulation; h stored in x's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._experts_kernels import _to
from ._fp8_kernels import _e4m3_bits


@triton.jit
def _fp32_weight(w, W_BITS: tl.constexpr):
    if W_BITS:  # uint8 e4m3 bits -> fp16 (value / 256) -> fp32, exact
        return _e4m3_bits(w).to(tl.float32) * 256.0
    return w.to(tl.float32)


@triton.jit
def _k_chunks(BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr):
    """A K step as [NB, KC] offsets, KC inside one scale block: BLOCK_K itself where it divides the
    scale block (NB = 1), else NB whole scale blocks. Returns (offsets, per-chunk start)."""
    KC: tl.constexpr = BLOCK_K if BLOCK_K < SCALE_K else SCALE_K
    chunk = tl.arange(0, BLOCK_K // KC) * KC
    return chunk[:, None] + tl.arange(0, KC)[None, :], chunk


@triton.jit
def _gate_up_tiles(x_ptrs, g_ptrs, u_ptrs, gs_ptrs, us_ptrs, k0, H, n_mask, offs_k, chunk, SCALE_K: tl.constexpr):
    """K step k0's x (fp32), gate/up scales and raw gate/up weight tiles; all masked past H (a step
    at or past H loads nothing)."""
    mask = n_mask[:, None, None] & (offs_k < H - k0)[None, :, :]
    s_mask = n_mask[:, None] & (chunk < H - k0)[None, :]
    kb = ((k0 + chunk) // SCALE_K)[None, :]
    xv = tl.load(x_ptrs + k0, mask=mask, other=0.0).to(tl.float32)
    sg = tl.load(gs_ptrs + kb, mask=s_mask, other=0.0)[:, :, None]
    su = tl.load(us_ptrs + kb, mask=s_mask, other=0.0)[:, :, None]
    return xv, sg, su, tl.load(g_ptrs + k0, mask=mask, other=0.0), tl.load(u_ptrs + k0, mask=mask, other=0.0)


@triton.jit
def _down_weights(w_ptrs, s_ptrs, k0, I, row_ok, offs_k, chunk, SCALE_K: tl.constexpr):
    """K step k0's scales and raw weight tiles of the token's K experts; masked past I. (Not h:
    these are the loads a PDL down program may issue before gate/up is done.)"""
    mask = row_ok[:, :, :, None] & (offs_k < I - k0)[None, None, :, :]
    s_mask = row_ok & (chunk < I - k0)[None, None, :]
    s = tl.load(s_ptrs + ((k0 + chunk) // SCALE_K)[None, None, :], mask=s_mask, other=0.0)
    return s, tl.load(w_ptrs + k0, mask=mask, other=0.0)


@triton.jit
def _fp8_decode_gate_up_kernel(
    x_ptr, w_ptr, ws_ptr, idx_ptr, h_ptr, H, I, E,
    stride_xt, stride_it, stride_ik, stride_we, stride_wn, stride_wse, stride_wsn, stride_hm,
    TOPK: tl.constexpr, W_BITS: tl.constexpr, UPCAST: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, LOAD_STAGES: tl.constexpr,
    TRIGGER: tl.constexpr,
):
    if TRIGGER:  # the down kernel (a programmatic dependent) may launch once every program got here
        gdc_launch_dependents()
    pair = tl.program_id(0).to(tl.int64)  # t * TOPK + k
    t = pair // TOPK
    e = tl.load(idx_ptr + t * stride_it + (pair % TOPK) * stride_ik).to(tl.int64)
    if (e < 0) | (e >= E):
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    gs_ptrs = ws_ptr + e * stride_wse + (offs_n // SCALE_N)[:, None] * stride_wsn
    us_ptrs = ws_ptr + e * stride_wse + ((offs_n + I) // SCALE_N)[:, None] * stride_wsn
    offs_k, chunk = _k_chunks(BLOCK_K, SCALE_K)  # [NB, KC], [NB]
    g_ptrs = w_ptr + e * stride_we + offs_n[:, None, None].to(tl.int64) * stride_wn + offs_k[None, :, :]
    u_ptrs = g_ptrs + I * stride_wn
    # x in the weight tile's layout (constant along BLOCK_N), as `_experts_decode` does
    x_ptrs = x_ptr + t * stride_xt + (offs_n * 0)[:, None, None] + offs_k[None, :, :]
    acc_g = tl.zeros((BLOCK_N, BLOCK_K // SCALE_K if BLOCK_K > SCALE_K else 1,
                      SCALE_K if BLOCK_K > SCALE_K else BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros_like(acc_g)
    if PREFETCH:
        nxt = _gate_up_tiles(x_ptrs, g_ptrs, u_ptrs, gs_ptrs, us_ptrs, 0, H, n_mask, offs_k, chunk, SCALE_K)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=LOAD_STAGES):
        if PREFETCH:  # the next step's loads issued before this step's math: two steps' bytes in flight
            xv, sg, su, wg, wu = nxt
            nxt = _gate_up_tiles(x_ptrs, g_ptrs, u_ptrs, gs_ptrs, us_ptrs, k0 + BLOCK_K, H, n_mask, offs_k, chunk,
                                 SCALE_K)
        else:
            xv, sg, su, wg, wu = _gate_up_tiles(x_ptrs, g_ptrs, u_ptrs, gs_ptrs, us_ptrs, k0, H, n_mask, offs_k,
                                                chunk, SCALE_K)
        acc_g += _fp32_weight(wg, W_BITS) * (xv * sg)
        acc_u += _fp32_weight(wu, W_BITS) * (xv * su)
    g = tl.sum(tl.sum(acc_g, axis=2), axis=1)  # (both tiles' accumulators are 3-D)
    u = tl.sum(tl.sum(acc_u, axis=2), axis=1)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + pair * stride_hm + offs_n, _to(h, h_ptr.dtype.element_ty, UPCAST), mask=n_mask)


@triton.jit
def _fp8_decode_down_kernel(
    h_ptr, w_ptr, ws_ptr, idx_ptr, wts_ptr, out_ptr, H, I, E,
    stride_hm, stride_it, stride_ik, stride_we, stride_wn, stride_wse, stride_wsn, stride_wt, stride_wtk,
    stride_om,
    TOPK: tl.constexpr, TOPK_P: tl.constexpr, W_BITS: tl.constexpr, UPCAST: tl.constexpr, SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
    LOAD_STAGES: tl.constexpr, PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k, chunk = _k_chunks(BLOCK_K, SCALE_K)  # [NB, KC], [NB]
    # the token's K experts side by side ([TOPK_P, BLOCK_N, NB, KC] tiles: all their bytes in
    # flight together), as `_experts_decode._decode_down_kernel`
    slot = tl.arange(0, TOPK_P)
    e = tl.load(idx_ptr + t * stride_it + slot * stride_ik, mask=slot < TOPK, other=-1).to(tl.int64)
    valid = (slot < TOPK) & (e >= 0) & (e < E)
    e = tl.where(valid, e, 0)
    wt = tl.load(wts_ptr + t * stride_wt + slot * stride_wtk, mask=valid, other=0.0).to(tl.float32)
    h_ptrs = (h_ptr + (t * TOPK + slot)[:, None, None, None] * stride_hm + (offs_n * 0)[None, :, None, None]
              + offs_k[None, None, :, :])
    w_ptrs = (w_ptr + e[:, None, None, None] * stride_we + offs_n[None, :, None, None].to(tl.int64) * stride_wn
              + offs_k[None, None, :, :])
    # [TOPK_P, BLOCK_N, 1] + the K blocks
    s_ptrs = ws_ptr + e[:, None, None] * stride_wse + (offs_n // SCALE_N)[None, :, None] * stride_wsn
    row_ok = valid[:, None, None] & n_mask[None, :, None]
    if PREFETCH:  # the first step's weights: under PDL in flight while gate/up still runs
        nxt = _down_weights(w_ptrs, s_ptrs, 0, I, row_ok, offs_k, chunk, SCALE_K)
    if PDL:  # h is the gate/up kernel's: wait for it (and its writes) before any load of it
        gdc_wait()
    # one accumulator per expert, summed once after the loop (as `_experts_decode`)
    acc = tl.zeros((TOPK_P, BLOCK_N, BLOCK_K // SCALE_K if BLOCK_K > SCALE_K else 1,
                    SCALE_K if BLOCK_K > SCALE_K else BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, I, BLOCK_K, num_stages=LOAD_STAGES):
        if PREFETCH:
            s, wv = nxt
            nxt = _down_weights(w_ptrs, s_ptrs, k0 + BLOCK_K, I, row_ok, offs_k, chunk, SCALE_K)
        else:
            s, wv = _down_weights(w_ptrs, s_ptrs, k0, I, row_ok, offs_k, chunk, SCALE_K)
        h_mask = row_ok[:, :, :, None] & (offs_k < I - k0)[None, None, :, :]
        hv = tl.load(h_ptrs + k0, mask=h_mask, other=0.0).to(tl.float32)
        acc += _fp32_weight(wv, W_BITS) * (hv * (s * wt[:, None, None])[:, :, :, None])
    out = tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=0)
    tl.store(out_ptr + t * stride_om + offs_n, _to(out, out_ptr.dtype.element_ty, UPCAST), mask=n_mask)
