"""Sweep the sm80-kernel tile size and warps of swiglu (forward and backward), eager and graph.

Usage (repo root, GPU): PYTHONPATH=src python tools/sweep_tiles.py
  env: SHAPES="4096x6144,8192x14336"  MODE=bytes|rows
Prints one line per (shape, pass, tile bytes, warps): fraction of the copy bandwidth per eager
call and under CUDA-graph replay, as bench_swiglu.py measures them. MODE=rows instead tries tile
shapes (rows x columns, warps) forward only, including whole-row tiles (Liger-Kernel's shape).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels_repo" / "swiglu" / "benchmarks"))
from bench_swiglu import DEV, call_fn, copy_bandwidth, implementations, time_eager, time_graph  # noqa: E402  (kernels_repo/swiglu/benchmarks/)

TILES = [(4096, 4), (8192, 4), (8192, 8), (16384, 8), (32768, 8)]


def measure(label: str, call, nbytes: int, copy_bw: float) -> None:
    """One sweep line: fraction of copy per eager call and under graph replay, as bench_swiglu."""
    reps = max(50, min(2000, int(2e10 / nbytes)))
    eager_ms, _ = time_eager(call, reps)
    graph_ms = time_graph(call, 5, max(10, reps // 5))
    print(f"sweep {label} eager={nbytes / (eager_ms * 1e-3) / copy_bw:.3f} "
          f"graph={nbytes / (graph_ms * 1e-3) / copy_bw:.3f}", flush=True)


def tile_shapes(N: int) -> list[tuple[int, int, int]]:
    row = triton.next_power_of_2(N)
    return [(2, 2048, 8), (1, 2048, 4), (1, 2048, 8), (1, 4096, 8), (1, row, 8), (1, row, 16), (1, row, 32),
            (2, row, 16), (4, 1024, 8)]


def sweep_shapes(kernel, copy_bw: float, shapes) -> None:
    """Forward under a forced (BLOCK_M, BLOCK_N, warps): masked when BLOCK_N does not divide N."""
    variant = kernel._dispatch._VARIANTS["sm80"]
    default = variant._config
    for T, I in shapes:
        g = torch.randn(T, I, device=DEV, dtype=torch.bfloat16)
        u = torch.randn(T, I, device=DEV, dtype=torch.bfloat16)
        ref = kernel.swiglu(g, u, impl="sm80")
        for bm, bn, warps in tile_shapes(I):
            grid = triton.cdiv(T, bm) * triton.cdiv(I, bn)
            variant._config = lambda *a, c=(bm, bn, warps, grid): c
            variant._configs.clear()
            call = call_fn(lambda a, b: kernel.swiglu(a, b, impl="sm80"), g, u, None, False)
            assert torch.equal(call(), ref)
            measure(f"{T}x{I} fwd tile={bm}x{bn} warps={warps}", call, 3 * T * I * 2, copy_bw)
        variant._config = default
        variant._configs.clear()
        del g, u, ref
        torch.cuda.empty_cache()


def main() -> None:
    _, kernel = implementations()
    dispatch = kernel._dispatch
    sm80 = kernel._sm80
    variant = dispatch._VARIANTS["sm80"]
    copy_bw = copy_bandwidth()
    shapes = [tuple(int(v) for v in s.split("x"))
              for s in os.environ.get("SHAPES", "4096x6144,8192x14336").split(",")]
    if os.environ.get("MODE") == "rows":
        sweep_shapes(kernel, copy_bw, shapes)
        return
    defaults = (sm80.TILE_BYTES, sm80.BWD_TILE_BYTES, sm80.NUM_WARPS)
    for T, I in shapes:
        g = torch.randn(T, I, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        u = torch.randn(T, I, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(T, I, device=DEV, dtype=torch.bfloat16)
        for tile_bytes, warps in TILES:
            sm80.TILE_BYTES = sm80.BWD_TILE_BYTES = tile_bytes
            sm80.NUM_WARPS = warps
            variant._configs.clear()
            for backward, tensors in ((False, 3), (True, 8)):
                gg, uu = (g, u) if backward else (g.detach(), u.detach())
                call = call_fn(lambda a, b: kernel.swiglu(a, b, impl="sm80"), gg, uu, dy, backward)
                measure(f"{T}x{I} {'fwdbwd' if backward else 'fwd'} tile={tile_bytes} warps={warps}", call,
                        tensors * T * I * 2, copy_bw)
        sm80.TILE_BYTES, sm80.BWD_TILE_BYTES, sm80.NUM_WARPS = defaults
        variant._configs.clear()
        del g, u, dy
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
