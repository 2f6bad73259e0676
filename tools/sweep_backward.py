"""Sweep the backward tiles (dgrad GEMM, both weight-gradient GEMMs) of a (shape, T) point's bucket.

The forward tiles were tuned by `tune_moe.py`; this is the short list to check the backward ones
(the dgrad epilogue and the weight gradients set the forward+backward time at large T).
Usage (repo root, GPU): PYTHONPATH=src python tools/sweep_backward.py
  env: POINTS=mixtral_8x7b:16384,deepseek_v3:16384  PARTS=dgrad,wgrad  NOGATHER=1 (also time the wgrad
  GEMMs on operands already in row order, as the wgrad key "ROWS" does, and the copy; NOGATHER=only:
  those alone)
  PARTS=fwd (+ FWD_BLOCK_MS=64,128, PAIR=1): the forward GEMMs' short list per block_m (PAIR=1: also
  rows padded to 64 with paired 128-row tiles, the bucket key "pair_m")
  PARTS=dx: the dL/dx GEMM with the forward "down" short list (the stage it runs with)
  PARTS=dgrad also times the GEMM with a plain store (dgrad_plain) and tiles under a register cap
  PROBE=1 (the current wgrad tile against writing its output alone: zero_() and the kernel with no rows)
  WGRADS=flat: the wgrad list is the bucket's own tile and the flattened persistent ones ("FLAT_STEPS";
  FLAT_CAP=n sets their cap)
"""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels_repo" / "moe" / "benchmarks"))
from tune_moe import DEV, SHAPES, launch, pipeline, rt, sweep_points, timed  # noqa: E402  (kernels_repo/moe/benchmarks/)


def _tile(bn: int, bk: int, warps: int, stages: int) -> dict:
    """A gate_up/down/dgrad tile of the short lists (GROUP_M 8 throughout)."""
    return {"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps, "num_stages": stages}


# Measured and dropped from the list (H200, 2026-12-03 s4 call 2, ms at Qwen3 T=4096 / T=16384 /
# DeepSeek-V3 T=4096 against 0.422 / 1.351 / 3.424 for 128x64x64 / 8 warps / 4 stages): 256x64 / 8 /
# 3 (0.606 / 1.889 / 3.646), 128x64 / 4 / 4 (0.756 / 2.428 / 4.474), 64x128 / 4 / 4, 128x64 / 8 / 3
# uncapped (0.474 / 1.510 / 3.644; ~180 registers, one CTA per SM), 128x128 / 8 / 4 (no launch).
DGRAD = [
    _tile(128, 64, 8, 4),
    _tile(128, 128, 8, 3),
]
# Under a register cap ("maxnreg") two 8-warp CTAs share an SM (3 stages of 128x64x64 fit twice in
# shared memory), so that one CTA's epilogue runs while the other's MMAs do.
DGRAD_REGS = [
    {**_tile(128, 64, 8, 3), "maxnreg": 128},
    {**_tile(128, 64, 8, 2), "maxnreg": 128},
    {**_tile(128, 128, 8, 2), "maxnreg": 128},
    {**_tile(64, 64, 8, 3), "maxnreg": 128},
    {**_tile(128, 64, 8, 3), "maxnreg": 120},
    {**_tile(128, 64, 8, 3), "maxnreg": 112},
]
# The wgrad K loop loads its row indices, then the rows: that chain costs the software pipeline
# stages, so num_stages 3 and 4 keep two buffers (prefetch distance 1), 5-6 three, 7 four (TTGIR).
_TS = {"TMA": True, "TMA_STORE": True}
WGRAD = [
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, **_TS},  # <= 256 rows
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 2, **_TS},  # 2 CTAs / SM
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3, **_TS},
    {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3, **_TS},
    {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4, "TMA": True},  # > 256 rows
    {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, **_TS},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, **_TS},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4, **_TS},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 2, **_TS, "maxnreg": 128},
]

# "FLAT_STEPS": persistent programs, tile loop and K loop flattened into one pipelined loop (the
# largest expert's step count for every tile). WGRADS=flat sweeps these and the bucket's own tile.
# Measured and dropped (H200, 2026-12-03 s6 call 4, DeepSeek-V3 / Qwen3 T=4096, ms of both weight
# gradients on row copies, against 11.25 / 0.799 for one 128x128 program per tile): 128x128 / 3
# stages 12.75 / 0.980, / 4 stages 10.89 / 0.780, 2 programs per SM at 2 stages 12.43 / 0.872, no
# TMA store 12.85 / 0.977; 128x256 / 3 stages 10.14 / 0.751 is the shipped tile (seventh session).
# FLAT_CAP=n: the cap of these entries (default 16, as shipped; > 256 rows per expert needs more)
_FLAT = {"BLOCK_K": 64, "num_warps": 8, **_TS, "PERSISTENT": 1, "FLAT_STEPS": int(os.environ.get("FLAT_CAP", 16))}
WGRAD_FLAT = [
    {"BLOCK_M": 128, "BLOCK_N": 256, "num_stages": 3, **_FLAT},
    {"BLOCK_M": 256, "BLOCK_N": 128, "num_stages": 3, **_FLAT},
    {"BLOCK_M": 128, "BLOCK_N": 256, "num_stages": 3, "GROUP_M": 4, **_FLAT},
    {"BLOCK_M": 128, "BLOCK_N": 256, "num_stages": 2, **_FLAT},
    {"BLOCK_M": 128, "BLOCK_N": 256, "num_stages": 3, **_FLAT, "TMA_STORE": False},
    {"BLOCK_M": 128, "BLOCK_N": 256, "num_stages": 3, "GROUP_M": 8, **_FLAT},
    {"BLOCK_M": 128, "BLOCK_N": 256, **_FLAT, "BLOCK_K": 32, "num_stages": 5},
]


# Forward short list per block_m (PARTS=fwd): the bucket's current tiles come first.
FWD = {
    64: {"gate_up": [_tile(128, 64, 8, 4), _tile(64, 128, 4, 4), _tile(128, 128, 8, 3)],
         "down": [_tile(256, 64, 8, 3), _tile(128, 128, 4, 3), _tile(128, 64, 8, 5)]},
    128: {"gate_up": [_tile(128, 64, 8, 4), _tile(64, 64, 4, 5), _tile(64, 128, 8, 3),
                      {**_tile(64, 64, 8, 3), "maxnreg": 128}],
          "down": [_tile(256, 64, 8, 3), _tile(128, 64, 8, 4), _tile(128, 128, 8, 3),
                   {**_tile(128, 64, 8, 3), "maxnreg": 128}, {**_tile(128, 128, 8, 2), "maxnreg": 128}]},
}


def sweep_forward(name: str, T: int, variant: str, x, gu, dn, idx) -> None:
    """The inference GEMMs (gate_up with its SwiGLU epilogue, down) per block_m (FWD_BLOCK_MS=64,128);
    PAIR=1 adds rows padded to 64 with the 128-row tiles run as paired blocks (bucket key "pair_m")."""
    E, two_i, H = gu.shape
    I, K = two_i // 2, idx.shape[1]
    cur = pipeline.bucket(variant, E, H, I, T * K, None, DEV, 2)
    runs = [(int(b), False) for b in os.environ.get("FWD_BLOCK_MS", "64,128").split(",")]
    if os.environ.get("PAIR") == "1":
        runs.append((64, True))
    for bm, pair in runs:
        r = rt.align_rows(idx, E, bm)
        h = torch.empty(r.num_rows, I, device=DEV, dtype=x.dtype)
        y = torch.empty(r.num_rows, H, device=DEV, dtype=x.dtype)
        tma = pipeline.use_tma(variant, cur, gu, dn)
        tiles = FWD[2 * bm if pair else bm]
        for stage in ("gate_up", "down"):
            cands = tiles[stage] + ([cur[stage]] if bm == cur["block_m"] and cur[stage] not in tiles[stage]
                                    else [])
            for c in cands:
                if stage == "gate_up":
                    run = partial(launch.gemm, x, gu, h, r, c, n=I, k=H, epilogue=1, gather_a=True)
                else:
                    run = partial(launch.gemm, h, dn, y, r, c, n=H, k=I, epilogue=0, gather_a=False)
                ms = timed(partial(run, b_ncontig=False, topk=K, use_tma=tma, pair=pair))
                mark = " (current)" if bm == cur["block_m"] and c == cur[stage] and not pair else ""
                label = f"block_m={bm}{' pair' if pair else ''}"
                print(f"fwd {name} T={T} {label} {stage} {c} ms={ms:.3f}{mark}", flush=True)


def sweep_point(name: str, T: int, variant: str) -> None:
    s = SHAPES[name]
    E, H, I, K = s["E"], s["H"], s["I"], s["K"]
    cfg = pipeline.bucket(variant, E, H, I, T * K, None, DEV, 2)
    bm = cfg["block_m"]
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    gu = torch.randn(E, 2 * I, H, device=DEV, dtype=torch.bfloat16) * 0.02
    dn = torch.randn(E, H, I, device=DEV, dtype=torch.bfloat16) * 0.02
    w, idx = torch.topk(torch.softmax(torch.randn(T, E, device=DEV), -1), K, dim=-1)
    dy = torch.randn_like(x)
    r = rt.align_rows(idx, E, bm)
    P = r.num_rows
    tma = pipeline.use_tma(variant, cfg, gu, dn)
    aux = torch.randn(P, 2 * I, device=DEV, dtype=x.dtype)
    dgu = torch.randn(P, 2 * I, device=DEV, dtype=x.dtype)
    hw = torch.randn(P, I, device=DEV, dtype=x.dtype)  # TMA boxes read padding rows too
    wf = w.reshape(-1).contiguous()
    dws = torch.zeros(wf.shape[0], device=DEV, dtype=torch.float32)
    dwd, dwgu = torch.empty_like(dn), torch.empty_like(gu)
    print(f"== {name} T={T} block_m={bm} current dgrad={cfg['dgrad']} wgrad={cfg['wgrad']}", flush=True)

    def dgrad(c):
        launch.gemm(dy, dn, dgu, r, c, n=I, k=H, epilogue=2, gather_a=True, b_ncontig=True, topk=K,
                 use_tma=tma, aux=aux, scale=wf, dscale=dws, h=hw)

    parts = os.environ.get("PARTS", "dgrad,wgrad").split(",")
    if "fwd" in parts:
        sweep_forward(name, T, variant, x, gu, dn, idx)
    if os.environ.get("PROBE"):  # where a wgrad GEMM's time goes: writing its output alone
        empty = r._replace(expert_count=torch.zeros_like(r.expert_count))  # no rows: K loop skipped
        c = cfg["wgrad"]
        for label, out, args in (("down", dwd, (dy, hw)), ("gate_up", dwgu, (dgu, x))):
            down = label == "down"

            def run(routing, out=out, args=args, down=down):
                launch.wgrad(*args, out, routing, c, gather_a=down, gather_b=not down, topk=K, use_tma=tma)

            fill = timed(lambda out=out: out.zero_())
            store, full = timed(lambda run=run: run(empty)), timed(lambda run=run: run(r))
            gb = out.numel() * out.element_size() / 1e9
            print(f"probe {name} T={T} {label} GB={gb:.2f} fill_ms={fill:.3f} store_only_ms={store:.3f} "
                  f"wgrad_ms={full:.3f} {c}", flush=True)
    rows_h = torch.randn(P, H, device=DEV, dtype=x.dtype) if os.environ.get("NOGATHER") else None
    if rows_h is not None:
        ms = timed(lambda: launch.gather_rows(x, r, K))
        print(f"gather_rows {name} T={T} ms={ms:.3f} (one row-ordered copy, the ROWS key)", flush=True)
    if "dgrad" in parts:  # the same GEMM with a plain store: what the SwiGLU-backward epilogue costs
        c, plain = cfg["dgrad"], torch.empty(P, I, device=DEV, dtype=x.dtype)
        ms = timed(lambda: launch.gemm(dy, dn, plain, r, c, n=I, k=H, epilogue=0, gather_a=True, b_ncontig=True,
                                    topk=K, use_tma=tma))
        print(f"dgrad_plain {name} T={T} {c} ms={ms:.3f}", flush=True)
    dx_rows = torch.empty(P, H, device=DEV, dtype=x.dtype) if "dx" in parts else None
    for c in FWD[bm]["down"] if "dx" in parts else ():  # dL/dx rows: d[gate|up] @ W_gate_up ("down" tiles)
        ms = timed(lambda c=c: launch.gemm(dgu, gu, dx_rows, r, c, n=H, k=2 * I, epilogue=0, gather_a=False,
                                        b_ncontig=True, topk=K, use_tma=tma))
        print(f"dx {name} T={T} {c} ms={ms:.3f}{' (current)' if c == cfg['down'] else ''}", flush=True)
    for c in DGRAD + DGRAD_REGS if "dgrad" in parts else ():
        print(f"dgrad {name} T={T} {c} ms={timed(lambda c=c: dgrad(c)):.3f}", flush=True)

    def time_rows(c):  # both operands already in row order (no gather): what the "ROWS" key runs
        ms1 = timed(lambda: launch.wgrad(rows_h, hw, dwd, r, c, gather_a=False, gather_b=False, topk=K, use_tma=tma))
        ms2 = timed(lambda: launch.wgrad(dgu, rows_h, dwgu, r, c, gather_a=False, gather_b=False, topk=K, use_tma=tma))
        print(f"rows  {name} T={T} {c} down_ms={ms1:.3f} gate_up_ms={ms2:.3f} sum={ms1 + ms2:.3f}", flush=True)

    wgrads = WGRAD
    if os.environ.get("WGRADS") == "flat":  # the bucket's own tile (ROWS as shipped) against the flat list
        own = {k: v for k, v in cfg["wgrad"].items() if k not in ("ROWS", "ROWS_PARTS")}
        wgrads = [own] + WGRAD_FLAT
    for c in wgrads if "wgrad" in parts else ():
        if os.environ.get("NOGATHER") != "only":
            ms1 = timed(lambda c=c: launch.wgrad(dy, hw, dwd, r, c, gather_a=True, gather_b=False, topk=K,
                                                 use_tma=tma))
            ms2 = timed(lambda c=c: launch.wgrad(dgu, x, dwgu, r, c, gather_a=False, gather_b=True, topk=K,
                                                 use_tma=tma))
            print(f"wgrad {name} T={T} {c} down_ms={ms1:.3f} gate_up_ms={ms2:.3f} sum={ms1 + ms2:.3f}", flush=True)
        if rows_h is not None:
            time_rows(c)


def main() -> None:
    sweep_points(sweep_point, "mixtral_8x7b:16384,deepseek_v3:16384,qwen3_30b_a3b:16384")


if __name__ == "__main__":
    main()
