"""Where a compiled fused_experts call spends its time, next to the eager call (GPU).

For the Qwen3-30B-A3B experts module (E=128, H=2048, I=768, top-8, bf16), kernelized, at each T:
eager, torch.compile default and reduce-overhead (fullgraph), the eager call replayed from a CUDA
graph (its GPU time alone), and the custom op called directly. Then the floor: the same three
modes for a module whose forward is one trivial custom op on the same five tensors (a clone), for
a module calling only kernelhub's custom op, and for one calling `fused_experts`, so the time
torch.compile adds to any call shows apart from what kernelhub adds. Then a torch.profiler table
of each path (GPU kernels and host ops per call): whether a compiled path runs other kernels,
more kernels, copies, or only more host time.

BODY=1 (default): also the op body's own host time per call in each mode (the eager path that
both the eager call and the custom op run, timed by a wrapper), and a cProfile of compiled calls:
whether a slower compiled call spends the time inside kernelhub's Python or around it.

Usage (repo root): PYTHONPATH=src python tools/diag_compiled.py   env: TOKENS=1,4096 PROFILE=1 BODY=1
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn
from triton.testing import do_bench

from kernelhub import Mode, kernelize
from kernelhub.default_mapping import bundled_kernels_dir
from kernelhub.hub import get_local_kernel

E, H, I, K = 128, 2048, 768, 8
DEV = torch.device("cuda")


class Experts(nn.Module):
    """The transformers v5 `*Experts` layout, a forward kernelize replaces."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H, device=DEV, dtype=torch.bfloat16) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(E, H, I, device=DEV, dtype=torch.bfloat16) * 0.02)
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):  # pragma: no cover - replaced
        raise RuntimeError("not kernelized")


def inputs(T: int):
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, generator=g)
    logits = torch.randn(T, E, device=DEV, generator=g)
    w, idx = logits.softmax(-1).topk(K, dim=-1)
    return x, idx, w.to(torch.bfloat16)


def graphed(fn, args):
    """fn(*args) captured once in a CUDA graph: replay = its GPU time without host overhead."""
    fn(*args)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(*args)
    return g.replay


def profile(name: str, fn, n: int = 20) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    for _ in range(3):  # past compiling and CUDA-graph recording (modes() reset Dynamo)
        fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    print(f"\n### {name}: {n} calls")
    events = p.key_averages()
    print(events.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=70))
    # CUDA runtime/driver calls per call (a sync or a memcpy here serializes host and GPU time)
    api = [(e.key, e.count / n, e.cpu_time_total / n) for e in events if e.key.startswith(("cuda", "cu"))]
    print(f"T=api {name}: " + "  ".join(f"{k} x{c:g} {t:.1f}us" for k, c, t in sorted(api, key=lambda a: -a[2])))


@torch.library.custom_op("kernelhub_diag::clone5", mutates_args=())
def _clone5(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, i: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_clone5.register_fake
def _(x, a, b, i, w):
    return x.new_empty(x.shape)


class _Floor(Experts):
    def forward(self, x, idx, w):
        return _clone5(x, self.gate_up_proj, self.down_proj, idx, w)


class _OpOnly(Experts):
    def __init__(self, op, variant: str):
        super().__init__()
        self.op, self.variant = op, variant

    def forward(self, x, idx, w):
        return self.op(x, self.gate_up_proj, self.down_proj, idx, w, self.variant, "")


class _FusedExperts(Experts):
    def __init__(self, moe):
        super().__init__()
        self.moe = moe

    def forward(self, x, idx, w):
        return self.moe.fused_experts(x, self.gate_up_proj, self.down_proj, idx, w)


def modes(module, x, idx, w) -> str:
    """do_bench us of eager, compiled (default) and reduce-overhead calls of module(x, idx, w)."""
    cells = []
    for mode in ("eager", "default", "reduce-overhead"):
        torch._dynamo.reset()
        if mode == "eager":
            def fn():
                return module(x, idx, w)
        else:
            c = torch.compile(module, fullgraph=True, mode=None if mode == "default" else mode)

            def fn(c=c, ro=mode != "default"):
                if ro:
                    torch.compiler.cudagraph_mark_step_begin()
                return c(x, idx, w)
        cells.append(f"{mode} {do_bench(fn, warmup=50, rep=300) * 1e3:7.1f}")
    return "   ".join(cells)


def point(T: int, module, compiled, reduce, moe, ops) -> None:
    x, idx, w = inputs(T)
    variant = moe.select_variant(x.device)  # what the kernelized module runs on this GPU
    with torch.no_grad():
        ref = module(x, idx, w)

        def ro():
            torch.compiler.cudagraph_mark_step_begin()
            return reduce(x, idx, w)

        paths = {
            "eager": lambda: module(x, idx, w),
            "compiled": lambda: compiled(x, idx, w),
            "reduce-overhead": ro,
            "op direct": lambda: ops.fused_experts_op(x, module.gate_up_proj, module.down_proj, idx, w, variant, ""),
            "eager graph replay": graphed(lambda: module(x, idx, w), ()),
        }
        for name, fn in paths.items():
            out = fn()
            err = (out.float() - ref.float()).abs().max().item() if isinstance(out, torch.Tensor) else float("nan")
            ms = do_bench(fn, warmup=50, rep=300)
            print(f"T={T:6d} {name:20s} {ms * 1e3:9.1f} us   max|diff| vs eager {err:.3g}", flush=True)
        floors = {"trivial op (floor)": _Floor(), "kernelhub op only": _OpOnly(ops.fused_experts_op, variant),
                  "fused_experts": _FusedExperts(moe), "kernelized": module}
        for name, mod in floors.items():
            print(f"T={T:6d} {name:20s} {modes(mod, x, idx, w)}", flush=True)
        if os.environ.get("PROFILE", "1") == "1":
            for name in ("eager", "compiled", "reduce-overhead"):
                profile(f"T={T} {name}", paths[name])


def body_times(module, compiled, reduce, x, idx, w, n: int = 200) -> None:
    """us per call spent inside `_experts_eager.run` (the op body) next to the whole call, per mode;
    then the top of a cProfile of compiled calls (by own time)."""
    import cProfile
    import pstats
    import time

    moe_eager = next(m for name, m in sys.modules.items() if name.endswith("._experts_eager"))
    inner = moe_eager.run
    spent = [0]

    def timed(*args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter_ns() - t0

    def ro():
        torch.compiler.cudagraph_mark_step_begin()
        return reduce(x, idx, w)

    moe_eager.run = timed
    try:
        for name, fn in (("eager", lambda: module(x, idx, w)), ("compiled", lambda: compiled(x, idx, w)),
                         ("reduce-overhead", ro)):
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            spent[0] = 0
            t0 = time.perf_counter_ns()
            for _ in range(n):
                fn()
            host = time.perf_counter_ns() - t0
            torch.cuda.synchronize()
            total = time.perf_counter_ns() - t0
            print(f"body {name:16s} call host {host / n / 1e3:7.1f} us  (with GPU {total / n / 1e3:7.1f})   "
                  f"inside the op body {spent[0] / n / 1e3:7.1f} us", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            compiled(x, idx, w)
        prof.disable()
        torch.cuda.synchronize()
        print("### cProfile of compiled calls (tottime, us per call)")
        st = pstats.Stats(prof)
        rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:30]
        for (file, line, fn_name), (_cc, nc, tt, ct, _) in rows:
            print(f"  {tt / n * 1e6:7.2f} own {ct / n * 1e6:7.2f} cum  {nc / n:5.1f}/call  "
                  f"{Path(file).name}:{line} {fn_name}")
    finally:
        moe_eager.run = inner


def main() -> None:
    torch.manual_seed(0)
    tokens = [int(t) for t in os.environ.get("TOKENS", "1,4096").split(",")]
    module = kernelize(Experts(), mode=Mode.INFERENCE | Mode.TORCH_COMPILE, device="cuda")
    print("bound:", type(module).forward)
    moe = get_local_kernel(bundled_kernels_dir() / "moe", "moe")
    compiled = torch.compile(module, fullgraph=True)
    reduce = torch.compile(module, fullgraph=True, mode="reduce-overhead")
    ops = sys.modules[moe.__name__ + "._experts_custom_ops"]
    for T in tokens:
        if os.environ.get("BODY", "1") == "1":
            with torch.no_grad():
                body_times(module, compiled, reduce, *inputs(T))
        point(T, module, compiled, reduce, moe, ops)


if __name__ == "__main__":
    main()
