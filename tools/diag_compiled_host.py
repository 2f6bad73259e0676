"""Host time of a kernelized `fused_experts` decode call, eager against compiled, piece by piece (GPU).

Why: at T=1 the Qwen3-30B-A3B experts call runs ~43 us of kernels, and under torch.compile the
call's host time, not its kernels, sets its speed. This prints, per mode (eager, op called
directly, torch.compile default), the host us per call of the whole call and of the pieces inside
the op body (`_experts_eager.run`, its replay key, the replay, each launch), timed by wrappers;
the back-to-back time per call (no L2 flush: what a decode loop sees); and the same Python work
(`torch.empty`, tensor accessors) timed inside a torch op body called through the dispatcher,
directly and from a compiled graph, against the same work called from Python. A module whose
forward is one trivial custom op on the same tensors gives torch.compile's own per-call cost.

Usage (repo root): PYTHONPATH=src python tools/diag_compiled_host.py   env: T=1 N=300
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diag_compiled import Experts, _Floor, inputs  # noqa: E402  (the same modules and inputs)

from kernelhub import Mode, kernelize  # noqa: E402
from kernelhub.triton_launch import CachedLaunch  # noqa: E402

N = int(os.environ.get("N", "300"))


def per_call(fn, n: int = N) -> tuple[float, float]:
    """(host us per call, wall us per call with the GPU drained) over n back-to-back calls."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    host = time.perf_counter_ns() - t0
    torch.cuda.synchronize()
    return host / n / 1e3, (time.perf_counter_ns() - t0) / n / 1e3


class Timers:
    """Wrap module attributes with accumulating timers (us per call of the outer loop)."""

    def __init__(self) -> None:
        self.spent: dict[str, int] = {}
        self.undo: list = []

    def wrap(self, owner, attr: str, label: str) -> None:
        inner = getattr(owner, attr)
        spent = self.spent
        spent[label] = 0

        def timed(*args, **kwargs):
            t0 = time.perf_counter_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter_ns() - t0

        old = owner.__dict__[attr] if isinstance(owner, type) else inner  # (a staticmethod stays one)
        setattr(owner, attr, staticmethod(timed) if isinstance(owner, type) else timed)
        self.undo.append((owner, attr, old))

    def reset(self) -> None:
        for k in self.spent:
            self.spent[k] = 0

    def restore(self) -> None:
        for owner, attr, old in reversed(self.undo):
            setattr(owner, attr, old)


_SINK: list[int] = [0]


def _python_work(x: torch.Tensor, reps: int) -> None:
    """What a replayed call does in Python besides its launches: accessors, a key, allocations."""
    t0 = time.perf_counter_ns()
    for _ in range(reps):
        key = (x.device, x.dtype, x.shape, x.stride(), os.environ.get("KERNELHUB_MOE_CONFIG_DIR"),
               torch.is_grad_enabled(), torch.compiler.is_compiling())
        hash(key)
        torch.empty(x.shape, device=x.device, dtype=x.dtype).data_ptr()
    _SINK[0] += time.perf_counter_ns() - t0


_LIB = torch.library.Library("kernelhub_diag_host", "FRAGMENT")
_LIB.define("work(Tensor x, int reps) -> Tensor")


def _work(x, reps):
    _python_work(x, reps)
    return x.new_empty(x.shape)


_LIB.impl("work", _work, "CUDA")
torch.library.register_fake("kernelhub_diag_host::work", lambda x, reps: x.new_empty(x.shape), lib=_LIB)


class _Work(torch.nn.Module):
    def forward(self, x):
        return torch.ops.kernelhub_diag_host.work(x, 50)


def python_work_inside_ops(x: torch.Tensor) -> None:
    reps = 50
    compiled = torch.compile(_Work(), fullgraph=True)
    for name, fn in (("from Python", lambda: _python_work(x, reps)),
                     ("op body, direct", lambda: torch.ops.kernelhub_diag_host.work(x, reps)),
                     ("op body, compiled graph", lambda: compiled(x))):
        for _ in range(3):
            fn()
        _SINK[0] = 0
        for _ in range(20):
            fn()
        print(f"python work {name:24s} {_SINK[0] / (20 * reps) / 1e3:6.2f} us per rep", flush=True)


def main() -> None:
    torch.manual_seed(0)
    T = int(os.environ.get("T", "1"))
    module = kernelize(Experts(), mode=Mode.INFERENCE | Mode.TORCH_COMPILE, device="cuda")
    for p in module.parameters():
        p.requires_grad_(False)
    x, idx, w = inputs(T)
    moe_eager = next(m for name, m in sys.modules.items() if name.endswith("._experts_eager"))
    ops = next(m for name, m in sys.modules.items() if name.endswith("._experts_custom_ops"))
    moe = sys.modules[ops.__name__.rsplit(".", 1)[0]]
    variant = moe.select_variant(x.device)
    compiled = torch.compile(module, fullgraph=True)
    reduce = torch.compile(module, fullgraph=True, mode="reduce-overhead")

    def ro():
        torch.compiler.cudagraph_mark_step_begin()
        return reduce(x, idx, w)

    paths = {
        "eager": lambda: module(x, idx, w),
        "fused_experts": lambda: moe.fused_experts(x, module.gate_up_proj, module.down_proj, idx, w),
        "run (op body)": lambda: moe_eager.run(x, module.gate_up_proj, module.down_proj, idx, w, variant, None,
                                               False),
        "op direct": lambda: ops.fused_experts_op(x, module.gate_up_proj, module.down_proj, idx, w, variant, ""),
        "compiled": lambda: compiled(x, idx, w),
        "reduce-overhead": ro,
    }
    floor = _Floor()  # one trivial custom op on the same tensors: torch.compile's own per-call cost
    floor_compiled = torch.compile(floor, fullgraph=True)
    floor_reduce = torch.compile(floor, fullgraph=True, mode="reduce-overhead")

    def floor_ro():
        torch.compiler.cudagraph_mark_step_begin()
        return floor_reduce(x, idx, w)

    paths.update({"trivial eager": lambda: floor(x, idx, w), "trivial compiled": lambda: floor_compiled(x, idx, w),
                  "trivial reduce-o.": floor_ro})
    with torch.no_grad():
        for name, fn in paths.items():
            host, wall = per_call(fn)
            print(f"T={T} {name:16s} host {host:7.1f} us/call   back-to-back {wall:7.1f} us/call", flush=True)
        timers = Timers()
        replay = moe_eager.replay
        timers.wrap(moe_eager, "run", "run")
        timers.wrap(replay, "replay_key", "replay_key")
        timers.wrap(replay, "recorded", "recorded")
        timers.wrap(replay, "replay", "replay")
        timers.wrap(CachedLaunch, "run_hit", "run_hit (all launches)")
        try:
            for name in ("eager", "op direct", "compiled"):
                per_call(paths[name], 5)
                timers.reset()
                host, _ = per_call(paths[name])
                inside = "  ".join(f"{k} {v / (N + 20) / 1e3:.1f}" for k, v in timers.spent.items())
                print(f"T={T} pieces {name:10s} host {host:7.1f} us/call   inside (us/call): {inside}", flush=True)
        finally:
            timers.restore()
        python_work_inside_ops(x)


if __name__ == "__main__":
    main()
