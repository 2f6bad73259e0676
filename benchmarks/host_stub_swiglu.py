"""Host (Python) time of eager swiglu calls with the driver launch stubbed, on a CPU.

Why: on the GPU machine per-call host time varies by up to ~1.5x between calls, so the Python of
an eager call (checks, allocation, dispatch, CachedLaunch's key) is compared here against torch's
own two-op forward and graph and against a bare autograd.Function with the same allocations,
interleaved, on one host. Everything of ours runs as on a GPU whose device is current (the cached
launch path, a reused no-op guard) except the launcher's call into the driver. Not a GPU measurement.

    python benchmarks/host_stub_swiglu.py
"""

import contextlib
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # the CPU tensors take the Triton path (whose launches are stubbed)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _stub_timing import interleaved_medians  # noqa: E402  (this script's folder)

from kernelhub._loader import load_kernel_from_dir  # noqa: E402
from kernelhub.triton_launch import CachedLaunch  # noqa: E402

sw = load_kernel_from_dir(Path(__file__).resolve().parents[1] / "kernels_repo" / "swiglu")
dispatch = sys.modules[sw.__name__ + "._dispatch"]
_reuse = contextlib.nullcontext()
dispatch.device_guard = lambda t: _reuse  # as on a GPU whose device is current: a reused no-op


class _Compiled:  # what Triton's first launch returns, minus a driver to launch on
    run = staticmethod(lambda *a: None)
    function = packed_metadata = None


for variant in {id(v): v for v in dispatch._VARIANTS.values()}.values():
    for launch in (variant.fwd, variant.bwd):
        launch.fast = True  # the GPU's cached path (the interpreter would take Triton's own)
        launch._triton = lambda *a, **k: _Compiled()
CachedLaunch._run = staticmethod(lambda hit, grid, device_index, args: None)  # the driver call

g = torch.randn(1, 128, requires_grad=True)
u = torch.randn(1, 128, requires_grad=True)
g0, u0 = g.detach(), u.detach()
dy = torch.randn(1, 128)


class _Bare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.empty_like(a)

    @staticmethod
    def backward(ctx, d):
        a, b = ctx.saved_tensors
        return torch.empty_like(a), torch.empty_like(b)


STEPS = {
    "ours forward": lambda: sw.swiglu(g0, u0),
    "torch forward": lambda: F.silu(g0) * u0,
    "ours forward+backward": lambda: sw.swiglu(g, u).backward(dy),
    "torch forward+backward": lambda: (F.silu(g) * u).backward(dy),
    "bare_function forward+backward": lambda: _Bare.apply(g, u).backward(dy),
}


if __name__ == "__main__":
    for name, us in interleaved_medians(STEPS, n=3000, warmup=300).items():
        print(f"{name}: {us:.1f} us per call (median of 5 rounds)")
