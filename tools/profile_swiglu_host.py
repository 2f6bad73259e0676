"""Where the host time of one eager swiglu forward+backward goes (cProfile, GPU machine).

    PYTHONPATH=src python tools/profile_swiglu_host.py [T I]
"""

import sys
from pathlib import Path

import torch

from kernelhub.hub import get_local_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _host_profile import print_profile  # noqa: E402

swiglu = get_local_kernel(Path(__file__).resolve().parents[1] / "kernels_repo" / "swiglu").swiglu
T, I = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (4096, 6144)
g = torch.randn(T, I, device="cuda:0", dtype=torch.bfloat16, requires_grad=True)
u = torch.randn(T, I, device="cuda:0", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(T, I, device="cuda:0", dtype=torch.bfloat16)


def step():
    torch.autograd.grad(swiglu(g, u), (g, u), dy)


for _ in range(20):
    step()
print_profile(step, 200, 15)
