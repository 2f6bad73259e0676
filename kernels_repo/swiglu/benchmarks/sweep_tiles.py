"""Sweep the sm80-kernel tile size and warps of swiglu (forward and backward), eager and graph.

Usage (repo root, GPU): PYTHONPATH=src python kernels_repo/swiglu/benchmarks/sweep_tiles.py
  env: SHAPES="4096x6144,8192x14336"
Prints one line per (shape, pass, tile bytes, warps): fraction of the copy bandwidth per eager
call and under CUDA-graph replay, as bench_swiglu.py measures them.
"""

from __future__ import annotations

import os

import torch
from bench_swiglu import DEV, call_fn, copy_bandwidth, implementations, time_eager, time_graph

TILES = [(4096, 4), (8192, 4), (8192, 8), (16384, 8), (32768, 8)]


def main() -> None:
    _, kernel = implementations()
    dispatch = kernel._dispatch
    sm80 = kernel._sm80
    variant = dispatch._VARIANTS["sm80"]
    copy_bw = copy_bandwidth()
    shapes = [tuple(int(v) for v in s.split("x"))
              for s in os.environ.get("SHAPES", "4096x6144,8192x14336").split(",")]
    defaults = (sm80.TILE_BYTES, sm80.NUM_WARPS)
    for T, I in shapes:
        g = torch.randn(T, I, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        u = torch.randn(T, I, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(T, I, device=DEV, dtype=torch.bfloat16)
        for tile_bytes, warps in TILES:
            sm80.TILE_BYTES, sm80.NUM_WARPS = tile_bytes, warps
            variant._configs.clear()
            for backward, tensors in ((False, 3), (True, 8)):
                gg, uu = (g, u) if backward else (g.detach(), u.detach())
                call = call_fn(lambda a, b: kernel.swiglu(a, b, impl="sm80"), gg, uu, dy, backward)
                nbytes = tensors * T * I * 2
                reps = max(50, min(2000, int(2e10 / nbytes)))
                eager_ms, _ = time_eager(call, reps)
                graph_ms = time_graph(call, 5, max(10, reps // 5))
                print(f"sweep {T}x{I} {'fwdbwd' if backward else 'fwd'} tile={tile_bytes} warps={warps} "
                      f"eager={nbytes / (eager_ms * 1e-3) / copy_bw:.3f} "
                      f"graph={nbytes / (graph_ms * 1e-3) / copy_bw:.3f}", flush=True)
        sm80.TILE_BYTES, sm80.NUM_WARPS = defaults
        variant._configs.clear()
        del g, u, dy
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
