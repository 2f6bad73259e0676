"""Where the time of an fp8 token-major decode call goes, kernel by kernel.

The sweep (`tune_moe.py FP8_DECODE_ONLY=1`) times whole calls from CUDA graphs; this splits a call
into its gate/up and down kernels (torch.profiler GPU durations, L2 flushed before each call, as a
cold decode step sees it) and sets each beside what its weight bytes take at the card's copy
bandwidth, measured in the same run. So one GPU call tells whether a kernel is far from its bytes
and which tile or load mode closes the gap. Then whole calls (PAIRS) from one CUDA graph with
the flush between calls, less the flush alone: the time a PDL down kernel overlaps shows only there.

Usage (repo root, GPU): PYTHONPATH=src python tools/diag_fp8_decode.py  (`fp8diag`)
  env: SHAPE=qwen3_30b_a3b  T=1  REPS=20  PAIRS_ONLY=1 (whole calls only)  GLUON_ONLY=1 (the shipped
  and the Gluon tiles)  BEST_OUT=path: the fastest whole call's decode key written there as JSON
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels_repo" / "moe" / "benchmarks"))
from bench_fp8 import ceilings  # noqa: E402  (kernels_repo/moe/benchmarks/)
from profile_moe import kernel_times  # noqa: E402  (tools/)
from tune_moe import DEV, SHAPES, fp8_weights, moe  # noqa: E402


def _tile(bn: int, bk: int, nw: int, **way) -> dict:
    return {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": 2, **way}


# hand-picked: the shipped Qwen3 tiles first (s45; down shipped with PDL, which only a whole call
# shows), then other steps and load modes
GATE_UP = [_tile(4, 512, 8), _tile(4, 128, 4), _tile(8, 256, 8), _tile(4, 1024, 8), _tile(4, 512, 8, PREFETCH=True),
           _tile(4, 512, 8, LOAD_STAGES=3)]
DOWN = [_tile(4, 128, 8), _tile(8, 64, 8, PREFETCH=True), _tile(8, 128, 8), _tile(4, 256, 8), _tile(8, 256, 8),
        _tile(4, 512, 8), _tile(8, 128, 8, PREFETCH=True), _tile(4, 128, 4, PREFETCH=True)]
# whole calls (gate/up, down): with PDL the down kernel overlaps gate/up, so only a call's time says it.
# PDL + PREFETCH: the down program's first step of weights is loaded before it waits for gate/up (s48;
# on an H100 a tie at (4, 128, 8 warps), slower at the wider steps, whose registers cost occupancy)
EARLY = [_tile(4, 128, 8, PDL=True, PREFETCH=True), _tile(4, 256, 8, PDL=True, PREFETCH=True),
         _tile(4, 512, 8, PDL=True, PREFETCH=True), _tile(8, 256, 8, PDL=True, PREFETCH=True),
         _tile(4, 256, 4, PDL=True, PREFETCH=True), _tile(8, 128, 8, PDL=True, PREFETCH=True)]
PAIRS = [(GATE_UP[0], {**DOWN[0], "PDL": True}), *((GATE_UP[0], d) for d in EARLY), (GATE_UP[0], DOWN[0]),
         (GATE_UP[0], {**DOWN[0], "PDL": True})]
# the Gluon kernels (stage key GLUON, sm90; s49): x / h loaded once per thread's 16-column run and
# kept for all of its rows, each run's products summed in registers and scaled once
GATE_UP += [_tile(bn, bk, nw, GLUON=True) for bn, bk, nw in ((16, 512, 8), (8, 256, 4), (4, 256, 2), (16, 256, 4),
                                                              (32, 512, 8), (8, 512, 8))]
DOWN += [_tile(bn, bk, nw, GLUON=True) for bn, bk, nw in ((4, 128, 8), (8, 128, 8), (4, 256, 8), (8, 256, 8),
                                                          (16, 128, 8), (4, 128, 4), (8, 64, 8))]
if os.environ.get("GLUON_ONLY"):  # the shipped tiles and the Gluon ones, and the shipped call
    GATE_UP = [GATE_UP[0], *(c for c in GATE_UP if c.get("GLUON"))]
    DOWN = [DOWN[0], *(c for c in DOWN if c.get("GLUON"))]
    PAIRS = PAIRS[:1]


def main() -> None:
    name = os.environ.get("SHAPE", "qwen3_30b_a3b")
    T, reps = int(os.environ.get("T", "1")), int(os.environ.get("REPS", "20"))
    s = SHAPES[name]
    E, H, I, K = s["E"], s["H"], s["I"], s["K"]
    gu, gus = fp8_weights(E, 2 * I, H)
    dn, dns = fp8_weights(E, H, I)
    fp8x = importlib.import_module(moe.__name__ + "._fp8_experts")
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, generator=g)
    idx = torch.stack([torch.randperm(E, device=DEV, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, device=DEV, generator=g)
    touched = int(torch.unique(idx).numel())
    _, gbs = ceilings(DEV)  # (bench_fp8.py's copy bandwidth, so its floors and these agree)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEV)  # L2 cold before each call
    floor = {"gate_up": touched * 2 * I * H / (gbs * 1e3), "down": touched * H * I / (gbs * 1e3)}  # us
    print(f"{name} T={T}: {touched} experts touched, copy {gbs:.0f} GB/s; weight-byte floors "
          f"gate_up {floor['gate_up']:.1f} us, down {floor['down']:.1f} us", flush=True)
    want = moe.fused_experts(x, gu, dn, idx, w, gate_up_proj_scale_inv=gus, down_proj_scale_inv=dns,
                             variant="sm80").float()
    base = {"gate_up": GATE_UP[0], "down": DOWN[0]}
    best = {}  # stage -> (us alone, tile)
    for stage, space in () if os.environ.get("PAIRS_ONLY") else (("gate_up", GATE_UP), ("down", DOWN)):
        for c in space:
            dec = {"max_tokens": T, **base, stage: c}
            try:
                got = fp8x.decode_forward(x, gu, dn, idx, w, gus, dns, dec).float()
                err = ((got - want).norm() / want.norm()).item()
                table, _ = kernel_times(lambda dec=dec: fp8x.decode_forward(x, gu, dn, idx, w, gus, dns, dec), reps,
                                        before=flush.zero_)
                us = {k: t for k, (t, _) in table.items() if "decode" in k}
            except Exception as e:  # noqa: BLE001 - out of shared memory, say
                print(f"{stage} {json.dumps(c)}: {type(e).__name__} {str(e)[:100]}", flush=True)
                continue
            mine = [v for k, v in us.items() if stage.replace("_", "") in k.replace("_", "")]
            t = mine[0] if mine else math.nan
            if t < best.get(stage, (math.inf,))[0]:
                best[stage] = (t, c)
            print(f"{stage} {json.dumps(c)}: {t:.1f} us ({floor[stage] / t:.2f} of bytes)  "
                  f"all {sum(us.values()):.1f} us  err {err:.1e}", flush=True)
    alone = _graph_us(flush.zero_)
    pairs = list(PAIRS)
    if len(best) == 2:  # the fastest of each stage alone, together (down with PDL and without)
        g, d = best["gate_up"][1], best["down"][1]
        pairs += [(g, {**DOWN[0], "PDL": True}), (g, {**d, "PDL": True}), (g, d),
                  (GATE_UP[0], {**DOWN[0], "PDL": True})]
    fastest = (math.inf, None)
    for gate_up, down in pairs:
        dec = {"max_tokens": T, "gate_up": gate_up, "down": down}
        try:
            call = _graph_us(lambda dec=dec: (flush.zero_(), fp8x.decode_forward(x, gu, dn, idx, w, gus, dns, dec)))
        except Exception as e:  # noqa: BLE001
            print(f"call {json.dumps(dec)}: {type(e).__name__} {str(e)[:100]}", flush=True)
            continue
        fastest = min(fastest, (call, dec), key=lambda r: r[0])
        print(f"call gate_up {json.dumps(gate_up)} down {json.dumps(down)}: {call - alone:.1f} us "
              f"(graph replay, L2 flushed before each; floor {floor['gate_up'] + floor['down']:.1f} us)", flush=True)
    if os.environ.get("BEST_OUT") and fastest[1] is not None:  # (for an end-to-end A/B of the winner)
        Path(os.environ["BEST_OUT"]).write_text(json.dumps(fastest[1]))


def _graph_us(fn, n: int = 50) -> float:
    """us per call of `fn` captured n times in one CUDA graph (the replays' GPU time, no host)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / n)
    return best


if __name__ == "__main__":
    main()
