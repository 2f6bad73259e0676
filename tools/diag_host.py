"""Where the time of one eager call goes: torch.profiler tables (host ops, CUDA kernels, syncs).

For the calls whose eager time is far above their CUDA-graph time in docs/performance.md:
SwiGLU forward+backward at 4096x6144, the MoE alignment at Qwen3-30B-A3B T=512/4096/16384 and
fused_experts forward at T=1/512. Prints, per case, the ms per eager call (CUDA events around
N calls), the host ms per call (perf_counter before the sync) and the profiler's top rows.

    PYTHONPATH=src python tools/diag_host.py [swiglu] [swhost] [align] [experts]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "kernels_repo" / "swiglu" / "benchmarks"))
from bench_swiglu import time_eager  # noqa: E402  (the same eager timing as the SwiGLU benchmark)

from kernelhub._loader import load_kernel_from_dir  # noqa: E402

DEV = torch.device("cuda", 0)


class Trivial(torch.autograd.Function):
    """The cheapest Python autograd.Function of the same arity: a*b forward, two muls back."""

    @staticmethod
    def forward(ctx, a, b):
        return a * b

    @staticmethod
    def backward(ctx, d):
        return d * 2, d * 3


def timed(name: str, fn, n: int = 50) -> None:
    ms, host_us = time_eager(fn, n)
    print(f"## {name}: {ms:.4f} ms per eager call, host {host_us / 1e3:.4f} ms", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60)
    print(table, flush=True)
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=60)
    print(table, flush=True)


def swiglu_cases() -> None:
    k = load_kernel_from_dir(ROOT / "kernels_repo" / "swiglu")
    import torch.nn.functional as F

    T, I = 4096, 6144
    g = torch.randn(T, I, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    u = torch.randn(T, I, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, I, device=DEV, dtype=torch.bfloat16)
    timed("swiglu ours fwd+bwd 4096x6144", lambda: torch.autograd.grad(k.swiglu(g, u), (g, u), dy))
    timed("swiglu torch fwd+bwd 4096x6144", lambda: torch.autograd.grad(F.silu(g) * u, (g, u), dy))
    gd, ud = g.detach(), u.detach()
    timed("swiglu ours fwd 4096x6144", lambda: k.swiglu(gd, ud))

    # Where the backward's host time goes: wall time inside our backward (on whichever thread
    # autograd runs it), against a trivial autograd.Function whose backward is two torch ops.
    ops = sys.modules[k.__name__ + ".ops"]
    fn = ops._SwiGLUFunction
    inner, threads = [], set()
    orig = fn.backward

    import cProfile
    import pstats

    prof = cProfile.Profile()

    def timed_backward(ctx, dy):
        import threading

        threads.add(threading.current_thread().name)
        t0 = time.perf_counter()
        res = orig(ctx, dy)
        inner.append(time.perf_counter() - t0)
        if len(inner) > 20:  # a cProfile of the backward body, on the thread autograd runs it on
            prof.enable()
            orig(ctx, dy)
            prof.disable()
        return res

    fn.backward = staticmethod(timed_backward)
    try:
        timed("swiglu ours fwd+bwd, backward timed inside", lambda: torch.autograd.grad(k.swiglu(g, u), (g, u), dy))
    finally:
        fn.backward = staticmethod(orig)
    inner.sort()
    print(f"## inside our backward: median {inner[len(inner) // 2] * 1e6:.1f} us, threads {threads}", flush=True)
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)

    timed("trivial autograd.Function fwd+bwd 4096x6144", lambda: torch.autograd.grad(Trivial.apply(g, u), (g, u), dy))
    y = k.swiglu(g, u)
    timed("swiglu ours backward only (retain_graph)", lambda: torch.autograd.grad(y, (g, u), dy, retain_graph=True))
    gs = torch.randn(1, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    us = torch.randn(1, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dys = torch.randn(1, 128, device=DEV, dtype=torch.bfloat16)
    timed("swiglu ours fwd+bwd 1x128", lambda: torch.autograd.grad(k.swiglu(gs, us), (gs, us), dys))
    timed("swiglu torch fwd+bwd 1x128", lambda: torch.autograd.grad(F.silu(gs) * us, (gs, us), dys))


def swiglu_host_ab() -> None:
    """Host us per eager call, interleaved over 5 rounds (the host's speed drifts between calls):
    our forward+backward against a trivial autograd.Function (a*b forward, two muls back), torch's
    two ops, and the two halves swapped (our forward with the trivial backward and vice versa), plus
    each forward alone on inputs that require grad (graph built, then dropped)."""
    import torch.nn.functional as F

    k = load_kernel_from_dir(ROOT / "kernels_repo" / "swiglu")
    ops = sys.modules[k.__name__ + ".ops"]
    dispatch = sys.modules[k.__name__ + "._dispatch"]

    class OursFwdTrivialBwd(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            return k.swiglu(a, b)  # grad mode is off inside forward: the plain launch

        @staticmethod
        def backward(ctx, d):
            return d * 2, d * 3

    class TrivialFwdOursBwd(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            ctx.target = dispatch._resolve("swiglu", a, None)
            return a * b

        @staticmethod
        def backward(ctx, d):
            return ops._SwiGLUFunction.backward(ctx, d)[:2]

    def cases(g, u, dy) -> dict:
        def grad_of(fn):
            return lambda: torch.autograd.grad(fn(g, u), (g, u), dy)

        return {
            "ours": grad_of(k.swiglu),
            "torch": grad_of(lambda a, b: F.silu(a) * b),
            "trivial": grad_of(Trivial.apply),
            "ours_fwd+trivial_bwd": grad_of(OursFwdTrivialBwd.apply),
            "trivial_fwd+ours_bwd": grad_of(TrivialFwdOursBwd.apply),
            "ours_fwd_only": lambda: k.swiglu(g, u),
            "trivial_fwd_only": lambda: Trivial.apply(g, u),
        }

    for T, I in ((1, 128), (64, 14336), (4096, 6144)):
        g, u, dy = (torch.randn(T, I, device=DEV, dtype=torch.bfloat16, requires_grad=i < 2) for i in range(3))
        fns = cases(g, u, dy)
        res: dict[str, list[float]] = {n: [] for n in fns}
        for _ in range(5):
            for name, fn in fns.items():
                ms, _host = time_eager(fn, 300)
                res[name].append(ms * 1e3)
        line = ", ".join(f"{n} {sorted(v)[2]:.1f}" for n, v in res.items())
        print(f"## swiglu {T}x{I} us per eager call (median of 5): {line}", flush=True)


def moe_inputs(T: int, E: int = 128, H: int = 2048, I: int = 768, K: int = 8):
    logits = torch.randn(T, E, device=DEV)
    w, idx = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    gu = torch.randn(E, 2 * I, H, device=DEV, dtype=torch.bfloat16) * 0.02
    dn = torch.randn(E, H, I, device=DEV, dtype=torch.bfloat16) * 0.02
    return x, gu, dn, idx, w.to(torch.bfloat16)


def align_cases(moe) -> None:
    rt = sys.modules[moe.__name__ + "._experts_routing"]
    for T, bm in ((512, 32), (4096, 64), (16384, 128)):
        _, _, _, idx, _ = moe_inputs(T)
        timed(f"align_rows Qwen3 T={T} block_m={bm}", lambda idx=idx, bm=bm: rt.align_rows(idx, 128, bm))


def launcher_report(moe) -> None:
    """Did the cached launches take their fast path? (exact-key hits need `fast` and no hooks)."""
    from kernelhub import triton_launch as tlaunch

    launch = sys.modules[moe.__name__ + "._experts_launch"]
    rt = sys.modules[moe.__name__ + ".routing"]
    print(f"## launcher: hooks_registered={tlaunch._hooks_registered()} gemm fast={launch.gemm_launch.fast} "
          f"exact={len(launch.gemm_launch.exact)} by_spec={len(launch.gemm_launch.by_spec)} "
          f"map_scatter exact={len(rt._launch['_map_scatter_kernel'].exact)}", flush=True)
    x, gu, dn, idx, w = moe_inputs(512)
    lau = rt._launch["_map_scan_kernel"]
    buf = torch.zeros(64 * 129, device=DEV, dtype=torch.int32)
    tot = torch.zeros(129, device=DEV, dtype=torch.int32)
    kw = dict(BLOCK_T=128, BLOCK_E=16, num_warps=4)
    fast = lambda: lau((9,), 0, buf, tot, 64, 129, **kw)  # noqa: E731
    slow = lambda: lau.kernel[(9,)](buf, tot, 64, 129, **kw)  # noqa: E731
    fast()
    run, function, metadata, direct = next(iter(lau.by_spec.values()))
    stream = torch._C._cuda_getCurrentRawStream(0)
    # the launcher object with tensors (it calls data_ptr() and cuPointerGetAttribute per pointer)
    # and with addresses, and its entry point with addresses (what CachedLaunch does on triton 3.6)
    objs = lambda: run(9, 1, 1, stream, function, metadata, None, None, None, buf, tot, 64, 129, 128, 16)  # noqa: E731
    ints = lambda: run(9, 1, 1, stream, function, metadata, None, None, None, buf.data_ptr(),  # noqa: E731
                       tot.data_ptr(), 64, 129, 128, 16)
    cases = [("cached", fast), ("triton", slow), ("launcher, tensors", objs), ("launcher, addresses", ints)]
    if direct is not None:
        launch, coop, pdl = direct
        cases.append(("launcher entry, addresses", lambda: launch(
            9, 1, 1, stream, function, coop, pdl, None, None, metadata, None, None, None, buf.data_ptr(),
            tot.data_ptr(), 64, 129, 128, 16)))
    for name, fn in cases:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):
            fn()
        host = (time.perf_counter() - t0) / 500 * 1e6
        torch.cuda.synchronize()
        print(f"## one launch of _map_scan_kernel, {name}: {host:.1f} us host", flush=True)


def experts_cases(moe) -> None:
    for T in (1, 512):
        x, gu, dn, idx, w = moe_inputs(T)
        with torch.no_grad():
            timed(f"fused_experts fwd Qwen3 T={T}",
                  lambda x=x, gu=gu, dn=dn, idx=idx, w=w: moe.fused_experts(x, gu, dn, idx, w, check_indices=False))


def main() -> None:
    import triton

    print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(), flush=True)
    which = sys.argv[1:] or ["swiglu", "align", "experts"]
    moe = load_kernel_from_dir(ROOT / "kernels_repo" / "moe")
    if "swiglu" in which:
        swiglu_cases()
    if "swhost" in which:
        swiglu_host_ab()
    if "align" in which:
        align_cases(moe)
    if "experts" in which:
        experts_cases(moe)
        launcher_report(moe)


if __name__ == "__main__":
    main()
