"""Time grouped GEMM stages with the stage keys "PERSISTENT" and "A_TMA" against the shipped tiles.

Per (shape, T) point and stage (STAGES: gate_up with its SwiGLU epilogue, gate_up_train (the same,
saving [g | u] as training does), down, dgrad with the
SwiGLU-backward epilogue, dx = dL/dx, which runs with the "down" tile), each candidate bucket is
timed in ROUNDS interleaved rounds and the median is printed: within one call the same kernel read
up to 30% slower late in a long sequential sweep (s10 call 2), so candidates are never timed in
blocks. A shipped bucket with "pair_m" is also timed at twice its block_m unpaired, and each
candidate on both layouts (paired persistent programs read the tile lists of `_pair_tiles`).
Usage (repo root, GPU): PYTHONPATH=src python tools/sweep_persistent.py
  env: POINTS=qwen3_30b_a3b:4096,deepseek_v3:4096  STAGES=down,dx  ROUNDS=3
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels_repo" / "moe" / "benchmarks"))
from tune_moe import DEV, SHAPES, cfgs, launch, pipeline, rt, sweep_points, timed  # noqa: E402  (kernels_repo/moe/benchmarks/)

# Candidates: extra keys for the stages they name. Measured in s10 call 2 (sequentially, first version
# of this script): the gathering persistent gate_up 17-52% slower than one program per tile (255
# registers), persistent dgrad under its 128-register cap 2.1-3.7x slower; so the list is the down
# tile (which dL/dx shares) and gate_up variants that need fewer registers (ROWS, EPI_HALVES).
CANDIDATES = {
    "a_tma": {"down": {"A_TMA": True}},
    "down_both": {"down": {"A_TMA": True, "PERSISTENT": 1}},
    "down_both_4st": {"down": {"A_TMA": True, "PERSISTENT": 1, "num_stages": 4}},
    "down_both_128": {"down": {"A_TMA": True, "PERSISTENT": 2, "BLOCK_N": 128, "num_stages": 3}},
    "gate_up_persistent": {"gate_up": {"PERSISTENT": 1}},
    # x copied into row order first (timed with the copy), then gate_up without a gather: ptxas
    # sm90 gives this persistent tile 168 registers and no spills in inference (255 when gathering)
    "gate_up_rows": {"gate_up": {"ROWS": True, "A_TMA": True, "PERSISTENT": 1}},
    "gate_up_rows_plain": {"gate_up": {"ROWS": True, "A_TMA": True}},
    # the training gate_up (it saves [g | u]) with its epilogue in two column halves: ptxas sm90
    # 174-176 registers and no spills against 254-255 and 40 bytes of spills (stage gate_up_train)
    "gate_up_halves": {"gate_up": {"EPI_HALVES": True}},
    "gate_up_rows_halves": {"gate_up": {"ROWS": True, "A_TMA": True, "PERSISTENT": 1, "EPI_HALVES": True}},
}


def _buckets(cfg: dict) -> list[tuple[str, dict]]:
    runs = [("shipped", cfg)]
    base = cfg
    if cfg.get("pair_m"):
        base = copy.deepcopy(cfg)
        base["block_m"] = 2 * cfg["block_m"]
        base.pop("pair_m")
        runs.append(("unpaired", base))
    wanted = [c for c in os.environ.get("CANDIDATES", ",".join(CANDIDATES)).split(",") if c]
    for label in wanted:
        for suffix, start in (("", cfg), ("_unpaired", base)) if base is not cfg else (("", cfg),):
            b = copy.deepcopy(start)
            for stage, extra in CANDIDATES[label].items():
                b[stage].update(extra)
            cfgs.check_bucket(b, label)
            runs.append((label + suffix, b))
    return runs


def _stage_runs(b: dict, x, gu, dn, idx, wf, dy, K: int, tma: bool) -> dict:
    """Closures running each GEMM stage of bucket b on its own routing and buffers."""
    E, two_i, H = gu.shape
    I = two_i // 2
    r = rt.align_rows(idx, E, b["block_m"])
    P = r.num_rows
    h = torch.randn(P, I, device=DEV, dtype=x.dtype)
    aux = torch.randn(P, 2 * I, device=DEV, dtype=x.dtype)
    dgu = torch.randn(P, 2 * I, device=DEV, dtype=x.dtype)
    hw = torch.empty(P, I, device=DEV, dtype=x.dtype)
    y = torch.empty(P, H, device=DEV, dtype=x.dtype)
    dws = torch.zeros(wf.shape[0], device=DEV, dtype=torch.float32)
    common = dict(topk=K, use_tma=tma, pair=bool(b.get("pair_m", False)))
    return {
        "gate_up": lambda: launch.gemm(launch.gather_rows(x, r, K) if b["gate_up"].get("ROWS") else x, gu, h, r,
                                    b["gate_up"], n=I, k=H, epilogue=1, gather_a=not b["gate_up"].get("ROWS"),
                                    b_ncontig=False, **common),
        "gate_up_train": lambda: launch.gemm(launch.gather_rows(x, r, K) if b["gate_up"].get("ROWS") else x, gu, h, r,
                                          b["gate_up"], n=I, k=H, epilogue=1, gather_a=not b["gate_up"].get("ROWS"),
                                          b_ncontig=False, aux=aux, save_aux=True, **common),
        "down": lambda: launch.gemm(h, dn, y, r, b["down"], n=H, k=I, epilogue=0, gather_a=False, b_ncontig=False,
                                 **common),
        "dgrad": lambda: launch.gemm(dy, dn, dgu, r, b["dgrad"], n=I, k=H, epilogue=2, gather_a=True, b_ncontig=True,
                                  aux=aux, scale=wf, dscale=dws, h=hw, **common),
        "dx": lambda: launch.gemm(dgu, gu, y, r, b["down"], n=H, k=2 * I, epilogue=0, gather_a=False, b_ncontig=True,
                               **common),
    }


def sweep_point(name: str, T: int, variant: str) -> None:
    s = SHAPES[name]
    E, H, I, K = s["E"], s["H"], s["I"], s["K"]
    cfg = pipeline.bucket(variant, E, H, I, T * K, None, DEV, 2)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    gu = torch.randn(E, 2 * I, H, device=DEV, dtype=torch.bfloat16) * 0.02
    dn = torch.randn(E, H, I, device=DEV, dtype=torch.bfloat16) * 0.02
    w, idx = torch.topk(torch.softmax(torch.randn(T, E, device=DEV), -1), K, dim=-1)
    dy = torch.randn_like(x)
    wf = w.reshape(-1).contiguous()
    tma = pipeline.use_tma(variant, cfg, gu, dn)
    stages = os.environ.get("STAGES", "down,dx").split(",")
    rounds = int(os.environ.get("ROUNDS", 3))
    print(f"== {name} T={T} shipped block_m={cfg['block_m']} pair_m={cfg.get('pair_m', False)}", flush=True)
    buckets = _buckets(cfg)
    runs = {label: _stage_runs(b, x, gu, dn, idx, wf, dy, K, tma) for label, b in buckets}
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for stage in stages:
            for label, _b in buckets:
                times.setdefault((label, stage), []).append(timed(runs[label][stage]))
    for label, b in buckets:
        for stage in stages:
            got = times[(label, stage)]
            c = b[{"dx": "down", "gate_up_train": "gate_up"}.get(stage, stage)]
            print(f"persist {name} T={T} {label} {stage} ms={statistics.median(got):.4f} "
                  f"rounds={','.join(f'{v:.4f}' for v in got)} {c}", flush=True)
    del runs
    torch.cuda.empty_cache()


def main() -> None:
    sweep_points(sweep_point, "qwen3_30b_a3b:4096,deepseek_v3:4096")


if __name__ == "__main__":
    main()
