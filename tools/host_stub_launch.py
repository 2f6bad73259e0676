"""Host (Python) time of one cached `CachedLaunch.split` launch, driver call stubbed, on a CPU.

A fake 3-tensor, 7-int, 4-constexpr kernel on the cached (GPU) path: what `split` itself costs per
eager launch (key, lookup, argument list), interleaved against another commit's triton_launch.py.

    python tools/host_stub_launch.py [--against DIR]
        DIR holds `git archive REV src/kernelhub/triton_launch.py | tar -x -C DIR`
"""

import importlib.util
import sys
import timeit
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NAMES = ["g", "u", "o", "M", "N", "s0", "s1", "s2", "s3", "s4", "BM", "BN", "EVEN", "PACKED"]
KERNEL = SimpleNamespace(params=[SimpleNamespace(name=n, is_constexpr=i >= 10) for i, n in enumerate(NAMES)],
                         arg_names=NAMES, pre_run_hooks=[])
COMPILED = SimpleNamespace(run=print, function=None, packed_metadata=None)


def stubbed(module):
    launch = module.CachedLaunch(KERNEL)
    launch.fast = True  # the cached path (TRITON_INTERPRET unset or set: forced)
    launch._triton = lambda *a, **k: COMPILED
    module.CachedLaunch._run = staticmethod(lambda hit, grid, index, args: None)  # the driver call
    return launch


def main() -> None:
    modules = {"ours": load(ROOT / "src" / "kernelhub" / "triton_launch.py", "_ours_triton_launch")}
    if sys.argv[1:2] == ["--against"]:
        modules["theirs"] = load(Path(sys.argv[2]) / "src" / "kernelhub" / "triton_launch.py", "_their_launch")
    g, u, o = torch.randn(64, 128), torch.randn(64, 128), torch.empty(64, 128)
    ints, constexprs = (64, 128, 128, 1, 128, 1, 128), (1, 2048, True, False)
    launches = {name: stubbed(m) for name, m in modules.items()}
    for launch in launches.values():
        launch.split((1,), 0, (g, u, o), ints, constexprs, num_warps=8)  # compiles (stub) and remembers
        assert launch.exact, "the fake kernel did not take the cached path"
    times = {name: [] for name in launches}
    for _ in range(15):
        for name, launch in launches.items():
            n = 50000
            t = timeit.timeit(lambda launch=launch: launch.split((1,), 0, (g, u, o), ints, constexprs, num_warps=8),
                              number=n)
            times[name].append(t / n * 1e6)
    for name, ts in times.items():
        ts.sort()
        print(f"{name}: split per cached launch, min {ts[0]:.2f} us, median {ts[len(ts) // 2]:.2f} us")


if __name__ == "__main__":
    main()
