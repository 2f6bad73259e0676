"""fp8 and 16-bit decode calls (T=1) for Nsight Compute (`ncudecode`): the shipped fp8 tiles, then
the 16-bit path on the dequantized weights (four kernels).

Why: the fp8 decode gate/up kernel reads its weights at under half the copy bandwidth and no tile,
prefetch, cp.async or TMA load mode moved it (s45-s46). ncu's pipe utilization, issue-slot, stall
and occupancy counters of the fp8 and 16-bit kernels say what the fp8 kernels do per byte that the
16-bit ones do not (s48-2: about three times the instructions, at half the occupancy).

Usage (repo root, GPU): ncu -k regex:decode -c 6 --section ... python tools/ncu_decode.py
  env: SHAPE=qwen3_30b_a3b
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels_repo" / "moe" / "benchmarks"))
from tune_moe import DEV, SHAPES, fp8_weights, moe  # noqa: E402  (kernels_repo/moe/benchmarks/)


def main() -> None:
    s = SHAPES[os.environ.get("SHAPE", "qwen3_30b_a3b")]
    E, H, I, K = s["E"], s["H"], s["I"], s["K"]
    gu, gus = fp8_weights(E, 2 * I, H)
    dn, dns = fp8_weights(E, H, I)
    ref = importlib.import_module(moe.__name__ + ".reference_fp8")
    gu16, dn16 = ref.dequantize_blocks(gu, gus).bfloat16(), ref.dequantize_blocks(dn, dns).bfloat16()
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(1, H, device=DEV, dtype=torch.bfloat16, generator=g)
    idx = torch.randperm(E, device=DEV, generator=g)[:K][None]
    w = torch.rand(1, K, device=DEV, generator=g)
    with torch.no_grad():
        a = moe.fused_experts(x, gu, dn, idx, w, gate_up_proj_scale_inv=gus, down_proj_scale_inv=dns)
        b = moe.fused_experts(x, gu16, dn16, idx, w)
    torch.cuda.synchronize()
    print(f"fp8 against bf16 on the dequantized weights: relative difference "
          f"{((a.float() - b.float()).norm() / b.float().norm()).item():.4f}", flush=True)


if __name__ == "__main__":
    main()
