"""Host (Python) time of one eager swiglu forward+backward with the kernel launches stubbed, on a CPU.

Why: on the GPU machine per-call host time varies by up to ~1.5x between calls, so the Python of
the autograd path is compared here against torch's own two-op graph and a bare autograd.Function
with the same three allocations, interleaved, on one host. Not a GPU measurement.

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

sw = load_kernel_from_dir(Path(__file__).resolve().parents[1] / "kernels_repo" / "swiglu")
dispatch = sys.modules[sw.__name__ + "._dispatch"]
dispatch._launch = lambda *a, **k: None  # host Python only
_reuse = contextlib.nullcontext()
dispatch.device_guard = lambda t: _reuse  # as on a GPU whose device is current: a reused no-op

g = torch.randn(1, 128, requires_grad=True)
u = torch.randn(1, 128, requires_grad=True)
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
    "ours": lambda: sw.swiglu(g, u).backward(dy),
    "torch": lambda: (F.silu(g) * u).backward(dy),
    "bare_function": lambda: _Bare.apply(g, u).backward(dy),
}


if __name__ == "__main__":
    for name, us in interleaved_medians(STEPS, n=3000, warmup=300).items():
        print(f"{name}: {us:.1f} us per forward+backward (median of 5 rounds)")
