"""Tune fused_experts' tile configs on this GPU and write them as `configs/sm<cap>.json`.

For each shape and T it tries every BLOCK_M in a small candidate set (it fixes the routing
alignment; from 64 rows per expert up also block_m=64 with "pair_m"), and for each stage (gate_up,
down, dgrad, wgrad) a small grid of BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages (plus a
register-capped 8-warp tile, "maxnreg"); it keeps the best per stage and the BLOCK_M with the least
total time. In training mode the down tile is timed together with the dL/dx GEMM that also runs
with it, and the wgrad tile with both weight gradients (ROWS copies included). At decode (T <= 8,
<= 4 rows per expert) it also tunes the token-major path's two kernels and keeps a "decode" key
where that path wins end to end. Buckets are written per shape ("shapes": {"E128_H2048_I768":
[...]}) with max_rows_per_expert halfway (geometric) between the tuned loads; other shapes keep
the defaults.

Usage (repo root): PYTHONPATH=src python kernels_repo/moe/benchmarks/tune_moe.py [--out DIR]
    [--full] [--forward-only]   env: SHAPES=qwen3_30b_a3b  TOKENS=1,512,16384  BLOCK_MS=64,128
Time: the default grid compiles about 16-25 configs per stage and BLOCK_M (2-3 BLOCK_M per point;
the wgrad stage 42 on sm90, 28 on sm80, each timing both weight gradients), so one (shape, T) point
took about 3-5 minutes before the wgrad grid grew to this (not re-timed since: expect more); tune a
few points per run (SHAPES=, TOKENS=, BLOCK_MS=).
Then: KERNELHUB_MOE_CONFIG_DIR=DIR (or copy DIR/sm90.json over the package's configs/).
--fp8: the fp8-weights path instead (`fp8_stage_space`, `fp8_tune_point`): DeepSeek-V3 and
Qwen3-30B-A3B at T=1,32,512,4096,16384 (SHAPES=, TOKENS= as above), writing DIR/fp8_<variant>.json
("shapes" buckets) and printing the best bucket per point at the end (at T <= 8 also the
token-major decode kernels, kept as a "decode" key where they win); about 90 distinct kernels
to compile, sized for one GPU call of under 8 minutes (FP8_BUDGET_S, default 400: past it each
stage keeps its best candidate so far; FP8_BLOCK_MS=128: only those of the point's alignments;
FP8_DECODE_ONLY=1: at T <= 8 only the decode kernels, against the shipped bucket, by CUDA-graph time;
DECODE_ONLY=1 does the same for the 16-bit path (BUDGET_S: its budget, unset: none);
tools/merge_fp8_decode.py merges either into the shipped file).
Each fp8 line: stage, block_m, config, ms. At block_m 128 each stage's best Triton tile is also
timed in the Gluon kernel of `_gluon_gemm` (sm90); where that wins the stage gets "GLUON": true.
Each line printed is one measurement: stage, block_m, config, ms. 16-bit forward-only sweeps
(--forward-only) also time the gate_up and down stages at block_m 128 in the Gluon kernel of
`_gluon_gemm` (sm90) and set "GLUON" (with its GROUP_M) where it wins.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "src"))
from kernelhub._loader import load_kernel_from_dir  # noqa: E402

moe = load_kernel_from_dir(ROOT / "kernels_repo" / "moe")
launch = sys.modules[moe.__name__ + "._experts_launch"]
pipeline = sys.modules[moe.__name__ + "._experts_pipeline"]
rt = sys.modules[moe.__name__ + "._experts_routing"]
cfgs = sys.modules[moe.__name__ + "._experts_configs"]
DEV = torch.device("cuda")
SHAPES = {
    "qwen3_30b_a3b": dict(E=128, H=2048, I=768, K=8),
    "mixtral_8x7b": dict(E=8, H=4096, I=14336, K=2),
    "deepseek_v3": dict(E=256, H=7168, I=2048, K=8),
}


DECODE_MAX_TOKENS = 8  # points up to this T also try the token-major decode path ("decode")


def gemm_space(full: bool, rows_per_expert: float):
    """16-24 configs by default (about 1-2 s of compile each); --full: about 100."""
    # decode (<= 4 rows per expert): narrow tiles, so that the few touched experts' weight columns
    # spread evenly over the SMs (Qwen3-30B-A3B T=1 gate_up: 192 tiles of 32 on 132 SMs, 384 of 16)
    bns = [16, 32, 64, 128, 256] if full else ([16, 32, 64] if rows_per_expert <= 4 else [64, 128, 256])
    bks = [64, 128] if rows_per_expert > 32 else [128, 256]
    gms = [1, 8] if full else [1 if rows_per_expert <= 32 else 8]
    for bn, bk, gm, nw, ns in itertools.product(bns, bks, gms, [4, 8], [3, 4, 5] if full else [3, 4]):
        if bn * bk > 128 * 128:
            continue
        yield {"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "num_warps": nw, "num_stages": ns}
    if rows_per_expert > 32:
        # 8 warps capped at 128 registers: two CTAs per SM (sm90's best dgrad tile at block_m=128)
        for cap in ([128, 168] if full else [128]):
            yield {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3, "maxnreg": cap}


def stage_space(stage: str, full: bool, rows_per_expert: float, tma: bool) -> list[dict]:
    """gemm_space, plus for the down tile on sm90 (tma) the same wide tiles reading h (and dL/dx's
    d[gate|up]) by TMA from persistent programs (stage keys "A_TMA", "PERSISTENT"), which won for
    down and dL/dx at block_m=128 and lost for gate_up and dgrad (docs/performance.md)."""
    space = list(gemm_space(full, rows_per_expert))
    if stage == "down" and tma and rows_per_expert > 32:
        space += [{**c, "A_TMA": True, "PERSISTENT": 1} for c in space if c["BLOCK_N"] >= 128 and "maxnreg" not in c]
    return space


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the short list the sm90 sweeps kept
# (sweep_backward.py): 128x128x64 for short K loops (<= 256 rows per expert), 256x128x64 for long
# (3 stages: with a TMA_STORE tile 4 do not fit in shared memory).
WGRAD_TILES = [(128, 128, 64, 8, 3), (256, 128, 64, 8, 3), (256, 128, 64, 8, 4), (128, 128, 32, 8, 4),
               (128, 64, 32, 4, 3), (64, 128, 64, 4, 3), (64, 64, 32, 4, 3)]


def wgrad_space(full: bool, tma: bool):
    """Each tile with its operands gathered in the K loop and from row-ordered copies ("ROWS");
    on sm90 (tma) with TMA loads ("TMA") and, on copies, TMA stores ("TMA_STORE"). Copies are made
    whole, in 2 or in 4 column chunks ("ROWS_PARTS": fewer launches against less peak memory)."""
    parts = [{"ROWS_PARTS": n} for n in (1, 2, 4)]
    variants = ([{"TMA": True}, {"TMA": True, "ROWS": True}, {}]
                + [{"TMA": True, "ROWS": True, "TMA_STORE": True, **p} for p in parts]
                if tma else [{}] + [{"ROWS": True, **p} for p in parts])
    for bm, bn, bk, nw, ns in WGRAD_TILES:
        for stages in ([ns - 1, ns, ns + 1] if full else [ns]):
            for gm in ([1, 8] if full else [8]):
                cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm, "num_warps": nw,
                       "num_stages": stages}
                for extra in variants:
                    yield {**cfg, **extra}


def decode_space(stage: str, full: bool) -> list[dict]:
    """Tiles of the token-major decode kernels (a bucket's "decode" key): BLOCK_N weight rows per
    program; with plain loads the bytes in flight grow with BLOCK_K, with LOAD_STAGES (3 or 4) the
    loop's loads are pipelined through shared memory, which narrower steps can afford. The down
    kernel holds all K experts' tiles and an accumulator per expert: BLOCK_N <= 8 and at most
    256 * num_warps weights per expert and step (past that ptxas spills)."""
    bns = ([4, 8, 16, 32] if full else [4, 8, 16]) if stage == "gate_up" else [4, 8]
    bks = [64, 128, 256, 512] if full else [128, 256, 512]
    ways = ({}, {"LOAD_STAGES": 3}, {"LOAD_STAGES": 4})
    # a staged step: 16-bit x, gate and up tiles, or the K=8 experts' weight and h tiles
    staged = (lambda bn, bk: 3 * bn * bk * 2) if stage == "gate_up" else (lambda bn, bk: 2 * 8 * bn * bk * 2)
    return [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": 2, **way}
            for bn, bk, nw, way in itertools.product(bns, bks, [4, 8], ways)
            if way.get("LOAD_STAGES", 0) * staged(bn, bk) <= 160 * 1024
            and (stage == "gate_up" or bn * bk <= 256 * nw)]


def tune_decode(bucket, x, gu, dn, idx, w, T, full):
    """The bucket with a "decode" key for calls of up to T tokens where the token-major path beats
    the bucket's grouped GEMMs end to end (routing and combine included); else the bucket as is.
    By GPU time (CUDA-graph replays): at decode an eager call's time is mostly its host's."""
    E, two_i, H = gu.shape
    h = torch.empty(T * idx.shape[1], two_i // 2, device=DEV, dtype=x.dtype)
    out = torch.empty(T, H, device=DEV, dtype=x.dtype)
    _, c_gu = best_of(f"decode_gate_up T={T}", lambda c: launch.decode_gate_up(x, gu, idx, h, c),
                       decode_space("gate_up", full), graphed)
    _, c_dn = best_of(f"decode_down T={T}", lambda c: launch.decode_down(h, dn, idx, w, out, c),
                       decode_space("down", full), graphed)
    if c_gu is None or c_dn is None:
        return bucket
    with_decode = {**bucket, "decode": {"max_tokens": T, "gate_up": c_gu, "down": c_dn}}
    grouped = {k: v for k, v in bucket.items() if k != "decode"}
    ms = {name: (timed(f), graphed(f)) for name, b in (("grouped", grouped), ("decode", with_decode))
          for f in [lambda b=b: moe.fused_experts(x, gu, dn, idx, w, config=b)]}
    print(f" T={T} end to end (eager, graph): grouped {ms['grouped'][0]:.4f} {ms['grouped'][1]:.4f} ms, "
          f"decode {ms['decode'][0]:.4f} {ms['decode'][1]:.4f} ms", flush=True)
    return with_decode if ms["decode"][1] < ms["grouped"][1] else grouped


def sweep_points(sweep_point, default: str) -> None:
    """sweep_point(name, T, variant) for each "shape:T" of $POINTS (default: `default`), freeing the
    allocator's cache between points (the sweep scripts share this)."""
    variant = moe.select_variant(DEV)
    for point in os.environ.get("POINTS", default).split(","):
        name, T = point.split(":")
        sweep_point(name, int(T), variant)
        torch.cuda.empty_cache()


def timed(fn) -> float:
    try:
        fn()
        torch.cuda.synchronize()
        return do_bench(fn, warmup=5, rep=25, return_mode="median")
    except Exception as e:  # noqa: BLE001 - out of shared memory / registers: skip the config
        print("   skip:", type(e).__name__, str(e)[:120], flush=True)
        return math.inf


def graphed(fn) -> float:
    """fn's GPU time: ms per replay of a CUDA graph of one call (inf where it cannot be captured)."""
    try:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return do_bench(graph.replay, warmup=5, rep=25, return_mode="median")
    except Exception as e:  # noqa: BLE001
        print("   graph skip:", type(e).__name__, str(e)[:120], flush=True)
        return math.inf


# --fp8: a wall-clock budget (FP8_BUDGET_S seconds, split over the shapes): past a shape's share
# each stage keeps the best candidate timed so far, so that one GPU call ends with a written file.
_DEADLINE = [math.inf]


def best_of(label, run, space, timer=None):
    """(ms, config) of the fastest config of `space` by `timer` (default `timed`)."""
    best = (math.inf, None)
    for c in space:
        if time.time() > _DEADLINE[0] and best[1] is not None:
            print(f"  {label}: budget spent, keeping {best[1]}", flush=True)
            break
        ms = (timer or timed)(lambda c=c: run(c))
        print(f"  {label} {c} ms={ms:.4f}", flush=True)
        if ms < best[0]:
            best = (ms, c)
    return best


def tune_block_m(bm, x, gu, dn, idx, w, dy, E, H, I, K, T, tma, full, training, rpe, pair=False):
    r = rt.align_rows(idx, E, bm)
    P = r.num_rows
    h = torch.empty(P, I, device=DEV, dtype=x.dtype)
    aux = torch.empty(P, 2 * I, device=DEV, dtype=x.dtype)
    y = torch.empty(P, H, device=DEV, dtype=x.dtype)
    dgu = torch.empty(P, 2 * I, device=DEV, dtype=x.dtype)
    wf = w.reshape(-1).contiguous()
    dws = torch.zeros(wf.shape[0], device=DEV, dtype=torch.float32)
    hw = torch.empty(P, I, device=DEV, dtype=x.dtype)
    dwd = torch.empty_like(dn)
    dwgu = torch.empty_like(gu)
    dx_rows = torch.empty(P, H, device=DEV, dtype=x.dtype)

    def gate_up(c):
        launch.gemm(x, gu, h, r, c, n=I, k=H, epilogue=1, gather_a=True, b_ncontig=False, topk=K, use_tma=tma,
                 aux=aux, save_aux=training, pair=pair)

    def down(c):
        launch.gemm(h, dn, y, r, c, n=H, k=I, epilogue=0, gather_a=False, b_ncontig=False, topk=K, use_tma=tma,
                 pair=pair)
        if training:  # the backward's dL/dx GEMM runs with the down tile: tune them together
            launch.gemm(dgu, gu, dx_rows, r, c, n=H, k=2 * I, epilogue=0, gather_a=False, b_ncontig=True, topk=K,
                     use_tma=tma, pair=pair)

    def dgrad(c):
        launch.gemm(dy, dn, dgu, r, c, n=I, k=H, epilogue=2, gather_a=True, b_ncontig=True, topk=K, use_tma=tma,
                 aux=aux, scale=wf, dscale=dws, h=hw, pair=pair)

    def wgrad(c):  # both weight gradients, as _experts_pipeline.backward runs them
        launch.wgrad_token_operand(dy, hw, dwd, r, c, src_is_a=True, topk=K, use_tma=tma)
        launch.wgrad_token_operand(x, dgu, dwgu, r, c, src_is_a=False, topk=K, use_tma=tma)

    stages = {"gate_up": gate_up, "down": down}
    if training:
        stages["dgrad"] = dgrad
    bucket = {"block_m": bm, **({"pair_m": True} if pair else {})}
    total = 0.0
    label = f"block_m={bm}{' pair_m' if pair else ''}"
    for stage, run in stages.items():
        ms, c = best_of(f"{stage} T={T} {label}", run, stage_space(stage, full, rpe, tma))
        if not training and bm == 128 and tma and not pair and c is not None and stage in ("gate_up", "down"):
            ms, c = gluon_or_triton(stage, ms, c, x, gu, dn, h, y, r, K)
        bucket[stage] = c
        total += ms
    if training:
        ms, c = best_of(f"wgrad T={T} {label}", wgrad, wgrad_space(full, tma))
        bucket["wgrad"] = c
        total += ms
    return bucket, total


def gluon_or_triton(stage, ms, c, x, gu, dn, h, y, r, K):
    """(ms, config) of the inference stage: the best Triton tile `c` (ms), or it with "GLUON" (the
    warp-specialized kernel of `_gluon_gemm`, GROUP_M 1 or 8, gate/up timed with x's row copy it
    reads) where that is faster."""
    gl = sys.modules[moe.__name__ + "._gluon_gemm"]
    weight = gu if stage == "gate_up" else dn
    if not gl.applies(DEV, weight, None, r.block_m, stage == "gate_up"):
        return ms, c
    sms = launch.sm_count(DEV)
    best = (ms, c)
    for group_m in (1, 8):
        if stage == "gate_up":
            def run(g=group_m):
                gl.gemm(launch.gather_rows(x, r, K), None, gu, None, h, None, r, sms, c["num_stages"], g, gated=True)
        else:
            def run(g=group_m):
                gl.gemm(h, None, dn, None, y, None, r, sms, c["num_stages"], g, gated=False)
        t = timed(run)
        print(f"  {stage} block_m=128 GLUON GROUP_M={group_m} ms={t:.4f} (Triton {ms:.4f})", flush=True)
        if t < best[0]:
            best = (t, {**c, "GLUON": True, "GROUP_M": group_m})
    return best


def tune_point(E, H, I, K, T, variant, full, training):
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    gu = torch.randn(E, 2 * I, H, device=DEV, dtype=torch.bfloat16) * 0.02
    dn = torch.randn(E, H, I, device=DEV, dtype=torch.bfloat16) * 0.02
    w, idx = torch.topk(torch.softmax(torch.randn(T, E, device=DEV), -1), K, dim=-1)
    dy = torch.randn_like(x)
    tma = variant == "sm90"
    rpe = T * K / E
    if os.environ.get("DECODE_ONLY") == "1" and T <= DECODE_MAX_TOKENS and rpe <= 4:
        # only the decode kernels, against the shipped bucket (tools/merge_fp8_decode.py puts the key back)
        cap = 90 if variant == "sm90" else 80
        shipped = {k: v for k, v in cfgs.pick_config(cap, E, H, I, T * K).items() if k != "decode"}
        return tune_decode(shipped, x, gu, dn, idx, w, T, full)
    block_ms = [16, 32, 64] if rpe <= 32 else [64, 128]
    if os.environ.get("BLOCK_MS"):  # e.g. BLOCK_MS=64 to retune one bucket's tiles only
        block_ms = [int(b) for b in os.environ["BLOCK_MS"].split(",")]
    # (block_m, pair_m): 64-row padding with paired 128-row tiles too, from 64 rows per expert up
    choices = [(bm, False) for bm in block_ms] + ([(64, True)] if rpe > 32 and 64 in block_ms else [])
    best_total, best_bucket = math.inf, None
    # Decode: also try pointer loads on sm90 (no host descriptors; see _experts_pipeline.use_tma).
    tmas = [True, False] if tma and rpe <= 4 else [tma]
    for (bm, pair), use_tma in itertools.product(choices, tmas):
        bucket, total = tune_block_m(bm, x, gu, dn, idx, w, dy, E, H, I, K, T, use_tma, full, training, rpe, pair)
        bucket["tma"] = use_tma
        print(f" block_m={bm}{' pair_m' if pair else ''} tma={use_tma} total={total:.4f} ms", flush=True)
        if total < best_total:
            best_total, best_bucket = total, bucket
    if T <= DECODE_MAX_TOKENS and rpe <= 4:
        best_bucket = tune_decode(best_bucket, x, gu, dn, idx, w, T, full)
    return best_bucket


# ---- fp8 block-quantized weights (--fp8): configs/fp8_<variant>.json ----

FP8_SHAPES = ("deepseek_v3", "qwen3_30b_a3b")  # issue 31's shapes
FP8_MAX_ACC = 64  # fp32 accumulator elements per thread (gate/up: both): above, the tile spills on sm90
FP8_SMEM = 220 * 1024  # shared memory a candidate may use (227 KB per block on H100, some kept for the epilogue)


def fp8_stage_space(stage: str, block_m: int, rows_per_expert: float, w8a16: bool) -> list[dict]:
    """A short list per stage: tiles whose accumulators fit the registers - the rule the sm90
    compiles follow (tools/compile_fp8_sm90.py): up to FP8_MAX_ACC fp32 elements per thread beside
    the per-K-block product of the same size, up to twice that with "RESCALE" (no product
    registers; not for 128-row gate/up tiles, which still spill) - and whose stages fit shared
    memory. fp8 gate/up tiles are 128 columns (one quantization group of h); 128-row stages may run
    64-row tiles ("BLOCK_M")."""
    gate_up = stage == "gate_up"
    decode = rows_per_expert <= 4
    if gate_up:
        bns = ([32, 64, 128] if decode else [64, 128]) if w8a16 else [128]
    else:  # (down: 64-column tiles lose by 1.3-1.8x from 64 rows per expert, s36 sweep on an H100)
        bns = [64, 128] if decode else ([64, 128, 256] if rows_per_expert <= 48 else [128, 256])
    heights = [block_m] + ([64] if block_m == 128 else [])
    # (2 stages: two 4-warp CTAs fit an SM, one scaling its K step while the other's MMA runs)
    stages = [4] if decode else [2, 3, 4]
    space = []
    for bm, bn, nw, ns in itertools.product(heights, bns, [4, 8], stages):
        acc = bm * bn * (2 if gate_up else 1) // (32 * nw)
        a_bytes = 2 if w8a16 else 1
        rescale = not w8a16 and FP8_MAX_ACC < acc <= 2 * FP8_MAX_ACC and not (gate_up and bm == 128)
        if (acc > FP8_MAX_ACC and not rescale) or acc < 8:
            continue
        if ns * (bm * a_bytes + (2 if gate_up else 1) * bn) * 128 > FP8_SMEM:
            continue
        if gate_up and w8a16 and nw == 8:  # (W8A16 gate/up: 8 warps buy nothing at decode and 32x64 spills)
            continue
        c = {"BLOCK_N": bn, "num_warps": nw, "num_stages": ns}
        if bm != block_m:
            c["BLOCK_M"] = bm
        if rescale:
            c["RESCALE"] = True
        if not gate_up and not decode:
            c["A_TMA"] = True
        space.append(c)
        if gate_up and not decode and not w8a16:  # x quantized into row order, A by TMA; one gate/up MMA
            space.append({**c, "A_TMA": True, "FUSED": True})
    if block_m == 128 and not w8a16 and os.environ.get("FP8_WIDE", "1") != "0":  # (first: a budget cut keeps them)
        wide = fp8_wide_tiles(gate_up)
        space = wide + [c for c in space if c not in wide]
    if os.environ.get("FP8_FOCUS") == "1" and not decode and not w8a16:
        space = [c for c in space if _focus(c, gate_up)]
    return space


def _focus(c: dict, gate_up: bool) -> bool:
    """FP8_FOCUS=1 (a sweep that fits one GPU call with its compiles): gate/up tiles with x in row
    order and one MMA (FUSED), and the shipped kind (64 rows, 8 warps, 3 stages) as the baseline;
    down tiles 256 wide, 128 wide on 4 warps, and the shipped 128 x 128."""
    if gate_up:
        return bool(c.get("FUSED")) or (c.get("BLOCK_M") == 64 and c["num_warps"] == 8 and c["num_stages"] == 3)
    return c["BLOCK_N"] == 256 or c["num_warps"] == 4 or (c["num_warps"] == 8 and c["num_stages"] == 3)


def fp8_wide_tiles(gate_up: bool) -> list[dict]:
    """Full 128-row tiles (128 x 128 gate/up with its up half, 128 x 256 down) that the register
    rule above leaves out: 8 warps with RESCALE (the gate/up one spills 400 bytes as two tiles, none
    as one FUSED tile; ptxas sm90), also persistent. (16-warp tiles, 128 registers a thread, spill
    and took 1.7-12x the time on an H100: s38 sweep.)"""
    bn = 128 if gate_up else 256
    out = [{"BLOCK_N": bn, "num_warps": 8, "num_stages": ns, "RESCALE": True} for ns in (3, 4)]
    # (A by TMA: down's h; gate/up's x quantized into row order with one MMA per K step, or neither)
    new = [{**c, "A_TMA": True, **({"FUSED": True} if gate_up else {})} for c in out]
    return new + [{**new[0], "PERSISTENT": 1}] + (out if gate_up else [])


def fp8_decode_space(stage: str) -> list[dict]:
    """Tiles of the fp8 token-major decode kernels (`_fp8_decode`; a bucket's "decode" key): BLOCK_N
    weight rows per program; BLOCK_K from 32 to 1024 columns (past 128: whole scale blocks). Plain
    loads leave one K step's tile in flight per program, yet at DeepSeek-V3 T=1 the down kernel took
    twice as long with 128-column steps as with 64 (s39-1); the down kernel holds all K experts'
    tiles at once, hence its narrower rows. Each tile every way, next to each other so that a budget
    cut leaves all timed: plain, PREFETCH (the next step's loads issued before this step's math),
    LOAD_STAGES 3 and 4 (the loop's loads pipelined through shared memory), and, for down, PDL
    (launched as a programmatic dependent of gate/up; sm90), also with PREFETCH (then the first
    step's weights are loaded before the wait for gate/up); and GLUON (the Gluon kernels of
    `_fp8_decode_gluon` on a capability 9.0 GPU, steps of at most 512 columns; down also with PDL;
    elsewhere they time the plain Triton tile again)."""
    if stage == "gate_up":
        # (s42: Qwen3-30B-A3B T=1 picked the widest step, (4, 512); hence (4, 1024) and (8, 512))
        pairs = [(4, 64), (4, 128), (8, 64), (8, 128), (16, 64), (32, 64), (4, 512), (8, 256), (16, 128), (4, 1024),
                 (8, 512)]
    else:
        pairs = [(4, 32), (4, 64), (8, 32), (8, 64), (16, 32), (16, 64), (4, 128), (8, 128), (16, 128)]
    ways = ({}, {"PREFETCH": True}, {"LOAD_STAGES": 3}, {"LOAD_STAGES": 4}, {"GLUON": True})
    if stage == "down":
        ways += ({"PDL": True}, {"PDL": True, "PREFETCH": True}, {"PDL": True, "GLUON": True})
    tiles = []
    for (bn, bk), nw, way in itertools.product(pairs, (4, 8), ways):
        # (the down tile holds 8 experts' rows and an accumulator per expert: more than 64 weights per
        # thread spills)
        if (stage == "down" and bn * bk * 8 > 64 * 32 * nw) or (way.get("GLUON") and bk > 512):
            continue
        tiles.append({"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": 2, **way})
    return tiles


def fp8_tune_decode(fp8x, variant, best, x, gu, gus, dn, dns, idx, w):
    """`best` with a "decode" key for calls of up to T tokens where the token-major kernels beat it
    end to end; else `best` as is."""
    T = x.shape[0]
    first = {s: fp8_decode_space(s)[0] for s in ("gate_up", "down")}

    def run(stage):
        return lambda c: fp8x.decode_forward(x, gu, dn, idx, w, gus, dns, {"max_tokens": T, **first, stage: c})

    # each stage by GPU time too: eager, a pinned decode call's Python outlasts its kernels
    _, first["gate_up"] = best_of(f"fp8 decode_gate_up T={T}", run("gate_up"), fp8_decode_space("gate_up"), graphed)
    _, first["down"] = best_of(f"fp8 decode_down T={T}", run("down"), fp8_decode_space("down"), graphed)
    if first["gate_up"] is None or first["down"] is None:
        return best
    with_decode = {**best, "decode": {"max_tokens": T, **first}}
    calls = {k: (lambda b=b: moe.fused_experts(x, gu, dn, idx, w, gate_up_proj_scale_inv=gus, down_proj_scale_inv=dns,
                                               variant=variant, config=b))
             for k, b in (("grouped", best), ("decode", with_decode))}
    # by GPU time (each call replayed from a CUDA graph): an unpinned decode call replays its
    # launches without the pinned call's Python, so the eager times here are mostly host time
    ms = {k: (timed(f), graphed(f)) for k, f in calls.items()}
    print(f" fp8 T={T} end to end (eager, graph): grouped {ms['grouped'][0]:.4f} {ms['grouped'][1]:.4f} ms, "
          f"decode {ms['decode'][0]:.4f} {ms['decode'][1]:.4f} ms", flush=True)
    return with_decode if ms["decode"][1] < ms["grouped"][1] else best


def fp8_weights(E: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 weights [E, n, k] (random normal values, 16 experts at a time) and plausible block scales:
    timing needs the bytes and the shapes, not a quantized model."""
    w = torch.empty(E, n, k, device=DEV, dtype=torch.float8_e4m3fn)
    for e in range(0, E, 16):
        w[e:e + 16] = torch.randn(min(16, E - e), n, k, device=DEV, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    s = torch.rand(E, math.ceil(n / 128), math.ceil(k / 128), device=DEV) * 1e-3 + 1e-3
    return w, s


def fp8_tune_block_m(fp8x, variant, bm, x, gu, gus, dn, dns, idx, K, rpe, w8a16):
    """(bucket, total ms of both GEMMs) at alignment bm: each stage's best tile."""
    E, two_i, H = gu.shape
    inter = two_i // 2
    r = rt.align_rows(idx, E, bm)
    fp8_dot = variant == "sm90" and not w8a16
    tma = variant == "sm90"
    P = r.num_rows
    if fp8_dot:
        xq, xs = fp8x.quantize_x(x)
        xr, xrs = fp8x.quantize_x(x, r, K)  # (row order: gate/up "A_TMA")
        h = torch.empty(P, inter, device=DEV, dtype=torch.float8_e4m3fn)
        hs = torch.ones(P, math.ceil(inter / 128), device=DEV)
    else:
        xq, xs = x, None
        h, hs = torch.empty(P, inter, device=DEV, dtype=x.dtype), None
    y = torch.empty(P, H, device=DEV, dtype=x.dtype)
    runs = {
        "gate_up": lambda c: fp8x._gemm(*((xr, xrs) if c.get("A_TMA") else (xq, xs)), gu, gus, h, hs, r, c, n=inter,
                                        k=H, epilogue=1, gather_a=not c.get("A_TMA"), topk=K, fp8_dot=fp8_dot,
                                        tma=tma),
        "down": lambda c: fp8x._gemm(h, hs, dn, dns, y, None, r, c, n=H, k=inter, epilogue=0, gather_a=False, topk=K,
                                     fp8_dot=fp8_dot, tma=tma),
    }
    bucket = {"block_m": bm, "tma": tma}
    if w8a16 and variant == "sm90":
        bucket["w8a16"] = True
    total = 0.0
    for stage, run in runs.items():
        if stage == "down":  # h as the gate/up GEMM leaves it (finite values and scales)
            runs["gate_up"](bucket["gate_up"])
        ms, c = best_of(f"fp8 {stage} block_m={bm}{' w8a16' if w8a16 else ''}", run,
                        fp8_stage_space(stage, bm, rpe, w8a16 or variant != "sm90"))
        if c is None:
            return None, math.inf
        gl_ms = fp8_time_gluon(fp8x, stage, bm, fp8_dot and tma, xr if fp8_dot else None, xrs if fp8_dot else None,
                               gu, gus, dn, dns, h, hs, y, r, c)
        if gl_ms < ms:  # (the Triton tile stays: it runs where the Gluon kernels cannot)
            ms, c = gl_ms, {**c, "GLUON": True}
        bucket[stage] = c
        total += ms
    return bucket, total


def fp8_time_gluon(fp8x, stage, bm, fp8_tma, xr, xrs, gu, gus, dn, dns, h, hs, y, r, c) -> float:
    """ms of the stage in the Gluon kernel of `_gluon_gemm` (bucket key "GLUON", with the stage's
    num_stages) where it can run (sm90 fp8 math with TMA, 128-row alignment, its tile shapes);
    inf elsewhere."""
    gl8 = fp8x.gluon_gemm
    gated = stage == "gate_up"
    w, sc = (gu, gus) if gated else (dn, dns)
    if not (fp8_tma and gl8.applies(DEV, w, sc, bm, gated)):
        return math.inf
    sms = launch.sm_count(DEV)
    if gated:
        ms = timed(lambda: gl8.gemm(xr, xrs, gu, gus, h, hs, r, sms, c["num_stages"]))
    else:
        ms = timed(lambda: gl8.gemm(h, hs, dn, dns, y, None, r, sms, c["num_stages"]))
    print(f"  fp8 {stage} block_m={bm} GLUON stages={c['num_stages']} ms={ms:.4f}", flush=True)
    return ms


def fp8_tune_point(fp8x, variant, x, gu, gus, dn, dns, idx, w, K):
    """The best bucket at one load: per block_m (and at decode, W8A16 or fp8 math) each stage's best
    tile; then, end to end (routing, quantize pass, GEMMs, combine), x quantized by its own pass or
    in the gate/up load."""
    E, T = gu.shape[0], x.shape[0]
    rpe = T * K / E
    if os.environ.get("FP8_DECODE_ONLY") == "1" and T <= DECODE_MAX_TOKENS and rpe <= 4:
        # the shipped bucket as the grouped path; only the token-major kernels swept against it
        fp8c = importlib.import_module(moe.__name__ + "._fp8_configs")
        shipped = fp8c.pick_fp8_config(variant, E, x.shape[1], gu.shape[1] // 2, T * K)
        return _checked(fp8_tune_decode(fp8x, variant, {k: v for k, v in shipped.items() if k != "decode"},
                                        x, gu, gus, dn, dns, idx, w), variant, x, gu, gus, dn, dns, idx, w)
    block_ms = [16, 32] if rpe <= 4 else ([32, 64] if rpe <= 48 else [64, 128])
    only = {int(b) for b in os.environ.get("FP8_BLOCK_MS", "").split(",") if b}  # (a shorter sweep)
    block_ms = [b for b in block_ms if b in only] or block_ms
    # (W8A16 math: always on sm80; on sm90 a decode candidate, where weight bytes bound the time)
    maths = [True] if variant == "sm80" else ([False, True] if rpe <= 4 else [False])
    best_total, best = math.inf, None
    for bm, w8a16 in itertools.product(block_ms, maths):
        bucket, total = fp8_tune_block_m(fp8x, variant, bm, x, gu, gus, dn, dns, idx, K, rpe, w8a16)
        print(f" fp8 block_m={bm} w8a16={w8a16} GEMMs {total:.4f} ms", flush=True)
        if total < best_total:
            best_total, best = total, bucket
    if best is None:
        return None

    def e2e(b):
        return timed(lambda: moe.fused_experts(x, gu, dn, idx, w, gate_up_proj_scale_inv=gus, down_proj_scale_inv=dns,
                                               variant=variant, config=b))

    if variant == "sm90" and not best.get("w8a16"):
        # (in-load quantization gathers x: gate/up's "A_TMA" needs the quantize pass)
        gathering = {**best, "gate_up": {k: v for k, v in best["gate_up"].items() if k != "A_TMA"}}
        ms = {True: e2e(best), False: e2e({**gathering, "quant_x": False})}
        print(f" fp8 T={T} end to end: quantize pass {ms[True]:.4f} ms, in-load {ms[False]:.4f} ms", flush=True)
        best = {**best, "quant_x": True} if ms[True] <= ms[False] else {**gathering, "quant_x": False}
    else:
        print(f" fp8 T={T} end to end: {e2e(best):.4f} ms", flush=True)
    if T <= DECODE_MAX_TOKENS and rpe <= 4:
        best = fp8_tune_decode(fp8x, variant, best, x, gu, gus, dn, dns, idx, w)
    return _checked(best, variant, x, gu, gus, dn, dns, idx, w)


def _checked(best, variant, x, gu, gus, dn, dns, idx, w):
    """`best` after a guard on it (the sweep times, it does not check): against the W8A16 kernel,
    which does not quantize activations, the fp8 math differs by what that quantization costs (~4-5%)."""
    got, want = (moe.fused_experts(x, gu, dn, idx, w, gate_up_proj_scale_inv=gus, down_proj_scale_inv=dns,
                                   variant=v, config=b) for v, b in ((variant, best), ("sm80", None)))
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    print(f" fp8 T={x.shape[0]} check: relative difference to the W8A16 kernel {err:.4f}", flush=True)
    if not err < 0.1:
        raise SystemExit(f"fp8 T={x.shape[0]}: the picked bucket's output is off ({err:.3g}): {best}")
    return best


def main_fp8(out_dir: Path) -> None:
    """Sweep the fp8 variant of this GPU (sm90 from sm89 up, else sm80) at issue 31's shapes and
    tokens and write out_dir/fp8_<variant>.json ("shapes" buckets beside the shipped defaults)."""
    fp8x = importlib.import_module(moe.__name__ + "._fp8_experts")
    fp8c = importlib.import_module(moe.__name__ + "._fp8_configs")
    variant = moe.select_variant_fp8(DEV)
    if variant not in ("sm90", "sm80"):
        raise SystemExit(f"no fp8 Triton variant on this device ({variant})")
    path = out_dir / f"fp8_{variant}.json"
    data = json.loads(path.read_text()) if path.exists() else json.loads((fp8c._DIR / path.name).read_text())
    only = [s for s in os.environ.get("SHAPES", "").split(",") if s] or list(FP8_SHAPES)
    tokens = sorted(int(t) for t in os.environ.get("TOKENS", "1,32,512,4096,16384").split(","))
    summary = []
    start, budget = time.time(), float(os.environ.get("FP8_BUDGET_S", "400"))
    for n_shape, name in enumerate(only):
        # each shape's share of the budget (cumulative: time one shape leaves goes to the next)
        _DEADLINE[0] = start + budget * (n_shape + 1) / len(only)
        s = SHAPES[name]
        E, H, I, K = s["E"], s["H"], s["I"], s["K"]
        gu, gus = fp8_weights(E, 2 * I, H)
        dn, dns = fp8_weights(E, H, I)
        buckets = []
        for i, T in enumerate(tokens):
            t0 = time.time()
            x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
            w, idx = torch.topk(torch.softmax(torch.randn(T, E, device=DEV), -1), K, dim=-1)
            b = fp8_tune_point(fp8x, variant, x, gu, gus, dn, dns, idx, w, K)
            if b is None:
                continue
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            b["max_rows_per_expert"] = None if nxt is None else math.sqrt(T * nxt) * K / E
            fp8c.check_fp8_bucket(b, f"tuned {name} T={T}", variant)
            buckets.append(b)
            summary.append(f"best fp8 {variant} {name} T={T}: {json.dumps(b, sort_keys=True)}")
            print(f"== {summary[-1]} ({time.time() - t0:.0f}s, {time.time() - start:.0f}s in)", flush=True)
        if buckets:
            buckets[-1]["max_rows_per_expert"] = None
            data.setdefault("shapes", {})[cfgs.shape_key(E, H, I)] = buckets
            path.write_text(json.dumps(data, indent=1) + "\n")
            print(f"wrote {path}", flush=True)
        del gu, gus, dn, dns
        torch.cuda.empty_cache()
    print("\n".join(summary), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp") + "/moe_configs")
    ap.add_argument("--full", action="store_true", help="a larger grid (about 6x the configs)")
    ap.add_argument("--forward-only", action="store_true", help="tune gate_up/down only (inference)")
    ap.add_argument("--fp8", action="store_true", help="tune the fp8-weights path (configs/fp8_<variant>.json)")
    args = ap.parse_args()
    if args.fp8:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        main_fp8(out)
        return
    variant = moe.select_variant(DEV)
    cap = 90 if variant == "sm90" else 80
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"sm{cap}.json"
    data = json.loads(path.read_text()) if path.exists() else copy.deepcopy(cfgs._load(cap))
    only = [s for s in os.environ.get("SHAPES", "").split(",") if s]
    tokens = sorted(int(t) for t in os.environ.get("TOKENS", "1,32,512,4096,16384").split(","))
    if os.environ.get("BUDGET_S"):  # (past it each stage keeps its best candidate so far, as --fp8 does)
        _DEADLINE[0] = time.time() + float(os.environ["BUDGET_S"])
    for name, s in SHAPES.items():
        if only and name not in only:
            continue
        E, H, I, K = s["E"], s["H"], s["I"], s["K"]
        buckets = []
        for i, T in enumerate(tokens):
            t0 = time.time()
            b = tune_point(E, H, I, K, T, variant, args.full, not args.forward_only)
            for stage in ("dgrad", "wgrad"):
                b.setdefault(stage, cfgs.pick_config(cap, E, H, I, T * K)[stage])
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            b["max_rows_per_expert"] = None if nxt is None else math.sqrt(T * nxt) * K / E
            buckets.append(b)
            print(f"== {name} T={T} best {b} ({time.time() - t0:.0f}s)", flush=True)
        data.setdefault("shapes", {})[cfgs.shape_key(E, H, I)] = buckets
        path.write_text(json.dumps(data, indent=1))
        print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
