"""Why does the two-input SwiGLU forward read ~0.94 of copy under CUDA-graph replay and ~1.0 eager?

Hypothesis: buffer placement (where gate, up and the output land), not the kernel. Measures the
same kernel under graph replay with the output allocated inside the graph (as bench_swiglu.py),
preallocated outside it, and at several byte offsets inside one larger buffer; and torch's own
3-tensor elementwise `torch.mul(g, u, out=)` in the same placements as a reference kernel.
Usage (repo root, GPU): PYTHONPATH=src python tools/diag_swiglu_graph.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels_repo", "swiglu", "benchmarks"))
from bench_swiglu import DEV, copy_bandwidth, implementations, time_eager, time_graph  # noqa: E402


def measure(kernel, T: int, I: int, layout: str, copy_bw: float) -> str:
    dispatch = kernel._dispatch
    nbytes = 3 * T * I * 2
    reps = max(50, min(2000, int(2e10 / nbytes)))
    replays = max(10, reps // 5)
    if layout == "churned":  # what bench_swiglu.py's check() leaves behind
        junk = [torch.randn(T, I, device=DEV) for _ in range(3)]
        del junk
    g = torch.randn(T, I, device=DEV, dtype=torch.bfloat16)
    u = torch.randn(T, I, device=DEV, dtype=torch.bfloat16)
    target = dispatch._resolve("diag", g, None)

    def frac(ms: float) -> str:
        return f"{nbytes / (ms * 1e-3) / copy_bw:.3f}"

    em, _ = time_eager(lambda: kernel.swiglu(g, u), reps)
    gm = time_graph(lambda: kernel.swiglu(g, u), 5, replays)
    rows = [f"{T}x{I} {layout}", f"alloc-in-call eager={frac(em)} graph={frac(gm)}"]
    big = torch.empty(T * I + (1 << 21), device=DEV, dtype=torch.bfloat16)
    for off in (0, 2048, 32768, 1 << 20):  # elements: 0, 4 KiB, 64 KiB, 2 MiB
        out = big[off:off + T * I].view(T, I)
        em, _ = time_eager(lambda out=out: dispatch._run(target, False, False, I, (g, u, out)), reps)
        gm = time_graph(lambda out=out: dispatch._run(target, False, False, I, (g, u, out)), 5, replays)
        tm = time_graph(lambda out=out: torch.mul(g, u, out=out), 5, replays)
        rows.append(f"out+{off * 2}B ours eager={frac(em)} graph={frac(gm)} torch.mul graph={frac(tm)}")
    return " | ".join(rows)


def main() -> None:
    _, kernel = implementations()
    torch.cuda.set_device(DEV)
    copy_bw = copy_bandwidth()
    for T, I in ((8192, 14336), (32768, 4096), (4096, 6144)):
        for layout in ("fresh", "churned"):
            print(measure(kernel, T, I, layout, copy_bw), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
