"""The fp8 token-major decode kernels of `_fp8_decode` written in Gluon (a decode stage's "GLUON"
key, capability 9.0).

Why: the Triton kernels hold x (down: h) in the weight tile's layout, one copy per weight element
(loaded per row, or broadcast through shared memory with a barrier each K step when a thread holds
several rows), and scale every product. Gluon's explicit layouts let each thread load its own run
of 16 columns of x once per K step, keep it in registers for all of its rows, sum each row's 16
products in registers and scale that sum once, with no shared memory: on an H100 the Qwen3-30B-A3B
T=1 gate/up kernel took 13.8-14.4 us against the Triton kernel's 17.8 (s49-2; the down kernel, of
the same form, is not yet timed).

Tiles: gate/up [BLOCK_N, BLOCK_K // 16, 16] weight elements, 16 contiguous bytes (one run) per
thread, the BLOCK_K // 16 runs of a row across a warp's lanes, rows across lanes and warps; down
the same per expert, [TOPK_P, BLOCK_N, BLOCK_K // 16, 16] with the token's experts across warps.
Same arguments, grids and outputs as `_fp8_decode_gate_up_kernel` / `_fp8_decode_down_kernel`
(fp32 sums; rows of dropped ids neither written by gate/up nor read by down), TRIGGER / PDL as
there, without the load-mode keys (fp8 pointers only, so capability 8.9 and up; the launcher asks
for 9.0, where they were compiled and measured).
"""

from __future__ import annotations

import torch

from kernelhub.device import device_capability

try:  # triton >= 3.5 ships Gluon (3.6 on the GPU image, 3.7 in CI)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older triton: the Triton kernel runs instead
    gluon = None

def applies(device: torch.device, w_bits: bool) -> bool:
    """Gluon present, a capability 9.0 device and fp8 weight pointers."""
    return gluon is not None and not w_bits and device.type == "cuda" and device_capability(device) == 90


if gluon is not None:

    @gluon.jit
    def _fp8_decode_gate_up_gluon_kernel(
        x_ptr, w_ptr, ws_ptr, idx_ptr, h_ptr, H, I, E,
        stride_xt, stride_it, stride_ik, stride_we, stride_wn, stride_wse, stride_wsn, stride_hm,
        TOPK: gl.constexpr, SCALE_N: gl.constexpr, SCALE_K: gl.constexpr, BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr, TRIGGER: gl.constexpr,
    ):
        if TRIGGER:  # the down kernel (a programmatic dependent) may launch once every program got here
            gdc_launch_dependents()
        RUNS: gl.constexpr = BLOCK_K // 16
        tile: gl.constexpr = gl.BlockedLayout([1, 1, 16], [32 // RUNS, RUNS, 1], [gl.num_warps(), 1, 1], [2, 1, 0])
        x_layout: gl.constexpr = gl.SliceLayout(0, tile)  # [RUNS, 16]: each thread its own run
        sums: gl.constexpr = gl.SliceLayout(2, tile)  # [BLOCK_N, RUNS]: a row's run sums and scales
        pair = gl.program_id(0).to(gl.int64)  # t * TOPK + k
        t = pair // TOPK
        e = gl.load(idx_ptr + t * stride_it + (pair % TOPK) * stride_ik).to(gl.int64)
        if (e >= 0) & (e < E):
            rows = gl.program_id(1) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, sums))
            row_ok = rows < I
            cols = (gl.expand_dims(gl.arange(0, RUNS, layout=gl.SliceLayout(1, x_layout)), 1) * 16
                    + gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, x_layout)), 0))
            g_ptrs = (w_ptr + e * stride_we + gl.expand_dims(gl.expand_dims(rows, 1), 2).to(gl.int64) * stride_wn
                      + gl.expand_dims(cols, 0))
            u_ptrs = g_ptrs + I * stride_wn
            x_ptrs = x_ptr + t * stride_xt + cols
            run0 = gl.expand_dims(gl.arange(0, RUNS, layout=gl.SliceLayout(0, sums)), 0) * 16  # [1, RUNS]
            gs_ptrs = ws_ptr + e * stride_wse + gl.expand_dims(rows // SCALE_N, 1) * stride_wsn
            us_ptrs = ws_ptr + e * stride_wse + gl.expand_dims((rows + I) // SCALE_N, 1) * stride_wsn
            rows_ok3 = gl.expand_dims(gl.expand_dims(row_ok, 1), 2)
            acc_g = gl.zeros((BLOCK_N, RUNS), gl.float32, sums)
            acc_u = gl.zeros((BLOCK_N, RUNS), gl.float32, sums)
            for k0 in range(0, H, BLOCK_K):
                k_ok = cols < H - k0
                xv = gl.expand_dims(gl.load(x_ptrs + k0, mask=k_ok, other=0.0).to(gl.float32), 0)
                w_ok = rows_ok3 & gl.expand_dims(k_ok, 0)
                wg = gl.load(g_ptrs + k0, mask=w_ok, other=0.0).to(gl.float32)
                wu = gl.load(u_ptrs + k0, mask=w_ok, other=0.0).to(gl.float32)
                s_ok = gl.expand_dims(row_ok, 1) & (run0 < H - k0)
                kb = (k0 + run0) // SCALE_K
                acc_g += gl.sum(wg * xv, axis=2) * gl.load(gs_ptrs + kb, mask=s_ok, other=0.0)
                acc_u += gl.sum(wu * xv, axis=2) * gl.load(us_ptrs + kb, mask=s_ok, other=0.0)
            g = gl.sum(acc_g, axis=1)
            u = gl.sum(acc_u, axis=1)
            h = g / (1.0 + gl.exp(-g)) * u
            gl.store(h_ptr + pair * stride_hm + rows, h.to(h_ptr.dtype.element_ty), mask=row_ok)

    @gluon.jit
    def _fp8_decode_down_gluon_kernel(
        h_ptr, w_ptr, ws_ptr, idx_ptr, wts_ptr, out_ptr, H, I, E,
        stride_hm, stride_it, stride_ik, stride_we, stride_wn, stride_wse, stride_wsn, stride_wt, stride_wtk,
        stride_om,
        TOPK: gl.constexpr, TOPK_P: gl.constexpr, SCALE_N: gl.constexpr, SCALE_K: gl.constexpr,
        BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, PDL: gl.constexpr,
    ):
        # [TOPK_P, BLOCK_N, RUNS, 16]: the token's K experts across warps (then registers), a
        # program's output columns (weight rows) across lanes, a row's runs across lanes
        RUNS: gl.constexpr = BLOCK_K // 16
        tile: gl.constexpr = gl.BlockedLayout([1, 1, 1, 16], [1, 32 // RUNS, RUNS, 1], [gl.num_warps(), 1, 1, 1],
                                              [3, 2, 1, 0])
        h_layout: gl.constexpr = gl.SliceLayout(1, tile)  # [TOPK_P, RUNS, 16]: an expert's run of h
        sums: gl.constexpr = gl.SliceLayout(3, tile)  # [TOPK_P, BLOCK_N, RUNS]
        t = gl.program_id(0).to(gl.int64)
        slot = gl.arange(0, TOPK_P, layout=gl.SliceLayout(1, gl.SliceLayout(2, sums)))
        e = gl.load(idx_ptr + t * stride_it + slot * stride_ik, mask=slot < TOPK, other=-1).to(gl.int64)
        valid = (slot < TOPK) & (e >= 0) & (e < E)
        e = gl.where(valid, e, 0)
        wt = gl.load(wts_ptr + t * stride_wt + slot * stride_wtk, mask=valid, other=0.0).to(gl.float32)
        cols = gl.program_id(1) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, sums)))
        col_ok = cols < H
        e3 = gl.expand_dims(gl.expand_dims(e, 1), 2)  # [TOPK_P, 1, 1]
        c3 = gl.expand_dims(gl.expand_dims(cols, 0), 2)  # [1, BLOCK_N, 1]
        row_ok = gl.expand_dims(gl.expand_dims(valid, 1), 2) & gl.expand_dims(gl.expand_dims(col_ok, 0), 2)
        run0 = gl.expand_dims(gl.expand_dims(gl.arange(0, RUNS, layout=gl.SliceLayout(0, gl.SliceLayout(1, sums))),
                                             0), 1) * 16  # [1, 1, RUNS]
        s_ptrs = ws_ptr + e3 * stride_wse + (c3 // SCALE_N) * stride_wsn
        s_wt = gl.expand_dims(gl.expand_dims(wt, 1), 2)
        # h offsets [TOPK_P, RUNS, 16] and weight offsets [TOPK_P, BLOCK_N, RUNS, 16]
        hs = gl.arange(0, TOPK_P, layout=gl.SliceLayout(1, gl.SliceLayout(2, h_layout)))
        hr = gl.arange(0, RUNS, layout=gl.SliceLayout(0, gl.SliceLayout(2, h_layout)))
        hc = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, h_layout)))
        k_h = gl.expand_dims(gl.expand_dims(hr, 0), 2) * 16 + gl.expand_dims(gl.expand_dims(hc, 0), 1)  # [1, RUNS, 16]
        h_ok_slot = gl.expand_dims(gl.expand_dims(gl.convert_layout(valid, gl.SliceLayout(1, gl.SliceLayout(2,
                                                                                                         h_layout))),
                                                  1), 2)
        h_ptrs = h_ptr + gl.expand_dims(gl.expand_dims(t * TOPK + hs, 1), 2) * stride_hm + k_h
        w_ptrs = (w_ptr + gl.expand_dims(e3 * stride_we + c3.to(gl.int64) * stride_wn, 3) + gl.expand_dims(k_h, 1))
        w_ok = gl.expand_dims(row_ok, 3)
        if PDL:  # h is the gate/up kernel's: wait for it (and its writes) before any load of it
            gdc_wait()
        acc = gl.zeros((TOPK_P, BLOCK_N, RUNS), gl.float32, sums)
        for k0 in range(0, I, BLOCK_K):
            k_ok = k_h < I - k0
            hv = gl.load(h_ptrs + k0, mask=h_ok_slot & k_ok, other=0.0).to(gl.float32)
            wv = gl.load(w_ptrs + k0, mask=w_ok & gl.expand_dims(k_ok, 1), other=0.0).to(gl.float32)
            sv = gl.load(s_ptrs + (k0 + run0) // SCALE_K, mask=row_ok & (run0 < I - k0), other=0.0)
            acc += gl.sum(wv * gl.expand_dims(hv, 1), axis=3) * (sv * s_wt)
        out = gl.sum(gl.sum(acc, axis=2), axis=0)
        gl.store(out_ptr + t * stride_om + cols, out.to(out_ptr.dtype.element_ty), mask=col_ok)
else:  # pragma: no cover
    _fp8_decode_gate_up_gluon_kernel = None
    _fp8_decode_down_gluon_kernel = None
