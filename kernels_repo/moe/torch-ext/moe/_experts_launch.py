"""Launchers of the `fused_experts` kernels: grid, strides, descriptors and constexprs of each launch.

One function per kernel (grouped GEMM, weight-gradient GEMM, row gather, combine, pair-tile list,
the two decode kernels), each called inside `device_guard(x)` by `_experts_pipeline`. Every launch
goes through a `CachedLaunch.split` (the inference path's launches are recorded and replayed by
`_experts_replay`) with its constexprs as a named spec checked once against the kernel's signature.
"""

from __future__ import annotations

import os

import torch

from kernelhub.device import CachedLaunch, device_properties

from . import _experts_sm90 as sm90
from ._constexpr_spec import constexpr_spec
from ._experts_decode import _decode_down_kernel, _decode_gate_up_kernel
from ._experts_kernels import (
    _combine_kernel,
    _gather_rows_kernel,
    _grouped_gemm_kernel,
    _grouped_wgrad_kernel,
    _pair_tiles_kernel,
)
from ._experts_routing import ExpertRows

# Read once, like Triton itself (which decides interpretation when a @jit function is defined).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def cdiv(a: int, b: int) -> int:
    # Plain ints: `triton.cdiv` is a jit function, ~5 us per host call through its dispatcher.
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# Cached launchers: Triton's `kernel[grid](...)` costs tens of us of Python per launch, which is
# most of an eager decode step (about ten launches per forward).
gemm_launch = CachedLaunch(_grouped_gemm_kernel)
wgrad_launch = CachedLaunch(_grouped_wgrad_kernel)
combine_launch = CachedLaunch(_combine_kernel)
gather_launch = CachedLaunch(_gather_rows_kernel)
pair_tiles_launch = CachedLaunch(_pair_tiles_kernel)
decode_gate_up_launch = CachedLaunch(_decode_gate_up_kernel)
decode_down_launch = CachedLaunch(_decode_down_kernel)

# The constexprs of each kernel by name (checked against its signature here, at import).
GemmConstexprs = constexpr_spec(_grouped_gemm_kernel, """EPILOGUE SAVE_AUX SAVE_H GATHER_A TOPK B_TMA
    B_NCONTIG UPCAST PRECISION PAIR A_TMA PERSISTENT EPI_HALVES BLOCK_M BLOCK_N BLOCK_K GROUP_M""")
WgradConstexprs = constexpr_spec(_grouped_wgrad_kernel, """GATHER_A GATHER_B TOPK A_TMA B_TMA C_TMA
    PERSISTENT FLAT_STEPS BLOCK_E UPCAST PRECISION BLOCK_M BLOCK_N BLOCK_K GROUP_M""")
CombineConstexprs = constexpr_spec(_combine_kernel, "TOPK HAS_W RNE BLOCK_H")
GatherConstexprs = constexpr_spec(_gather_rows_kernel, "TOPK ALIGN BLOCK_R BLOCK_H")
PairTilesConstexprs = constexpr_spec(_pair_tiles_kernel, "BLOCK_M BLOCK_E")
DecodeGateUpConstexprs = constexpr_spec(_decode_gate_up_kernel, "TOPK UPCAST BLOCK_N BLOCK_K LOAD_STAGES")
DecodeDownConstexprs = constexpr_spec(_decode_down_kernel, "TOPK TOPK_P UPCAST BLOCK_N BLOCK_K LOAD_STAGES")

# (launcher, register cap) -> launcher compiled with ptx .maxnreg: a stage's "maxnreg" key. Why:
# ptxas gives the 8-warp dgrad tile ~180 registers, one CTA per SM, so its SwiGLU-backward epilogue
# runs with no MMA beside it; at 128 two CTAs fit and one's epilogue overlaps the other's K loop.
_capped: dict[tuple[int, int], CachedLaunch] = {}


def launcher(base: CachedLaunch, cfg: dict) -> CachedLaunch:
    """`base`, or its twin compiled with the stage's "maxnreg" register cap."""
    regs = cfg.get("maxnreg")
    if regs is None:
        return base
    key = (id(base), regs)
    launch = _capped.get(key)
    if launch is None:
        launch = _capped.setdefault(key, CachedLaunch(base.kernel, maxnreg=regs))
    return launch


def _index(t: torch.Tensor) -> int:
    return t.get_device() if t.is_cuda else -1


def _precision(dtype: torch.dtype) -> str | None:
    # fp32 inputs: exact fp32 products (the default would be tf32); 16-bit: Triton's default.
    return "ieee" if dtype == torch.float32 else None


def sm_count(device: torch.device) -> int:
    # The interpreter (CPU) has no SMs: 3 programs, so that each loops over several tiles.
    return device_properties(device).sm_count if device.type == "cuda" else 3


def gemm(a, weight, out, routing: ExpertRows, cfg: dict, *, n: int, k: int, epilogue: int,
         gather_a: bool, b_ncontig: bool, topk: int, use_tma: bool, aux=None, save_aux=False,
         scale=None, dscale=None, h=None, pair: bool = False) -> None:
    """One grouped GEMM over the P aligned rows: out[p, :n] from a[row(p), :k] and weight[e(p)].

    pair (the bucket's "pair_m"): an expert's row blocks run two at a time as one tile of twice
    the height, so rows are padded to block_m while most tiles are 2 * block_m tall.
    Stage keys (sm90): "A_TMA" reads a non-gathered A (the down GEMM's h, dL/dx's d[gate|up], gate_up's
    row copy of x under its "ROWS") by TMA
    (with pair, tall tiles through a second descriptor of twice the box height); "PERSISTENT": n
    programs per SM loop over the tiles of the used rows in one flattened, software-pipelined loop
    (with pair, two loops over the tile lists of `pair_tiles`; see the kernel). gate_up's
    "EPI_HALVES": its training epilogue ([g | u] saved) in two column halves (fewer registers)."""
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    bm = routing.block_m
    P = routing.num_rows
    sa, sw, so = a.stride(), weight.stride(), out.stride()
    if b_ncontig:  # weight stored [E, K, N]
        stride_bn, stride_bk = sw[2], sw[1]
    else:  # weight stored [E, N, K]
        stride_bn, stride_bk = sw[1], sw[2]
    desc = a_desc = a_desc_tall = None
    if use_tma:
        desc = sm90.weight_descriptor(weight, bk, bn) if b_ncontig else sm90.weight_descriptor(weight, bn, bk)
        # (a TMA box has at most 256 rows: a taller tile keeps the pointer loads)
        if cfg.get("A_TMA", False) and not gather_a and (2 if pair else 1) * bm <= 256 and sm90.tma_ok(a):
            a_desc = sm90.rows_descriptor(a, bm, bk)
            a_desc_tall = sm90.rows_descriptor(a, 2 * bm, bk) if pair else None
    tiles = cdiv(P, bm) * cdiv(n, bn)
    if tiles == 0:  # no rows or no columns (H = 0): nothing to compute
        return
    per_sm = int(cfg.get("PERSISTENT", 0))  # programs per SM; 0: one program per tile
    programs = min(tiles, per_sm * sm_count(a.device)) if per_sm else tiles
    tile_list = pair_tiles(routing) if pair and per_sm else routing.expert_count
    aux_t = aux if aux is not None else out
    h_t = h if h is not None else out
    launcher(gemm_launch, cfg).split(
        (programs,), _index(a),
        (a, weight, out, aux_t, routing.rows, routing.row_expert, scale if scale is not None else out,
         dscale if dscale is not None else out, h_t, routing.expert_start, routing.expert_count, tile_list),
        (P, n, k, weight.shape[1], weight.shape[0], sa[0], sa[1], sw[0], stride_bn, stride_bk, so[0], so[1],
         so[0] if aux is None else aux.stride(0), so[0] if h is None else h.stride(0)),
        GemmConstexprs(
            EPILOGUE=epilogue, SAVE_AUX=bool(save_aux), SAVE_H=h is not None, GATHER_A=bool(gather_a), TOPK=topk,
            B_TMA=bool(use_tma), B_NCONTIG=bool(b_ncontig), UPCAST=_INTERPRET, PRECISION=_precision(a.dtype),
            PAIR=bool(pair), A_TMA=a_desc is not None, PERSISTENT=per_sm > 0,
            EPI_HALVES=bool(cfg.get("EPI_HALVES", False)), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            GROUP_M=cfg["GROUP_M"],
        ),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], extras=(desc, a_desc, a_desc_tall),
    )


def pair_tiles(routing: ExpertRows) -> torch.Tensor:
    """int32 [2 + P // (2 block_m) + E]: the tile lists persistent programs read under pair_m."""
    E, bm, P = routing.expert_count.shape[0], routing.block_m, routing.num_rows
    tiles = torch.empty(2 + P // (2 * bm) + E, device=routing.rows.device, dtype=torch.int32)
    pair_tiles_launch.split(
        (1,), _index(routing.rows), (routing.expert_start, routing.expert_count, tiles), (E, P),
        PairTilesConstexprs(BLOCK_M=bm, BLOCK_E=max(16, next_pow2(E))), num_warps=4,
    )
    return tiles


def wgrad(a, b, out, routing: ExpertRows, cfg: dict, *, gather_a: bool, gather_b: bool,
          topk: int, use_tma: bool = False) -> None:
    """out[e] = sum over e's rows p of a[row(p)]^T b[row(p)] ([M, N] per expert).

    With use_tma (sm90) and the stage's "TMA" key, the operand that is not gathered is read by
    TMA; only when BLOCK_K divides the row alignment, so that a box stays inside its expert.
    "TMA_STORE" (sm90): each output tile is written by one TMA store. "PERSISTENT": n launches n
    programs per SM that loop over the tiles (meant to overlap a store with the next tile; alone
    it was slower at every point timed, docs/performance.md). "FLAT_STEPS": s (with PERSISTENT,
    both operands by TMA): while no expert has more than s K steps and the steps are not too
    uneven, every tile runs the largest expert's step count and the tile and K loops are flattened
    into one pipelined loop (see the kernel); decided on the device, no host sync.
    """
    E, M, N = out.shape
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    tma = use_tma and bool(cfg.get("TMA", False)) and routing.block_m % bk == 0
    a_tma = bool(tma and not gather_a and sm90.tma_ok(a))
    b_tma = bool(tma and not gather_b and sm90.tma_ok(b))
    c_tma = bool(use_tma and cfg.get("TMA_STORE", False) and sm90.tma_ok(out))
    tiles = E * cdiv(M, bm) * cdiv(N, bn)
    if tiles == 0:  # dW has no elements (H = 0): the kernel's tile arithmetic would divide by zero
        return
    per_sm = int(cfg.get("PERSISTENT", 0))  # programs per SM; 0: one program per tile
    programs = min(tiles, per_sm * sm_count(out.device)) if per_sm else tiles
    flat = int(cfg.get("FLAT_STEPS", 0)) if per_sm and a_tma and b_tma else 0
    launcher(wgrad_launch, cfg).split(
        (programs,), _index(a),
        (a, b, out, routing.rows, routing.expert_start, routing.expert_count),
        (E, M, N, routing.num_rows, a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0),
         out.stride(1), out.stride(2)),
        WgradConstexprs(
            GATHER_A=bool(gather_a), GATHER_B=bool(gather_b), TOPK=topk, A_TMA=a_tma, B_TMA=b_tma, C_TMA=c_tma,
            PERSISTENT=bool(per_sm), FLAT_STEPS=flat, BLOCK_E=next_pow2(E) if flat else 1, UPCAST=_INTERPRET,
            PRECISION=_precision(a.dtype), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.get("GROUP_M", 1),
        ),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        extras=(sm90.rows_descriptor(a, bk, bm) if a_tma else None, sm90.rows_descriptor(b, bk, bn) if b_tma else None,
                sm90.weight_descriptor(out, bm, bn) if c_tma else None),
    )


def gather_rows(src: torch.Tensor, routing: ExpertRows, topk: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """[P, H] copy of src's rows in the expert-aligned order (zeros on padding rows)."""
    P, H = routing.num_rows, src.shape[1]
    if out is None:
        out = torch.empty(P, H, device=src.device, dtype=src.dtype)
    block_r = min(16, routing.block_m)
    block_h = min(512, next_pow2(H))
    gather_launch.split(
        (P // block_r, cdiv(H, block_h)), _index(src),
        (src, routing.rows, routing.row_expert, out), (P, H, src.stride(0), src.stride(1), out.stride(0)),
        GatherConstexprs(TOPK=topk, ALIGN=routing.block_m, BLOCK_R=block_r, BLOCK_H=block_h), num_warps=4,
    )
    return out


def _column_chunks(n: int, tile: int, parts: int) -> list[tuple[int, int]]:
    """[c0, c1) ranges splitting n columns into about `parts` chunks, each a multiple of `tile`."""
    width = cdiv(cdiv(n, parts), tile) * tile
    return [(c, min(c + width, n)) for c in range(0, n, width)]


def wgrad_token_operand(src, other, out, routing: ExpertRows, cfg: dict, *, src_is_a: bool, topk: int,
                        use_tma: bool) -> None:
    """A weight gradient whose operand `src` [T, H] is per token (dY for dW_down, where it is A;
    x for dW_gate_up, where it is B) and `other` is per aligned row.

    Without the stage's "ROWS" key the GEMM gathers src's rows in its K loop. With it, src is
    replaced by row-ordered copies made `ROWS_PARTS` (default 4) column chunks of H at a time into
    one reused buffer: the copy adds P*H/4 to the backward's peak memory instead of P*H
    (Qwen3-30B-A3B T=16384: 144 vs 575 MiB). H is dW_down's M and dW_gate_up's N."""
    if not cfg.get("ROWS", False):
        a, b = (src, other) if src_is_a else (other, src)
        wgrad(a, b, out, routing, cfg, gather_a=src_is_a, gather_b=not src_is_a, topk=topk, use_tma=use_tma)
        return
    H = src.shape[1]
    if H == 0:  # dW has no elements
        return
    tile = cfg["BLOCK_M"] if src_is_a else cfg["BLOCK_N"]
    chunks = _column_chunks(H, tile, int(cfg.get("ROWS_PARTS", 4)))
    buf = torch.empty(routing.num_rows, chunks[0][1], device=src.device, dtype=src.dtype)
    for c0, c1 in chunks:
        rows = gather_rows(src[:, c0:c1], routing, topk, out=buf[:, : c1 - c0])
        if src_is_a:
            wgrad(rows, other, out[:, c0:c1, :], routing, cfg, gather_a=False, gather_b=False, topk=topk,
                  use_tma=use_tma)
        else:
            wgrad(other, rows, out[:, :, c0:c1], routing, cfg, gather_a=False, gather_b=False, topk=topk,
                  use_tma=use_tma)


def combine(y, token_topk_to_pos, weights, out) -> None:
    """out[t] = sum_k weights[t, k] * y[pos[t, k]] (weights None: 1) in fp32, rounded once."""
    T, H = out.shape
    K = token_topk_to_pos.shape[1]
    block_h = min(1024, next_pow2(H))
    w = weights if weights is not None else out
    combine_launch.split(
        (T, cdiv(H, block_h)), _index(y),
        (y, token_topk_to_pos, w, out), (H, y.stride(0), w.stride(0), w.stride(1), out.stride(0)),
        CombineConstexprs(TOPK=K, HAS_W=weights is not None, RNE=_INTERPRET, BLOCK_H=block_h), num_warps=4,
    )


def decode_gate_up(x, gate_up_proj, topk_idx, h, c: dict) -> None:
    """h[t*K + k] = silu(Wg[e] @ x[t]) * (Wu[e] @ x[t]), e = topk_idx[t, k] (rows of dropped ids unwritten)."""
    E, two_i, H = gate_up_proj.shape
    si, sg = topk_idx.stride(), gate_up_proj.stride()
    decode_gate_up_launch.split(
        (h.shape[0], cdiv(two_i // 2, c["BLOCK_N"])), _index(x), (x, gate_up_proj, topk_idx, h),
        (H, two_i // 2, E, x.stride(0), x.stride(1), si[0], si[1], sg[0], sg[1], sg[2], h.stride(0)),
        DecodeGateUpConstexprs(TOPK=topk_idx.shape[1], UPCAST=_INTERPRET, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
                               LOAD_STAGES=c.get("LOAD_STAGES", 1)),
        num_warps=c["num_warps"], num_stages=c["num_stages"],
    )


def decode_down(h, down_proj, topk_idx, topk_weights, out, c: dict) -> None:
    """out[t] = sum_k w[t, k] * (Wd[e] @ h[t*K + k]) over the ids in [0, E), rounded once."""
    E, H, inter = down_proj.shape
    si, sd = topk_idx.stride(), down_proj.stride()
    decode_down_launch.split(
        (out.shape[0], cdiv(H, c["BLOCK_N"])), _index(h), (h, down_proj, topk_idx, topk_weights, out),
        (H, inter, E, h.stride(0), si[0], si[1], sd[0], sd[1], sd[2], topk_weights.stride(0),
         topk_weights.stride(1), out.stride(0)),
        DecodeDownConstexprs(TOPK=topk_idx.shape[1], TOPK_P=next_pow2(topk_idx.shape[1]), UPCAST=_INTERPRET,
                             BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], LOAD_STAGES=c.get("LOAD_STAGES", 1)),
        num_warps=c["num_warps"], num_stages=c["num_stages"],
    )
