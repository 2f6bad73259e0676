"""`fused_experts` on fp8 block-quantized expert weights: checks, variant, forward and autograd.

Variants (kernel.toml [dispatch_fp8]): "sm90" fp8 tensor cores with activations quantized per
token and 128-column group (x by one quantize pass, or in the gate/up GEMM's load where the bucket
says "quant_x": false; h in its SwiGLU epilogue, stored as fp8 with its scales), weights by TMA;
"sm80" W8A16 (weights converted in registers), "reference" the torch dequantization
(`reference_fp8`). Tiles: configs/fp8_<variant>.json by rows per expert (`_fp8_configs`). Rows
are aligned to experts by the same sync-free routing as the 16-bit path and combined by its fp32
combine kernel; a bucket's "decode" key instead runs the two token-major kernels of `_fp8_decode`
(W8A16 math, no routing or combine) for calls of a few tokens.

Backward (gradients for x and topk_weights; the fp8 weights are frozen; `backward`): the W8A16
kernels recompute the pre-activations and dY @ Wd per row, torch elementwise ops on the rows make
d[gate | up] and dL/dw, one more W8A16 GEMM and the combine make dx; no host sync. For sm90 this is
the gradient of the dequantized-weight experts (straight through its activation rounding). The
reference variant differentiates the torch reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernelhub.device import CachedLaunch, device_capability, device_guard, device_properties

from . import _experts_launch as launch
from . import _experts_replay as replay
from . import _experts_sm90 as sm90
from . import _fp8_decode_gluon as decode_gluon
from . import _gluon_gemm as gluon_gemm
from ._constexpr_spec import constexpr_spec
from ._experts_routing import align_rows
from ._experts_validate import FN, INTERPRET, check_ids, checked_variant, needs_grad
from ._fp8_configs import (
    FP8_INTERPRETER_CONFIG,
    QUANT_GROUP,
    check_fp8_bucket,
    decode_says_gluon,
    picked_fp8_config,
)
from ._fp8_decode import _fp8_decode_down_kernel, _fp8_decode_gate_up_kernel
from ._fp8_kernels import _fp8_gemm_kernel, _quantize_x_kernel
from ._fp8_validate import BLOCK, refuse_weight_gradients, validate_fp8_inputs
from .reference_fp8 import fp8_reference_unchecked

# A cached launcher (Triton's `kernel[grid](...)` costs tens of us of Python per launch) with the
# constexprs by name, checked against the kernel's signature at import.
_gemm_launch = CachedLaunch(_fp8_gemm_kernel)
_quant_launch = CachedLaunch(_quantize_x_kernel)
Fp8GemmConstexprs = constexpr_spec(_fp8_gemm_kernel, """EPILOGUE GATHER_A TOPK FP8_DOT QUANT_A QUANT_C EMULATE
    PRECISION SCALE_N SCALE_K B_TMA A_TMA RESCALE ONE_SCALE FUSED PERSISTENT BLOCK_M BLOCK_N BLOCK_K""")
QuantConstexprs = constexpr_spec(_quantize_x_kernel, "EMULATE ROWS TOPK BLOCK_T GROUP")
_decode_gate_up_launch = CachedLaunch(_fp8_decode_gate_up_kernel)
_decode_down_launch = CachedLaunch(_fp8_decode_down_kernel)
# the down kernel as a programmatic dependent launch of gate/up (a "PDL" down stage on sm90)
_decode_down_pdl_launch = CachedLaunch(_fp8_decode_down_kernel, launch_pdl=True)
DecodeGateUpConstexprs = constexpr_spec(_fp8_decode_gate_up_kernel,
                                        "TOPK W_BITS UPCAST SCALE_N SCALE_K BLOCK_N BLOCK_K PREFETCH LOAD_STAGES "
                                        "TRIGGER")
DecodeDownConstexprs = constexpr_spec(_fp8_decode_down_kernel,
                                      "TOPK TOPK_P W_BITS UPCAST SCALE_N SCALE_K BLOCK_N BLOCK_K PREFETCH "
                                      "LOAD_STAGES PDL")
# the Gluon decode kernels (a stage's "GLUON" key, capability 9.0), launched the same way (recorded, replayable):
# gate/up, down, down as a PDL launch
if decode_gluon.gluon is not None:
    _decode_gluon_launches = (CachedLaunch(decode_gluon._fp8_decode_gate_up_gluon_kernel),
                              CachedLaunch(decode_gluon._fp8_decode_down_gluon_kernel),
                              CachedLaunch(decode_gluon._fp8_decode_down_gluon_kernel, launch_pdl=True))
    GluonGateUpConstexprs = constexpr_spec(decode_gluon._fp8_decode_gate_up_gluon_kernel,
                                           "TOPK SCALE_N SCALE_K BLOCK_N BLOCK_K TRIGGER")
    GluonDownConstexprs = constexpr_spec(decode_gluon._fp8_decode_down_gluon_kernel,
                                         "TOPK TOPK_P SCALE_N SCALE_K BLOCK_N BLOCK_K PDL")
else:  # pragma: no cover - older triton: `decode_gluon.applies` is false, the Triton kernels run
    _decode_gluon_launches = None
_capped: dict[int, CachedLaunch] = {}
_QUANT_ROWS = 32  # tokens per program of the quantize pass


def _launcher(cfg: dict) -> CachedLaunch:
    """The GEMM launcher, or its twin compiled with the stage's "maxnreg" register cap."""
    regs = cfg.get("maxnreg")
    if regs is None:
        return _gemm_launch
    hit = _capped.get(regs)
    if hit is None:
        hit = _capped.setdefault(regs, CachedLaunch(_fp8_gemm_kernel, maxnreg=regs))
    return hit


def check_config(config: object, variant: str | None = None) -> None:
    """A pinned `config` (a bucket of configs/fp8_*.json), checked on every variant (the reference
    does not use it) so that a bad one fails on the CPU as it would on the GPU."""
    if config is not None:
        check_fp8_bucket(config, f"{FN}: `config`", variant if variant in ("sm90", "sm80") else None)


def bucket(variant: str, x: torch.Tensor, E: int, H: int, inter: int, pairs: int, config: dict | None) -> dict:
    """The tile bucket: a pinned `config` as given; else configs/fp8_<variant>.json's for this
    shape and load, stages trimmed to this device's shared memory (sm89 runs the sm90 tiles)."""
    if config is not None:
        return config
    if INTERPRET:
        return FP8_INTERPRETER_CONFIG
    smem = device_properties(x.device).shared_memory_per_block if x.is_cuda else None
    return picked_fp8_config(variant, E, H, inter, pairs, smem, x.element_size())


def _use_tma(cfg: dict, *weights: torch.Tensor) -> bool:
    """sm90 TMA weight loads: the bucket's "tma" (default on), a device of capability >= 9.0 (the
    sm90 variant also runs on sm89) or the interpreter, and TMA-compatible weights."""
    if not cfg.get("tma", True):
        return False
    dev = weights[0].device
    if dev.type == "cuda" and device_capability(dev) < 90:
        return False
    return all(sm90.tma_ok(w) for w in weights)


def _index(t: torch.Tensor) -> int:
    return t.get_device() if t.is_cuda else -1


def quantize_x(x: torch.Tensor, routing=None, topk: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [T, H], fp32 scales [T, cdiv(H, 128)]): x quantized per token and 128-column group, one
    pass (the gate/up GEMM then loads fp8 rows instead of quantizing x once per column tile). With
    `routing` (its aligned rows, `topk` per token): [P, H] and [P, cdiv(H, 128)] in the buffer's
    row order instead, padding rows zero, for a gate/up GEMM that reads A by TMA."""
    T, H = x.shape
    n = routing.num_rows if routing is not None else T
    q = torch.empty(n, H, device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty(n, launch.cdiv(H, QUANT_GROUP), device=x.device, dtype=torch.float32)
    grid = (launch.cdiv(n, _QUANT_ROWS), s.shape[1])
    if n and H and x.stride(1) == 1:
        rows = routing.rows if routing is not None else q
        _quant_launch.split(grid, _index(x), (x, q, s, rows), (n, H, x.stride(0), q.stride(0), s.stride(0)),
                            QuantConstexprs(EMULATE=INTERPRET, ROWS=routing is not None, TOPK=topk,
                                            BLOCK_T=_QUANT_ROWS, GROUP=QUANT_GROUP), num_warps=4)
    elif n and H:  # (a column-strided x: one contiguous copy first)
        return quantize_x(x.contiguous(), routing, topk)
    return q, s


def one_scale(block_n: int, n: int, epilogue: int) -> bool:
    """Whether every column tile lies in one weight scale block (BLOCK_N divides the block's rows,
    and gate/up's up half, rows n.., starts on a tile boundary, with no partial tile to zero): then
    the kernel loads one scale per K step instead of one per column, and scales each product by a
    per-row factor (a multiply per element instead of two)."""
    return BLOCK[0] % block_n == 0 and (epilogue != 1 or n % block_n == 0)


def _gemm(a, a_scale, weight, scale_inv, out, out_scale, routing, stage: dict, *, n: int, k: int, epilogue: int,
          gather_a: bool, topk: int, fp8_dot: bool, transposed: bool = False, tma: bool = False) -> None:
    """One grouped GEMM over the aligned rows: out[p, :n] from a[row(p), :k] and expert e(p)'s fp8
    weight [E, n, k] (transposed: the weight is [E, k, n] and so are its scale blocks, as the
    backward reads the forward's weights). `a` fp8 with `a_scale` (fp8_dot) or 16/32-bit (fp8_dot:
    quantized in the load). tma (sm90, not transposed): weights and, where the stage says "A_TMA"
    and A is not gathered, A through TMA descriptors."""
    bm, bn = stage.get("BLOCK_M", routing.block_m), stage["BLOCK_N"]  # (a divisor of the alignment)
    quant_a = fp8_dot and a.dtype != torch.float8_e4m3fn
    bk = BLOCK[1] if quant_a else stage.get("BLOCK_K", BLOCK[1])  # (in-load quantization: whole groups)
    grid = (routing.num_rows // bm, launch.cdiv(n, bn))
    if grid[0] == 0 or grid[1] == 0:
        return
    # W8A16: the weights' bits as uint8 (Triton has no fp8e4nv pointers below sm89)
    w = weight if fp8_dot else weight.view(torch.uint8)
    ws, ss = weight.stride(), scale_inv.stride()
    if transposed:
        ws, ss = (ws[0], ws[2], ws[1]), (ss[0], ss[2], ss[1])
    b_desc = a_desc = None
    one = one_scale(bn, n, epilogue)
    # gate/up "FUSED" (TMA): one [1, 2, bn, bk] box of the weight seen as [E, 2, n, k], gate and up rows
    fused = tma and not transposed and epilogue == 1 and one and bool(stage.get("FUSED", False))
    if tma and not transposed:
        if fused:
            b_desc = sm90.TensorDescriptor(w, [w.shape[0], 2, n, k], [ws[0], n * ws[1], ws[1], ws[2]],
                                           [1, 2, bn, bk])
        else:
            b_desc = sm90.weight_descriptor(w, bn, bk)
        if stage.get("A_TMA", False) and not gather_a and bm <= 256 and sm90.tma_ok(a):
            a_desc = sm90.rows_descriptor(a, bm, bk)
    per_sm = int(stage.get("PERSISTENT", 0)) if bm == routing.block_m else 0  # programs per SM; 0: one per tile
    if per_sm:
        grid = (min(grid[0] * grid[1], per_sm * launch.sm_count(a.device)),)
    _launcher(stage).split(
        grid, _index(a),
        (a, a_scale if a_scale is not None else out, w, scale_inv, out, out_scale if out_scale is not None else out,
         routing.rows, routing.row_expert, routing.expert_start, routing.expert_count),
        (routing.num_rows, n, k, weight.shape[2 if transposed else 1], weight.shape[0],
         a.stride(0), a.stride(1), a_scale.stride(0) if a_scale is not None else 0,
         ws[0], ws[1], ws[2], ss[0], ss[1], ss[2],
         out.stride(0), out.stride(1), out_scale.stride(0) if out_scale is not None else 0),
        Fp8GemmConstexprs(
            EPILOGUE=epilogue, GATHER_A=gather_a, TOPK=topk, FP8_DOT=fp8_dot,
            QUANT_A=quant_a, QUANT_C=out_scale is not None, EMULATE=INTERPRET,
            PRECISION="ieee" if (INTERPRET or a.dtype == torch.float32) else None,
            SCALE_N=BLOCK[0], SCALE_K=BLOCK[1], B_TMA=b_desc is not None, A_TMA=a_desc is not None,
            RESCALE=fp8_dot and bool(stage.get("RESCALE", False)), ONE_SCALE=one, FUSED=fused,
            PERSISTENT=per_sm > 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk),
        num_warps=stage["num_warps"], num_stages=stage["num_stages"], extras=(b_desc, a_desc),
    )


def _weight_bits(x: torch.Tensor) -> bool:
    """The decode kernels read the fp8 weights as uint8 bits below sm89 (no fp8 pointers there)."""
    return x.is_cuda and device_capability(x.device) < 89


def _gluon_decode(x: torch.Tensor, w_bits: bool) -> bool:
    """A decode stage's "GLUON" runs its Gluon kernel on x's device (else the Triton kernel)."""
    return not INTERPRET and decode_gluon.applies(x.device, w_bits)


def _decode_applies(cfg: dict, T: int, x, weights_and_scales) -> dict | None:
    """The bucket's "decode" entry where it covers T tokens and the token-major kernels can read
    the operands (unit last strides: they step K by pointer increments); else None. An entry with
    "GLUON" stages and a "fallback" gives way to that fallback (an entry, or None: the grouped
    path) on a device where the Gluon kernels do not run (decided from x's device, per call)."""
    d = cfg.get("decode")
    if d is not None and "fallback" in d and decode_says_gluon(d) and not _gluon_decode(x, _weight_bits(x)):
        d = d["fallback"]
    if d is None or T > d["max_tokens"] or x.stride(1) != 1:
        return None
    return d if all(t.stride(-1) == 1 for t in weights_and_scales) else None


def decode_forward(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_scale, down_scale,
                   decode: dict, w_bits: bool | None = None) -> torch.Tensor:
    """out [T, H] by the two token-major kernels (`_fp8_decode`): no routing, no combine. w_bits:
    read the weights as uint8 bits (default: below sm89, where Triton has no fp8 pointers)."""
    T, H = x.shape
    E, two_i, _ = gate_up_proj.shape
    inter = two_i // 2
    K = topk_idx.shape[1]
    cap = device_capability(x.device) if x.is_cuda else None
    if w_bits is None:
        w_bits = _weight_bits(x)
    gu = gate_up_proj.view(torch.uint8) if w_bits else gate_up_proj
    dn = down_proj.view(torch.uint8) if w_bits else down_proj
    h = torch.empty(T * K, inter, device=x.device, dtype=x.dtype)
    out = torch.empty(T, H, device=x.device, dtype=x.dtype)
    # PDL (inline PTX: a GPU's) from sm90, and only behind the gate/up launch: the down kernel reads
    # the ids before its wait, so they must not be the output of a kernel still running, which they
    # could be if it followed anything else
    pdl = cap is not None and cap >= 90 and not INTERPRET and bool(inter) and decode["down"].get("PDL", False)
    # the Gluon kernels (a stage's "GLUON" key) take the same grid, tensors and ints as the Triton
    # ones, and only the constexprs that mean something to them
    gluon = _gluon_decode(x, w_bits)
    c = decode["gate_up"]
    if inter:
        grid, tensors = (T * K, launch.cdiv(inter, c["BLOCK_N"])), (x, gu, gate_up_scale, topk_idx, h)
        ints = (H, inter, E, x.stride(0), topk_idx.stride(0), topk_idx.stride(1), gate_up_proj.stride(0),
                gate_up_proj.stride(1), gate_up_scale.stride(0), gate_up_scale.stride(1), h.stride(0))
        if gluon and c.get("GLUON", False):
            _decode_gluon_launches[0].split(
                grid, _index(x), tensors, ints,
                GluonGateUpConstexprs(TOPK=K, SCALE_N=BLOCK[0], SCALE_K=BLOCK[1], BLOCK_N=c["BLOCK_N"],
                                      BLOCK_K=c["BLOCK_K"], TRIGGER=pdl),
                num_warps=c["num_warps"], num_stages=c["num_stages"])
        else:
            _decode_gate_up_launch.split(
                grid, _index(x), tensors, ints,
                DecodeGateUpConstexprs(TOPK=K, W_BITS=w_bits, UPCAST=INTERPRET, SCALE_N=BLOCK[0], SCALE_K=BLOCK[1],
                                       BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], PREFETCH=c.get("PREFETCH", False),
                                       LOAD_STAGES=c.get("LOAD_STAGES", 1), TRIGGER=pdl),
                num_warps=c["num_warps"], num_stages=c["num_stages"])
    c = decode["down"]
    if H:
        grid, tensors = (T, launch.cdiv(H, c["BLOCK_N"])), (h, dn, down_scale, topk_idx, topk_weights, out)
        ints = (H, inter, E, h.stride(0), topk_idx.stride(0), topk_idx.stride(1), down_proj.stride(0),
                down_proj.stride(1), down_scale.stride(0), down_scale.stride(1), topk_weights.stride(0),
                topk_weights.stride(1), out.stride(0))
        if gluon and c.get("GLUON", False):
            _decode_gluon_launches[2 if pdl else 1].split(
                grid, _index(x), tensors, ints,
                GluonDownConstexprs(TOPK=K, TOPK_P=launch.next_pow2(K), SCALE_N=BLOCK[0], SCALE_K=BLOCK[1],
                                    BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], PDL=pdl),
                num_warps=c["num_warps"], num_stages=c["num_stages"])
        else:
            (_decode_down_pdl_launch if pdl else _decode_down_launch).split(
                grid, _index(x), tensors, ints,
                DecodeDownConstexprs(TOPK=K, TOPK_P=launch.next_pow2(K), W_BITS=w_bits, UPCAST=INTERPRET,
                                     SCALE_N=BLOCK[0], SCALE_K=BLOCK[1], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
                                     PREFETCH=c.get("PREFETCH", False), LOAD_STAGES=c.get("LOAD_STAGES", 1),
                                     PDL=pdl),
                num_warps=c["num_warps"], num_stages=c["num_stages"])
    return out


def forward(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_scale, down_scale, variant: str,
            config: dict | None = None):
    """out [T, H] by the Triton kernels (inside device_guard(x)): routing, (sm90: x quantized once),
    gate/up + SwiGLU, down, combine; or `decode_forward` where the bucket's "decode" covers T.
    `config`: a pinned bucket (checked by the caller)."""
    T, H = x.shape
    E, two_i, _ = gate_up_proj.shape
    inter = two_i // 2
    K = topk_idx.shape[1]
    cfg = bucket(variant, x, E, H, inter, T * K, config)
    fp8_dot = variant == "sm90" and not cfg.get("w8a16", False)
    tma = variant == "sm90" and _use_tma(cfg, gate_up_proj, down_proj)
    # UE8M0 scales (float8_e8m0fnu): the kernels read fp32 (exact: powers of two); a small copy
    gate_up_scale, down_scale = (s if s.dtype == torch.float32 else s.float() for s in (gate_up_scale, down_scale))
    decode = _decode_applies(cfg, T, x, (gate_up_proj, down_proj, gate_up_scale, down_scale))
    if decode is not None:
        return decode_forward(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_scale, down_scale, decode)
    routing = align_rows(topk_idx, E, cfg["block_m"])
    P, dev = routing.num_rows, x.device
    a, a_scale = x, None
    # gate/up "A_TMA" (fp8 math, x's quantize pass): x quantized straight into the aligned row order
    # "GLUON" stages (sm90 fp8 math, 128-row alignment): the warp-specialized Gluon GEMM, x in row order
    gluon_gu, gluon_dn = (fp8_dot and tma and cfg[stage].get("GLUON", False)
                          and gluon_gemm.applies(x.device, w, sc, routing.block_m, gated)
                          for stage, w, sc, gated in (("gate_up", gate_up_proj, gate_up_scale, True),
                                                      ("down", down_proj, down_scale, False)))
    in_rows = fp8_dot and tma and cfg.get("quant_x", True) and (gluon_gu or cfg["gate_up"].get("A_TMA", False))
    if fp8_dot:  # h as fp8 with one scale per row and 128-column group (gate/up BLOCK_N = 128)
        h = torch.empty(P, inter, device=dev, dtype=torch.float8_e4m3fn)
        h_scale = torch.empty(P, launch.cdiv(inter, QUANT_GROUP), device=dev, dtype=torch.float32)
        if cfg.get("quant_x", True):
            a, a_scale = quantize_x(x, routing if in_rows else None, K)
    else:
        h, h_scale = torch.empty(P, inter, device=dev, dtype=x.dtype), None
    if gluon_gu:
        gluon_gemm.gemm(a, a_scale, gate_up_proj, gate_up_scale, h, h_scale, routing, launch.sm_count(dev),
                        cfg["gate_up"]["num_stages"])
    else:
        _gemm(a, a_scale, gate_up_proj, gate_up_scale, h, h_scale, routing, cfg["gate_up"], n=inter, k=H,
              epilogue=1, gather_a=not in_rows, topk=K, fp8_dot=fp8_dot, tma=tma)
    y = torch.empty(P, H, device=dev, dtype=x.dtype)
    if gluon_dn:
        gluon_gemm.gemm(h, h_scale, down_proj, down_scale, y, None, routing, launch.sm_count(dev),
                        cfg["down"]["num_stages"])
    else:
        _gemm(h, h_scale, down_proj, down_scale, y, None, routing, cfg["down"], n=H, k=inter, epilogue=0,
              gather_a=False, topk=K, fp8_dot=fp8_dot, tma=tma)
    out = torch.empty(T, H, device=dev, dtype=x.dtype)
    launch.combine(y, routing.token_topk_to_pos, topk_weights, out)
    return out


def backward(dout, x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_scale, down_scale,
             needs: tuple[bool, bool]):
    """(dx or None, d topk_weights or None) by the W8A16 kernels (inside device_guard(x)), no host sync.

    The fp8 weights are frozen: every variant differentiates the dequantized-weight experts (for
    sm90 that is straight through its activation rounding). With g, u the pre-activations of row p
    (recomputed), h = silu(g) * u, and dh = dY[t] @ Wd[e]: dL/dw[t, k] = dh . h,
    d[g | u] = w * dh * [u * silu'(g) | silu(g)], dx[t] = sum_k d[g | u] @ Wgu[e].
    Tiles: configs/fp8_sm80.json's bucket (gate_up's stage for the x @ Wgu GEMM, down's for the others)."""
    T, H = x.shape
    E, two_i, _ = gate_up_proj.shape
    inter = two_i // 2
    K = topk_idx.shape[1]
    cfg = bucket("sm80", x, E, H, inter, T * K, None)
    gate_up_scale, down_scale = (s if s.dtype == torch.float32 else s.float() for s in (gate_up_scale, down_scale))
    routing = align_rows(topk_idx, E, cfg["block_m"])
    P, dev = routing.num_rows, x.device
    gu = torch.empty(P, two_i, device=dev, dtype=torch.float32)
    _gemm(x, None, gate_up_proj, gate_up_scale, gu, None, routing, cfg["gate_up"], n=two_i, k=H, epilogue=0,
          gather_a=True, topk=K, fp8_dot=False)
    dh = torch.empty(P, inter, device=dev, dtype=torch.float32)
    dy = dout.to(x.dtype)
    _gemm(dy, None, down_proj, down_scale, dh, None, routing, cfg["down"], n=inter, k=H, epilogue=0, gather_a=True,
          topk=K, fp8_dot=False, transposed=True)
    real = routing.rows >= 0  # rows past the used ones and padding rows hold garbage: masked out below
    flat = routing.rows.clamp(min=0).long()
    g, u = gu[:, :inter], gu[:, inter:]
    sig = torch.sigmoid(g)
    silu = g * sig
    dx = dw = None
    if needs[1]:
        dw_rows = torch.where(real, (dh * silu * u).sum(1), 0.0)
        pos = routing.token_topk_to_pos.long()
        dw = torch.where(pos >= 0, dw_rows[pos.clamp(min=0)], 0.0).to(topk_weights.dtype)
    if needs[0]:
        wrow = torch.where(real, topk_weights.reshape(-1).float()[flat], 0.0)[:, None] * dh
        dgu = torch.cat([wrow * u * sig * (1 + g * (1 - sig)), wrow * silu], dim=1)
        dgu = torch.where(real[:, None], dgu, 0.0)  # (NaN-free: unused rows may hold any bits)
        dx_rows = torch.empty(P, H, device=dev, dtype=torch.float32)
        _gemm(dgu, None, gate_up_proj, gate_up_scale, dx_rows, None, routing, cfg["down"], n=H, k=two_i, epilogue=0,
              gather_a=False, topk=K, fp8_dot=False, transposed=True)
        dx = torch.empty(T, H, device=dev, dtype=x.dtype)
        launch.combine(dx_rows, routing.token_topk_to_pos, None, dx)
    return dx, dw


class FP8ExpertsFunction(torch.autograd.Function):
    """Forward by the variant; backward (x, topk_weights) by the W8A16 kernels (`backward`; the
    reference variant: torch autograd through the dequantized reference). A gradient asked for a
    weight or scale raises (`refuse_weight_gradients`)."""

    @staticmethod
    def forward(ctx, x, topk_weights, gate_up_proj, down_proj, topk_idx, gate_up_scale, down_scale, variant,
                block_size, config=None):
        if variant == "reference":
            out = fp8_reference_unchecked(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_scale,
                                          down_scale, block_size)
        else:
            with device_guard(x):
                out = forward(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_scale, down_scale, variant,
                              config)
        ctx.save_for_backward(x, topk_weights, gate_up_proj, down_proj, topk_idx, gate_up_scale, down_scale)
        ctx.block_size, ctx.variant = block_size, variant
        return out

    @staticmethod
    def backward(ctx, dout):
        n = ctx.needs_input_grad
        refuse_weight_gradients((n[2], n[3], n[5], n[6]))
        x, topk_weights, gate_up_proj, down_proj, topk_idx, gus, ds = ctx.saved_tensors
        if dout.device != x.device:
            raise ValueError(f"{FN}: gradient must be on {x.device} like `x`, got {dout.device}")
        need_x, need_w = n[:2]
        if ctx.variant != "reference":
            with device_guard(x):
                dx, dw = backward(dout, x, gate_up_proj, down_proj, topk_idx, topk_weights, gus, ds, (need_x, need_w))
            return (dx, dw, None, None, None, None, None, None, None, None)
        with torch.enable_grad(), device_guard(x):
            xr = x.detach().requires_grad_(need_x)
            wr = topk_weights.detach().requires_grad_(need_w)
            out = fp8_reference_unchecked(xr, gate_up_proj.detach(), down_proj.detach(), topk_idx, wr, gus.detach(),
                                          ds.detach(), ctx.block_size)
            wanted = [t for t, need in ((xr, need_x), (wr, need_w)) if need]
            grads = iter(torch.autograd.grad(out, wanted, dout, allow_unused=True))
        dx = next(grads) if need_x else None
        dw = next(grads) if need_w else None
        zero = [g if g is not None else torch.zeros_like(t) for g, t in ((dx, x), (dw, topk_weights))]
        return (zero[0] if need_x else None, zero[1] if need_w else None, None, None, None, None, None, None, None,
                None)


def replay_key(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_scale, down_scale, block_size,
               variant: str | None) -> tuple | None:
    """`_experts_replay.replay_key` with the scales, or None where the ordinary path would run a
    torch op a replay does not repeat: UE8M0 scales (read as an fp32 copy) and a column-strided x
    (quantized from a contiguous copy)."""
    if not (isinstance(x, torch.Tensor) and x.dim() == 2 and x.stride(1) == 1 and isinstance(block_size, tuple)
            and all(type(b) is int for b in block_size)):
        return None
    if not all(isinstance(s, torch.Tensor) and s.dtype == torch.float32 for s in (gate_up_scale, down_scale)):
        return None
    if torch._C._are_functorch_transforms_active():
        return None
    return replay.replay_key(x, gate_up_proj, down_proj, topk_idx, topk_weights, ("fp8", variant, block_size),
                             gate_up_scale, down_scale)


def run(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv, down_proj_scale_inv,
        block_size, variant: str | None, check_indices: bool,
        default_variant: Callable[[torch.device], str] | None, config: dict | None = None):
    """`fused_experts` on fp8 weights (eager): checks, variant, then the reference or the kernels
    (`config`: a pinned bucket of configs/fp8_<variant>.json, checked for the variant;
    `default_variant` asked where `variant` is None). Inference with the shipped buckets replays a
    key's recorded launches from its third call, as the 16-bit path does (`_experts_replay`)."""
    externals = (x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv, down_proj_scale_inv)
    key = replay_key(*externals, block_size, variant) if config is None else None
    plan = replay.recorded(key) if key is not None else None
    if plan is not None:
        if check_indices:
            check_ids(x, topk_idx, gate_up_proj.shape[0])
            check_indices = False  # done, also for the ordinary path below (a misaligned address)
        with device_guard(x):
            out = replay.replay(plan, externals)
        if out is not None:
            return out
    bs = validate_fp8_inputs(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv,
                             down_proj_scale_inv, block_size, check_indices)
    if variant is None and torch._C._are_functorch_transforms_active():
        variant = "reference"
    variant = checked_variant(x, default_variant(x.device) if variant is None else variant)
    check_config(config, variant)
    frozen_grad = needs_grad(gate_up_proj, down_proj, gate_up_proj_scale_inv, down_proj_scale_inv)
    if variant == "reference" and not frozen_grad:  # plain autograd (double backward, torch.func)
        return fp8_reference_unchecked(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv,
                                       down_proj_scale_inv, bs)
    if variant != "reference":
        if bs != BLOCK:
            raise ValueError(f"{FN}: variant {variant!r} supports fp8 `block_size` {BLOCK}, got {tuple(block_size)} "
                             "(variant='reference' takes any)")
        if torch._C._are_functorch_transforms_active():
            raise ValueError(f"{FN}: torch.func transforms are not supported by variant {variant!r}; "
                             "use variant='reference'")
        if x.shape[0] == 0:  # nothing to route; zero gradients stay connected
            return x.new_zeros(x.shape) + 0 * (x.sum() + topk_weights.sum()).to(x.dtype)
    if frozen_grad or needs_grad(x, topk_weights):
        return FP8ExpertsFunction.apply(x, topk_weights, gate_up_proj, down_proj, topk_idx, gate_up_proj_scale_inv,
                                        down_proj_scale_inv, variant, bs, config)
    with device_guard(x):
        if key is None or not replay.should_record(key):
            return forward(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv,
                           down_proj_scale_inv, variant, config)
        launched = gluon_gemm.launches[0]  # (Gluon GEMMs: never replayed, see _gluon_gemm.launches)
        with CachedLaunch.recording() as calls:  # the second call of a replay key
            out = forward(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv,
                          down_proj_scale_inv, variant, config)
    if gluon_gemm.launches[0] != launched:  # (not recorded: another thread's launch also refuses, safely)
        replay.refuse(key)
    else:
        replay.remember(key, calls, externals, out)
    return out
