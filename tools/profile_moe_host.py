"""Where the host time of one eager `fused_experts` forward goes (decode: T=1), on the GPU machine.

    PYTHONPATH=src python tools/profile_moe_host.py [T [KERNEL_DIR]]

Prints us per eager call (host, and GPU-inclusive) for Qwen3-30B-A3B experts, then cProfile's top
entries by own time. Eager decode is all host time: the kernels take ~30 us of GPU time at T=1.
"""

import sys
from pathlib import Path

import torch

from kernelhub.hub import get_local_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "kernels_repo" / "swiglu" / "benchmarks"))
from _host_profile import print_profile  # noqa: E402
from bench_swiglu import time_eager  # noqa: E402  (the SwiGLU benchmark's eager timing)

T = int(sys.argv[1]) if len(sys.argv) > 1 else 1
# another copy of the kernel repository (an older commit, say) to compare in the same call
moe = get_local_kernel(Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "kernels_repo" / "moe")
E, H, I, K = 128, 2048, 768, 8
dev = torch.device("cuda", 0)
gen = torch.Generator(device=dev).manual_seed(0)
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=gen)
gu = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
dn = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
idx = torch.rand(T, E, device=dev, generator=gen).topk(K, dim=1).indices
w = torch.rand(T, K, device=dev, generator=gen).softmax(-1)


def step():
    moe.fused_experts(x, gu, dn, idx, w, check_indices=False)


with torch.no_grad():
    for _ in range(50):
        step()
    for _ in range(3):
        ms, host = time_eager(step, 2000)
        print(f"fused_experts T={T}: host {host:.1f} us per eager call, {ms * 1e3:.1f} us with the GPU", flush=True)
    print_profile(step, 500, 25)
