"""Host (Python) time of eager swiglu calls with the driver launch stubbed, on a CPU.

Why: on the GPU machine per-call host time varies by up to ~1.5x between calls, so the Python of
an eager call (checks, allocation, dispatch, CachedLaunch's key) is compared here on one host,
interleaved: against torch's own two-op forward and graph and a bare autograd.Function with the same
allocations, or against another commit's code. Everything of ours runs as on a GPU whose device is
current (the cached launch path, a reused no-op guard) except the launcher's call into the driver.
Not a GPU measurement.

    python tools/host_stub_swiglu.py [SHAPE]                # SHAPE e.g. 1,128 (default) or 2,3,128
    python tools/host_stub_swiglu.py --against DIR [SHAPE]  # this tree's code against DIR's, where
        DIR holds `git archive REV kernels_repo/swiglu src/kernelhub/triton_launch.py | tar -x -C DIR`
"""

import contextlib
import importlib.util
import os
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # the CPU tensors take the Triton path (whose launches are stubbed)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from _stub_timing import interleaved_medians  # noqa: E402  (this script's folder)

import kernelhub.triton_launch as triton_launch  # noqa: E402
from kernelhub._loader import load_kernel_from_dir  # noqa: E402

_REUSE = contextlib.nullcontext()


class _Compiled:  # what Triton's first launch returns, minus a driver to launch on
    run = staticmethod(lambda *a: None)
    function = packed_metadata = None


def stubbed_swiglu(repo: Path, launch_module) -> object:
    """The kernel repository at `repo`, its launches made by `launch_module`'s CachedLaunch on the
    cached (GPU) path with the driver call stubbed."""
    sw = load_kernel_from_dir(repo)
    dispatch = sys.modules[sw.__name__ + "._dispatch"]
    dispatch.device_guard = lambda t: _REUSE  # as on a GPU whose device is current: a reused no-op
    for variant in {id(v): v for v in dispatch._VARIANTS.values()}.values():
        for name in ("fwd", "bwd"):
            launch = launch_module.CachedLaunch(getattr(variant, name).kernel)
            launch.fast = True  # the GPU's cached path (the interpreter would take Triton's own)
            launch._triton = lambda *a, **k: _Compiled()
            setattr(variant, name, launch)
    launch_module.CachedLaunch._run = staticmethod(lambda hit, grid, device_index, args: None)  # the driver
    return sw


class _Bare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.empty_like(a)

    @staticmethod
    def backward(ctx, d):
        a, b = ctx.saved_tensors
        return torch.empty_like(a), torch.empty_like(b)


def main() -> None:
    args = sys.argv[1:]
    against = None
    if args[:1] == ["--against"]:
        against, args = Path(args[1]), args[2:]
    shape = tuple(int(v) for v in (args[0] if args else "1,128").split(","))
    g = torch.randn(*shape, requires_grad=True)
    u = torch.randn(*shape, requires_grad=True)
    g0, u0, dy = g.detach(), u.detach(), torch.randn(*shape)
    repos = {"ours": stubbed_swiglu(ROOT / "kernels_repo" / "swiglu", triton_launch)}
    if against is not None:
        spec = importlib.util.spec_from_file_location("_old_triton_launch",
                                                      against / "src" / "kernelhub" / "triton_launch.py")
        old_launch = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old_launch)
        repos["theirs"] = stubbed_swiglu(against / "kernels_repo" / "swiglu", old_launch)
    steps = {}
    for name, sw in repos.items():
        steps[f"{name} forward"] = lambda sw=sw: sw.swiglu(g0, u0)
        steps[f"{name} forward+backward"] = lambda sw=sw: sw.swiglu(g, u).backward(dy)
    if against is None:
        steps["torch forward"] = lambda: F.silu(g0) * u0
        steps["torch forward+backward"] = lambda: (F.silu(g) * u).backward(dy)
        steps["bare_function forward+backward"] = lambda: _Bare.apply(g, u).backward(dy)
    medians = interleaved_medians(steps, n=3000, warmup=300, rounds=7)
    best = dict.fromkeys(steps, float("inf"))  # minima too: the least disturbed rounds of a shared host
    for _ in range(30):
        for key, fn in steps.items():
            t0 = time.perf_counter()
            for _ in range(500):
                fn()
            best[key] = min(best[key], (time.perf_counter() - t0) / 500 * 1e6)
    for key in steps:
        print(f"{shape} {key}: median {medians[key]:.1f} us, min {best[key]:.1f} us per call")


if __name__ == "__main__":
    main()
