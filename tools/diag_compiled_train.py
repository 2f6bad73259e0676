"""Where a compiled forward+backward of fused_experts loses time against eager when its GPU kernels
are the same (tools/profile_moe.py COMPILED=1 BACKWARD=1): wall time per call by CUDA events,
GPU-kernel time per call, and the synchronizing CUDA calls torch reports (sync debug mode).

Usage (repo root, GPU): PYTHONPATH=src python tools/diag_compiled_train.py   env: POINT=deepseek_v3:16384
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_moe import moe, point_inputs  # noqa: E402  (tools/)


def main() -> None:
    name, T = os.environ.get("POINT", "deepseek_v3:16384").split(":")
    x, gu, dn, idx, w, dy = point_inputs(name, int(T))
    w = w.detach()  # (the router's weights held fixed, as before)

    def call(a, g, d):
        return moe.fused_experts(a, g, d, idx, w, check_indices=False)

    for label, f in (("eager", call), ("compiled", torch.compile(call, fullgraph=True))):
        def fb(f=f):
            for p in (x, gu, dn):
                p.grad = None
            f(x, gu, dn).backward(dy)

        for _ in range(3):
            fb()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fb()
        end.record()
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            fb()
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats()
        syncs = sorted({str(c.message).splitlines()[0][:120] for c in caught})
        print(f"{label}: {start.elapsed_time(end) / 5:.2f} ms per call (wall, CUDA events); cudaMalloc calls in "
              f"one call {after['num_device_alloc'] - stats['num_device_alloc']}, cudaFree "
              f"{after['num_device_free'] - stats['num_device_free']}; synchronizing calls: {syncs or 'none'}",
              flush=True)


if __name__ == "__main__":
    main()
