"""Time the grouped GEMM stages with the stage keys "PERSISTENT" and "A_TMA" against the shipped tiles.

Per (shape, T) point: gate_up (SwiGLU epilogue, forward), down, dgrad (SwiGLU-backward epilogue) and
dL/dx (which runs with the "down" tile), each with the bucket's own tile, then the same tile with
A by TMA (down, dL/dx), with persistent flattened programs, and both. A bucket with "pair_m" is
also timed at twice its block_m without pairing: persistent tiles have one height, so that is what
they compete against there. Prints one line per (point, run, stage) and each run's sums.
Usage (repo root, GPU): PYTHONPATH=src python kernels_repo/moe/benchmarks/sweep_persistent.py
  env: POINTS=qwen3_30b_a3b:4096,deepseek_v3:4096  PER_SM=1 (programs per SM for gate_up/down/dx;
  dgrad, capped at 128 registers in the shipped buckets, gets 2 per SM as well)
"""

from __future__ import annotations

import copy
import os

import torch
from tune_moe import DEV, SHAPES, ex, moe, rt, timed  # same directory

STAGES = ("gate_up", "down", "dgrad", "dx")


def _runs(cfg: dict) -> list[tuple[str, dict]]:
    """(label, bucket) pairs: the shipped bucket, its unpaired twin, then the keys on top of it."""
    runs = [("shipped", cfg)]
    base = cfg
    if cfg.get("pair_m"):
        base = copy.deepcopy(cfg)
        base["block_m"] = 2 * cfg["block_m"]
        base.pop("pair_m")
        runs.append(("unpaired", base))
    per_sm = int(os.environ.get("PER_SM", 1))
    for label, extra in (("a_tma", {"A_TMA": True}), ("persistent", {"PERSISTENT": per_sm}),
                         ("both", {"A_TMA": True, "PERSISTENT": per_sm})):
        b = copy.deepcopy(base)
        for stage in ("gate_up", "down", "dgrad"):
            b[stage].update(extra)
        runs.append((label, b))
        if "PERSISTENT" in extra and b["dgrad"].get("maxnreg"):  # two capped CTAs per SM
            b2 = copy.deepcopy(b)
            b2["dgrad"]["PERSISTENT"] = 2
            runs.append((label + "_dgrad2", b2))
    return runs


def sweep_point(name: str, T: int, variant: str) -> None:
    s = SHAPES[name]
    E, H, I, K = s["E"], s["H"], s["I"], s["K"]
    cfg = ex._config(variant, E, H, I, T * K, None, DEV, 2)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    gu = torch.randn(E, 2 * I, H, device=DEV, dtype=torch.bfloat16) * 0.02
    dn = torch.randn(E, H, I, device=DEV, dtype=torch.bfloat16) * 0.02
    w, idx = torch.topk(torch.softmax(torch.randn(T, E, device=DEV), -1), K, dim=-1)
    dy = torch.randn_like(x)
    wf = w.reshape(-1).contiguous()
    tma = ex._use_tma(variant, cfg, gu, dn)
    print(f"== {name} T={T} shipped block_m={cfg['block_m']} pair_m={cfg.get('pair_m', False)}", flush=True)
    for label, b in _runs(cfg):
        ex.check_bucket(b, label)
        ms = time_stages(b, x, gu, dn, idx, wf, dy, K, tma)
        for stage in STAGES:
            c = b["down" if stage == "dx" else stage]
            print(f"persist {name} T={T} {label} {stage} ms={ms[stage]:.4f} {c}", flush=True)
        print(f"sum {name} T={T} {label} block_m={b['block_m']} fwd_ms={ms['gate_up'] + ms['down']:.4f} "
              f"all_ms={sum(ms.values()):.4f}", flush=True)
        torch.cuda.empty_cache()


def time_stages(b: dict, x, gu, dn, idx, wf, dy, K: int, tma: bool) -> dict[str, float]:
    """ms of each GEMM stage of bucket b, on its own routing and buffers."""
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
    runs = {
        "gate_up": lambda: ex._gemm(x, gu, h, r, b["gate_up"], n=I, k=H, epilogue=1, gather_a=True,
                                    b_ncontig=False, **common),
        "down": lambda: ex._gemm(h, dn, y, r, b["down"], n=H, k=I, epilogue=0, gather_a=False, b_ncontig=False,
                                 **common),
        "dgrad": lambda: ex._gemm(dy, dn, dgu, r, b["dgrad"], n=I, k=H, epilogue=2, gather_a=True, b_ncontig=True,
                                  aux=aux, scale=wf, dscale=dws, h=hw, **common),
        "dx": lambda: ex._gemm(dgu, gu, y, r, b["down"], n=H, k=2 * I, epilogue=0, gather_a=False, b_ncontig=True,
                               **common),
    }
    return {stage: timed(runs[stage]) for stage in STAGES}


def main() -> None:
    points = os.environ.get("POINTS", "qwen3_30b_a3b:4096,deepseek_v3:4096")
    variant = moe.select_variant(DEV)
    for point in points.split(","):
        name, T = point.split(":")
        sweep_point(name, int(T), variant)


if __name__ == "__main__":
    main()
