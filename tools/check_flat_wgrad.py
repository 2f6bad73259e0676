"""Check the flattened weight-gradient loop ("FLAT_STEPS") on the GPU against the plain one.

Both operands in row order (the "ROWS" key's operands), each wgrad config run on the same inputs:
bits against the plain persistent loop, and the error against an fp32 per-expert reference; where
bits differ, which experts and tiles. Usage (repo root, GPU):
  PYTHONPATH=src python tools/check_flat_wgrad.py
  env: POINTS=mixtral_8x7b:2048,qwen3_30b_a3b:4096,deepseek_v3:4096 (the default)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels_repo" / "moe" / "benchmarks"))
from tune_moe import DEV, SHAPES, launch, rt  # noqa: E402  (kernels_repo/moe/benchmarks/)

_TS = {"TMA": True, "TMA_STORE": True}
_BASE = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, **_TS}
CONFIGS = {
    "loop": {**_BASE, "num_stages": 2, "PERSISTENT": 1},
    "one_per_tile": {**_BASE, "num_stages": 3},
    "flat3": {**_BASE, "num_stages": 3, "PERSISTENT": 1, "FLAT_STEPS": 64},
    "flat2": {**_BASE, "num_stages": 2, "PERSISTENT": 1, "FLAT_STEPS": 64},
    "flat4": {**_BASE, "num_stages": 4, "PERSISTENT": 1, "FLAT_STEPS": 64},
    "flat3_nostore": {**_BASE, "num_stages": 3, "PERSISTENT": 1, "FLAT_STEPS": 64, "TMA_STORE": False},
    "flat2_p2": {**_BASE, "num_stages": 2, "PERSISTENT": 2, "FLAT_STEPS": 64},
    "flat3_group8": {**_BASE, "num_stages": 3, "PERSISTENT": 1, "FLAT_STEPS": 64, "GROUP_M": 8},
    "flat_128x256": {**_BASE, "BLOCK_N": 256, "num_stages": 3, "PERSISTENT": 1, "FLAT_STEPS": 64},
}


def reference(a, b, r, E, M, N) -> torch.Tensor:
    start, count = r.expert_start.tolist(), r.expert_count.tolist()
    out = torch.empty(E, M, N, device=DEV, dtype=torch.float32)
    for e in range(E):
        s, c = start[e], count[e]
        out[e] = a[s:s + c].float().T @ b[s:s + c].float()
    return out


def check(name: str, T: int) -> None:
    s = SHAPES[name]
    E, H, I, K = s["E"], s["H"], s["I"], s["K"]
    torch.manual_seed(0)
    _, idx = torch.topk(torch.softmax(torch.randn(T, E, device=DEV), -1), K, dim=-1)
    r = rt.align_rows(idx, E, 64)
    P = r.num_rows
    a = torch.randn(P, H, device=DEV, dtype=torch.bfloat16)  # dY rows (dW_down's A)
    b = torch.randn(P, I, device=DEV, dtype=torch.bfloat16)  # h rows
    # padding rows are zero in both (as _gather_rows writes them), so the reference sums only rows
    valid = (r.rows >= 0).unsqueeze(1)
    a, b = a * valid, b * valid
    counts = r.expert_count
    print(f"== {name} T={T} P={P} max_rows={int(counts.max())} steps={(int(counts.max()) + 63) // 64}", flush=True)
    ref = reference(a, b, r, E, H, I)
    loop = None
    for label, c in CONFIGS.items():
        out = torch.full((E, H, I), float("nan"), device=DEV, dtype=torch.bfloat16)
        try:
            launch.wgrad(a, b, out, r, c, gather_a=False, gather_b=False, topk=K, use_tma=True)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - report and go on to the next config
            print(f"{label}: ERROR {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        nan = int(out.isnan().sum())
        line = f"{label}: rel_err={err:.2e} nan={nan}"
        if label == "loop":
            loop = out
        elif loop is not None:
            diff = out != loop
            line += f" differs={int(diff.sum())}"
            if diff.any():
                per_e = diff.flatten(1).sum(1)
                bad = per_e.nonzero().flatten().tolist()
                e0 = bad[0]
                mn = diff[e0].nonzero()[0].tolist()
                line += (f" experts={len(bad)}/{E} first={bad[:8]} counts={counts[bad[:8]].tolist()} "
                         f"first_elem={mn} got={out[e0, mn[0], mn[1]].item():.4g} "
                         f"want={loop[e0, mn[0], mn[1]].item():.4g}")
        print(line, flush=True)


def main() -> None:
    for point in os.environ.get("POINTS", "mixtral_8x7b:2048,qwen3_30b_a3b:4096,deepseek_v3:4096").split(","):
        name, T = point.split(":")
        check(name, int(T))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
