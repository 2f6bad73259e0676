"""fused_experts on fp8 block-quantized weights against kernelhub's bf16 path on the dequantized
weights, with the dense bf16 and fp8 matmul rates measured in the same run (the ceilings).

Usage (repo root, GPU): PYTHONPATH=src python kernels_repo/moe/benchmarks/bench_fp8.py
  env: TOKENS=1,512,4096,16384. Prints one line per shape and T: the automatic fp8 variant, the
  W8A16 (sm80) kernel, and bf16; ms (do_bench median), TFLOP/s of the useful FLOPs, and the relative
  error against the bf16 path (the fp8 activations alone cost ~4-5%).
"""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path

import torch
import triton

from kernelhub._loader import load_kernel_from_dir

ROOT = Path(__file__).resolve().parents[3]
SHAPES = {"qwen3_30b_a3b": (128, 2048, 768, 8), "deepseek_v3": (256, 7168, 2048, 8)}  # E, H, I, K


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def ceilings(dev: torch.device) -> None:
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    print(f"ceiling bf16 matmul {2 * n**3 / bench(partial(torch.matmul, a, b)) / 1e9:.0f} TFLOP/s")
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.ones((), device=dev)
    ms = bench(partial(torch._scaled_mm, a8, b8, one, one, out_dtype=torch.bfloat16))
    print(f"ceiling fp8 _scaled_mm {2 * n**3 / ms / 1e9:.0f} TFLOP/s")


def quantized(ref, E: int, shape: tuple[int, int], dev, g) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weights, block scales, the bf16 dequantized weights), 16 experts at a time (the fp32
    temporaries of all E experts do not fit beside the rest)."""
    q, s, d = [], [], []
    for _ in range(0, E, 16):
        w = torch.randn(16, *shape, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        wq, ws = ref.quantize_blocks(w)
        q.append(wq)
        s.append(ws)
        d.append(ref.dequantize_blocks(wq, ws).to(torch.bfloat16))
    return torch.cat(q), torch.cat(s), torch.cat(d)


def main() -> None:
    moe = load_kernel_from_dir(ROOT / "kernels_repo" / "moe")
    ref = sys.modules[moe.__name__ + ".reference_fp8"]
    dev = torch.device("cuda", 0)
    ceilings(dev)
    tokens = [int(t) for t in os.environ.get("TOKENS", "1,512,4096,16384").split(",")]
    for name, (E, H, I, K) in SHAPES.items():
        g = torch.Generator(device=dev).manual_seed(0)
        guq, gus, gud = quantized(ref, E, (2 * I, H), dev, g)
        dnq, dns, dnd = quantized(ref, E, (H, I), dev, g)
        for T in tokens:
            x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
            idx = torch.stack([torch.randperm(E, device=dev, generator=g)[:K] for _ in range(T)])
            w = torch.rand(T, K, device=dev, generator=g)
            flops = 2 * T * K * 3 * H * I
            with torch.no_grad():
                want = moe.fused_experts(x, gud, dnd, idx, w).float()
                row = [f"fp8 {name} T={T}"]
                for label, kw in (("auto", {}), ("sm80", {"variant": "sm80"})):
                    run = partial(moe.fused_experts, x, guq, dnq, idx, w, gate_up_proj_scale_inv=gus,
                                  down_proj_scale_inv=dns, **kw)
                    err = ((run().float() - want).norm() / want.norm()).item()
                    ms = bench(run)
                    row.append(f"{label}={ms:.4f}ms ({flops / ms / 1e9:.0f} TF/s, relerr {err:.3f})")
                ms = bench(partial(moe.fused_experts, x, gud, dnd, idx, w))
                row.append(f"bf16={ms:.4f}ms ({flops / ms / 1e9:.0f} TF/s)")
            print("  ".join(row), flush=True)
        del guq, gus, gud, dnq, dns, dnd
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
