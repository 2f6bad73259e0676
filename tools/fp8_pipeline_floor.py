"""The fastest an fp8 `fused_experts` forward of this design could run at a point, kernel by kernel,
beside the issue's target (0.65 of the fp8 matmul rate over the useful FLOPs).

The forward at T >= 4096 is five kernels in a row: routing, the quantize pass (x to fp8 rows in the
aligned row order), the gate/up GEMM (h stored fp8), the down GEMM (16-bit rows) and the combine
(each token's K rows weighted and summed). A kernel takes at least max(its DRAM bytes / copy
bandwidth, its MMA FLOPs / fp8 matmul rate); kernels in a row add. The GEMMs' MMAs count 64-row
halves (a half of padding rows only is skipped), their bytes every touched expert's weights once
and each operand row once. Routing is bench_fp8.py's (each token K distinct random experts).
Give the card's measured rate and bandwidth (bench_fp8.py's ceiling lines) to compare with a run.

    python tools/fp8_pipeline_floor.py [RATE_TFLOPS COPY_GBPS]   (default: run s51-1's H100, 1381 3041)
"""

from __future__ import annotations

import sys

import torch

SHAPES = {"qwen3_30b_a3b": (128, 2048, 768, 8), "deepseek_v3": (256, 7168, 2048, 8)}  # E, H, I, K
TARGET = 0.65


def counts(T: int, E: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """Rows per expert for bench_fp8.py's routing (K distinct experts a token, uniformly)."""
    idx = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K]
    return torch.bincount(idx.flatten(), minlength=E)


def floors(T: int, E: int, H: int, I: int, K: int, rate: float, gbs: float, gen: torch.Generator) -> dict:
    """{kernel: floor ms} plus the useful-FLOP time and the target time."""
    c = counts(T, E, K, gen)
    rows = int(((c + 127) // 128 * 128).sum())  # aligned rows the quantize pass writes (128-row blocks)
    mma_rows = int(((c + 63) // 64 * 64).sum())  # rows whose MMAs run (64-row halves)
    real = T * K
    touched = int((c > 0).sum())
    ms = {}

    def kernel(name: str, nbytes: float, flops: float = 0.0) -> None:
        ms[name] = max(nbytes / gbs / 1e6, flops / rate / 1e9)

    n_groups = -(-H // 128)
    kernel("quantize", T * H * 2 + rows * (H + 4 * n_groups))
    kernel("gate_up", rows * H + touched * 2 * I * H + rows * I, 2 * mma_rows * 2 * I * H)
    kernel("down", rows * I + touched * H * I + mma_rows * H * 2, 2 * mma_rows * H * I)
    kernel("combine", real * H * 2 + T * H * 2)
    useful = 2 * real * 3 * H * I / rate / 1e9
    return {"ms": ms, "total": sum(ms.values()), "useful": useful, "target": useful / TARGET,
            "padding": 1 - real / rows}


def main() -> None:
    rate, gbs = (float(sys.argv[1]), float(sys.argv[2])) if len(sys.argv) == 3 else (1381.0, 3041.0)
    print(f"fp8 rate {rate:.0f} TFLOP/s, copy {gbs:.0f} GB/s; target {TARGET} of the rate")
    for name, (E, H, I, K) in SHAPES.items():
        for T in (4096, 16384):
            f = floors(T, E, H, I, K, rate, gbs, torch.Generator().manual_seed(0))
            parts = "  ".join(f"{k} {v:.3f}" for k, v in f["ms"].items())
            print(f"{name} T={T}: floor {f['total']:.3f} ms ({parts}); padding {f['padding']:.2f}; "
                  f"target {f['target']:.3f} ms -> at best {f['useful'] / f['total']:.2f} of the rate")


if __name__ == "__main__":
    main()
