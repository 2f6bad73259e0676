"""How a T=1 decode call's time splits into a fixed part and a per-byte part (`decodescale`).

Why: every fp8 decode tile of the s47 sweep timed within a few percent of the others, and a line
through the fp8 and bf16 calls' times (31 and 43 us for 38 and 75 MB) puts their bytes near the
copy bandwidth with about 19 us left over. If so, no tile will reach issue 31's 0.6 of bf16's time;
only removing fixed work (a launch, a wave tail, a dependent load chain) will. This times the
shipped Qwen3-30B-A3B T=1 buckets (fp8 and bf16, pinned) at top-K = 1..32 (the bytes grow with K,
the launches do not), and a device-to-device copy of the same bytes, from CUDA graphs with L2
flushed before each call, and fits time = fixed + bytes / bandwidth per path; then each fp8 kernel
alone by profiler time at each K. (s48-1 on an H100: the fixed part is about 5 us; at K=8 the fp8
call moves its bytes at 1.46 TB/s, the bf16 call at 2.04.)

Usage (repo root, GPU): PYTHONPATH=src python tools/diag_decode_scaling.py
  env: KS=1,2,4,8,16,32
"""

from __future__ import annotations

import importlib
import os
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels_repo" / "moe" / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from diag_fp8_decode import _graph_us  # noqa: E402  (tools/)
from profile_moe import kernel_times  # noqa: E402
from tune_moe import DEV, SHAPES, fp8_weights, moe  # noqa: E402  (kernels_repo/moe/benchmarks/)


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main() -> None:
    s = SHAPES["qwen3_30b_a3b"]
    E, H, I = s["E"], s["H"], s["I"]
    ks = [int(k) for k in os.environ.get("KS", "1,2,4,8,16,32").split(",")]
    gu, gus = fp8_weights(E, 2 * I, H)
    dn, dns = fp8_weights(E, H, I)
    ref = importlib.import_module(moe.__name__ + ".reference_fp8")
    gu16, dn16 = ref.dequantize_blocks(gu, gus).bfloat16(), ref.dequantize_blocks(dn, dns).bfloat16()
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    fp8c = importlib.import_module(moe.__name__ + "._fp8_configs")
    cap = torch.cuda.get_device_capability(DEV)
    b16 = cfgs.pick_config(cap[0] * 10 + cap[1], E, H, I, s["K"])
    b8 = fp8c.pick_fp8_config("sm90", E, H, I, s["K"])
    print(f"bf16 decode {b16.get('decode')}\nfp8 decode {b8.get('decode')}", flush=True)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEV)
    alone = _graph_us(flush.zero_)
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(1, H, device=DEV, dtype=torch.bfloat16, generator=g)
    rows: dict[str, list[tuple[float, float]]] = {"fp8": [], "bf16": [], "copy": []}
    for K in ks:
        idx = torch.randperm(E, device=DEV, generator=g)[:K][None]
        w = torch.rand(1, K, device=DEV, generator=g)
        mb8 = K * 3 * I * H / 1e6
        src = torch.empty(int(mb8 * 1e6), dtype=torch.uint8, device=DEV)
        calls = {
            "fp8": (mb8, partial(moe.fused_experts, x, gu, dn, idx, w, gate_up_proj_scale_inv=gus,
                                 down_proj_scale_inv=dns, config=b8)),
            "bf16": (2 * mb8, partial(moe.fused_experts, x, gu16, dn16, idx, w, config=b16)),
            "copy": (mb8, partial(torch.empty_like(src).copy_, src)),  # reads mb8 (and writes as much)
        }
        for name, (mb, fn) in calls.items():
            us = _graph_us(lambda fn=fn: (flush.zero_(), fn())) - alone
            rows[name].append((mb, us))
            print(f"K={K:2d} {name:4s} {mb:7.1f} MB read {us:7.1f} us  {mb / us:5.2f} TB/s", flush=True)
        table, _ = kernel_times(calls["fp8"][1], 20, before=flush.zero_)
        print("      fp8 kernels (profiler, us): " + ", ".join(
            f"{k[:40]} {t:.1f}" for k, (t, _) in table.items() if "zero" not in k and "fill" not in k), flush=True)
    for name, pts in rows.items():
        fixed, per_mb = _fit([p[0] for p in pts], [p[1] for p in pts])
        print(f"fit {name}: {fixed:.1f} us fixed + {per_mb * 1e3:.2f} us per GB ({1 / per_mb:.2f} TB/s)", flush=True)


if __name__ == "__main__":
    main()
