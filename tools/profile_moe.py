"""Per-kernel GPU time of one fused_experts forward / forward+backward (torch.profiler, CUDA activity).

The stage times of `bench_moe.py` time each GEMM alone, host overhead and launch tail included;
this shows what the GPU spends on each kernel inside the real call, so that the gap to the floor
can be split between GEMMs, copies, routing and combine.

Usage (repo root, GPU): PYTHONPATH=src python tools/profile_moe.py
  env: POINTS=qwen3_30b_a3b:4096,deepseek_v3:4096  MODES=fwd,fwdbwd  REPS=10
       COMPILED=1: also each mode with fused_experts under torch.compile(fullgraph=True), its kernels
       beside the eager call's (where a compiled call's extra time goes); BACKWARD=1: fwdbwd by
       .backward() into cleared .grad (as training and bench_moe.py do) instead of autograd.grad;
       FP8=1: the weights quantized to float8_e4m3fn 128x128 blocks (reference_fp8), forward only
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels_repo" / "moe" / "benchmarks"))
from bench_moe import DEV, SHAPES, moe, routing  # noqa: E402  (kernels_repo/moe/benchmarks/)


def kernel_times(fn, reps: int, before=None) -> tuple[dict[str, tuple[float, int]], float]:
    """{kernel name: (us per call, launches per call)} and the summed GPU us per call. `before`:
    run ahead of each profiled call (an L2 flush, say); its kernels are listed too."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if before is not None:
                before()
            fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = ev.name.split("(")[0][:70]
        totals[name][0] += ev.device_time_total
        totals[name][1] += 1
    out = {n: (t / reps, c // reps) for n, (t, c) in totals.items()}
    return out, sum(t for t, _ in out.values())


def point_inputs(name: str, T: int) -> tuple:
    """(x, gate_up_proj, down_proj, topk ids, topk weights, dY) of one point, all but the ids and dY
    requiring grad."""
    s = SHAPES[name]
    E, H, I, K = s["E"], s["H"], s["I"], s["K"]
    gu = (torch.randn(E, 2 * I, H, device=DEV, dtype=torch.bfloat16) * 0.02).requires_grad_()
    dn = (torch.randn(E, H, I, device=DEV, dtype=torch.bfloat16) * 0.02).requires_grad_()
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    idx, w = routing(T, E, K)
    dy = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    return x, gu, dn, idx, w.requires_grad_(), dy


def fp8_weights(gu: torch.Tensor, dn: torch.Tensor) -> dict:
    """fused_experts' fp8 arguments for the bf16 weights: values and block scales, one expert at a
    time (`quantize_blocks` on the whole [E, N, K] would take its fp32 copy: 30 GB at DeepSeek-V3)."""
    ref = sys.modules[moe.__name__ + ".reference_fp8"]
    out = {}
    for name, w in (("gate_up_proj", gu), ("down_proj", dn)):
        pairs = [ref.quantize_blocks(w[e].detach()) for e in range(w.shape[0])]
        out[name] = torch.stack([q for q, _ in pairs])
        out[name + "_scale_inv"] = torch.stack([s for _, s in pairs])
    return out


def profile_point(name: str, T: int, modes: list[str], reps: int) -> None:
    x, gu, dn, idx, w, dy = point_inputs(name, T)
    fp8 = fp8_weights(gu, dn) if os.environ.get("FP8") == "1" else None
    if fp8 is not None:
        gu, dn = fp8.pop("gate_up_proj"), fp8.pop("down_proj")
        modes = [m for m in modes if m == "fwd"]

    def call(a, g, d, ww):
        return moe.fused_experts(a, g, d, idx, ww, check_indices=False, **(fp8 or {}))

    runs = [("eager", call)]
    if os.environ.get("COMPILED") == "1":
        runs.append(("compiled", torch.compile(call, fullgraph=True)))
    for label, f in runs:
        def fwd(f=f):
            with torch.no_grad():
                f(x, gu, dn, w)

        def fwdbwd(f=f):
            if os.environ.get("BACKWARD") == "1":  # as training does: .backward() into .grad (cleared)
                for p in (x, gu, dn, w):
                    p.grad = None
                f(x, gu, dn, w).backward(dy)
            else:
                torch.autograd.grad(f(x, gu, dn, w), (x, gu, dn, w), dy)

        for mode in modes:
            table, total = kernel_times(fwd if mode == "fwd" else fwdbwd, reps)
            print(f"== profile {name} T={T} {mode} {label}: GPU kernels {total / 1e3:.3f} ms per call", flush=True)
            for kname, (us, n) in sorted(table.items(), key=lambda kv: -kv[1][0]):
                print(f"  {us / 1e3:8.3f} ms {100 * us / total:5.1f}%  x{n:<3d} {kname}", flush=True)


def main() -> None:
    points = os.environ.get("POINTS", "qwen3_30b_a3b:4096,deepseek_v3:4096")
    modes = os.environ.get("MODES", "fwd,fwdbwd").split(",")
    reps = int(os.environ.get("REPS", "10"))
    for point in points.split(","):
        name, T = point.split(":")
        profile_point(name, int(T), modes, reps)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
