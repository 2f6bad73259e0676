"""The stages of `fused_experts` on checked inputs: tile bucket, forward, inference, backward.

Forward: align (token, k) pairs to experts (`_experts_routing`, sync-free) -> gate/up grouped
GEMM with SwiGLU epilogue [P, I] -> down grouped GEMM [P, H] -> weighted fp32 combine [T, H].
Buffers (P = static bound on aligned rows, see `max_rows`):
  h    [P, I]  x.dtype   silu(gate) * up per row (forward only; dW_down recomputes it from aux)
  aux  [P, 2I] x.dtype   pre-activation [gate | up] per row (training only: the one saved activation)
  y    [P, H]  x.dtype   unweighted expert output per row (forward only)
Backward: dgrad GEMM dY[tok] @ Wd -> d[gate|up] [P, 2I] with the SwiGLU bwd and dL/dw in its
epilogue; dx = combine(d[gate|up] @ Wgu); dW_down, dW_gate_up by per-expert wgrad GEMMs, which
gather dY / x rows in their K loop or (wgrad key "ROWS") read row-ordered copies of them.
Every function here runs inside `device_guard(x)`; launches go through `_experts_launch`.
"""

from __future__ import annotations

import torch

from kernelhub.device import device_capability, device_properties

from . import _experts_launch as launch
from . import _experts_sm90 as sm90
from . import _gluon_gemm as gluon_gemm
from ._experts_configs import INTERPRETER_CONFIG, pick_config, picked_config
from ._experts_routing import ExpertRows, align_rows
from ._experts_validate import INTERPRET, check_config


def bucket(variant: str, E: int, H: int, inter: int, pairs: int, config: dict | None,
           device: torch.device | None = None, element_size: int = 2) -> dict:
    """The tile bucket: a pinned `config` as given; else from configs/, with num_stages trimmed to
    the shared memory of *this* device index (device_properties is cached per index)."""
    if config is not None:
        check_config(config)
        return config
    if device is not None and device.type == "cuda":
        return picked_config(90 if variant == "sm90" else 80, E, H, inter, pairs, device.index, element_size,
                             lambda: device_properties(device).shared_memory_per_block)
    if INTERPRET:
        return INTERPRETER_CONFIG
    return pick_config(90 if variant == "sm90" else 80, E, H, inter, pairs)


def use_tma(variant: str, cfg: dict, gate_up_proj, down_proj) -> bool:
    # A bucket may turn TMA off (decode: building two host descriptors costs ~12 us of launch-bound
    # time, and a few weight tiles per CTA gain nothing from TMA). A pinned sm90 variant on a
    # pre-Hopper device index runs the pointer path: TMA needs capability >= 9.0.
    if variant != "sm90" or not cfg.get("tma", True):
        return False
    dev = gate_up_proj.device
    if dev.type == "cuda" and device_capability(dev) < 90:
        return False
    return sm90.tma_ok(gate_up_proj) and sm90.tma_ok(down_proj)


def use_gluon(cfg: dict, stage: str, weight: torch.Tensor, block_m: int, tma: bool, save: bool) -> bool:
    """A "GLUON" stage runs the warp-specialized Gluon GEMM (`_gluon_gemm`, sm90, 128-row
    alignment) where its tiles fit; inference only (the training forward also saves [g | u])."""
    return (tma and not save and cfg[stage].get("GLUON", False)
            and gluon_gemm.applies(weight.device, weight, None, block_m, stage == "gate_up"))


def forward(x, gate_up_proj, down_proj, topk_idx, topk_weights, variant, cfg, save: bool):
    """(out [T, H], routing, h, aux or None): the grouped-GEMM forward; `save` keeps aux for backward."""
    # Inference calls are recorded and replayed (_experts_replay): every GPU operation here must be
    # a CachedLaunch.split launch (allocations aside), or a replay would skip it.
    T, H = x.shape
    E, two_i, _ = gate_up_proj.shape
    inter = two_i // 2
    K = topk_idx.shape[1]
    dev = x.device
    routing = align_rows(topk_idx, E, cfg["block_m"])
    P = routing.num_rows
    tma = use_tma(variant, cfg, gate_up_proj, down_proj)
    pair = bool(cfg.get("pair_m", False))
    h = torch.empty(P, inter, device=dev, dtype=x.dtype)
    aux = torch.empty(P, two_i, device=dev, dtype=x.dtype) if save else None
    # gate_up "ROWS": x's rows copied into the aligned order first, so the GEMM reads A without a
    # gather (by TMA with "A_TMA"; a persistent gathering gate_up needs 255 registers, ptxas sm90)
    # "GLUON" stages (sm90 inference, 128-row alignment): the Gluon GEMM, x's rows copied first
    gluon_gu, gluon_dn = (use_gluon(cfg, stage, w, routing.block_m, tma, save)
                          for stage, w in (("gate_up", gate_up_proj), ("down", down_proj)))
    rows = cfg["gate_up"].get("ROWS", False) or gluon_gu
    a = launch.gather_rows(x, routing, K) if rows else x
    if gluon_gu:
        gluon_gemm.gemm(a, None, gate_up_proj, None, h, None, routing, launch.sm_count(dev),
                        cfg["gate_up"]["num_stages"], cfg["gate_up"]["GROUP_M"], gated=True)
    else:
        launch.gemm(a, gate_up_proj, h, routing, cfg["gate_up"], n=inter, k=H, epilogue=1, gather_a=not rows,
                    b_ncontig=False, topk=K, use_tma=tma, aux=aux, save_aux=save, pair=pair)
    y = torch.empty(P, H, device=dev, dtype=x.dtype)
    if gluon_dn:
        gluon_gemm.gemm(h, None, down_proj, None, y, None, routing, launch.sm_count(dev), cfg["down"]["num_stages"],
                        cfg["down"]["GROUP_M"], gated=False)
    else:
        launch.gemm(h, down_proj, y, routing, cfg["down"], n=H, k=inter, epilogue=0, gather_a=False,
                    b_ncontig=False, topk=K, use_tma=tma, pair=pair)
    out = torch.empty(T, H, device=dev, dtype=x.dtype)
    launch.combine(y, routing.token_topk_to_pos, topk_weights, out)
    return out, routing, h, aux


def decode(x, gate_up_proj, down_proj, topk_idx, topk_weights, cfg: dict) -> torch.Tensor:
    """The token-major inference path of a bucket's "decode" key (`_experts_decode`): two launches,
    no row alignment; every GPU operation a CachedLaunch.split launch, so it is replayed too."""
    T, H = x.shape
    h = torch.empty(T * topk_idx.shape[1], gate_up_proj.shape[1] // 2, device=x.device, dtype=x.dtype)
    launch.decode_gate_up(x, gate_up_proj, topk_idx, h, cfg["gate_up"])
    out = torch.empty(T, H, device=x.device, dtype=x.dtype)
    launch.decode_down(h, down_proj, topk_idx, topk_weights, out, cfg["down"])
    return out


def infer(x, gate_up_proj, down_proj, topk_idx, topk_weights, variant, cfg) -> torch.Tensor:
    """The inference output: the bucket's token-major "decode" path up to its `max_tokens`, else
    the grouped GEMMs."""
    dec = cfg.get("decode")
    if dec is not None and x.shape[0] <= dec["max_tokens"]:
        return decode(x, gate_up_proj, down_proj, topk_idx, topk_weights, dec)
    out, *_ = forward(x, gate_up_proj, down_proj, topk_idx, topk_weights, variant, cfg, save=False)
    return out


def backward(dout, x, gate_up_proj, down_proj, topk_weights, routing: ExpertRows, aux, variant, cfg,
             needs: tuple[bool, bool, bool, bool]):
    """(dx, d gate_up_proj, d down_proj, d topk_weights), each None where `needs` says no."""
    T, H = x.shape
    E, two_i, _ = gate_up_proj.shape
    inter = two_i // 2
    K = topk_weights.shape[1]
    dev = x.device
    P = routing.num_rows
    tma = use_tma(variant, cfg, gate_up_proj, down_proj)
    pair = bool(cfg.get("pair_m", False))
    w_flat = topk_weights.reshape(-1)
    if not w_flat.is_contiguous():
        w_flat = w_flat.contiguous()
    # dL/d[gate|up] per row; dL/dw per (token, k) (fp32, atomically summed over the I tiles); and,
    # for dW_down, h * w per row (so that GEMM reads it instead of recomputing the SwiGLU per tile).
    dgu = torch.empty(P, two_i, device=dev, dtype=x.dtype)
    dw_flat = torch.zeros(w_flat.shape[0], device=dev, dtype=torch.float32)
    hw = torch.empty(P, inter, device=dev, dtype=x.dtype) if needs[2] else None
    launch.gemm(dout, down_proj, dgu, routing, cfg["dgrad"], n=inter, k=H, epilogue=2, gather_a=True,
                b_ncontig=True, topk=K, use_tma=tma, aux=aux, scale=w_flat, dscale=dw_flat, h=hw, pair=pair)
    dx = d_gate_up = d_down = d_w = None
    # wgrad "ROWS" (sm90 buckets from 64 rows per expert): the weight-gradient GEMMs read dY and x
    # from row-ordered copies instead of gathering them in their K loop, where the index load
    # ahead of each gathered load costs a pipeline stage (docs/performance.md). See
    # launch.wgrad_token_operand.
    if needs[2]:
        # First, so that hw is freed before dx's [P, H] rows exist (peak memory).
        d_down = torch.empty(E, H, inter, device=dev, dtype=down_proj.dtype)
        launch.wgrad_token_operand(dout, hw, d_down, routing, cfg["wgrad"], src_is_a=True, topk=K, use_tma=tma)
        del hw
    if needs[0]:
        dx_rows = torch.empty(P, H, device=dev, dtype=x.dtype)
        launch.gemm(dgu, gate_up_proj, dx_rows, routing, cfg["down"], n=H, k=two_i, epilogue=0,
                    gather_a=False, b_ncontig=True, topk=K, use_tma=tma, pair=pair)
        dx = torch.empty(T, H, device=dev, dtype=x.dtype)
        launch.combine(dx_rows, routing.token_topk_to_pos, None, dx)
        del dx_rows
    if needs[1]:
        d_gate_up = torch.empty(E, two_i, H, device=dev, dtype=gate_up_proj.dtype)
        launch.wgrad_token_operand(x, dgu, d_gate_up, routing, cfg["wgrad"], src_is_a=False, topk=K,
                                   use_tma=tma)
    if needs[3]:
        d_w = dw_flat.view(topk_weights.shape).to(topk_weights.dtype)
    return dx, d_gate_up, d_down, d_w
