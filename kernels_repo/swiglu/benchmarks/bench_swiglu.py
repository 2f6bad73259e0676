"""SwiGLU on one GPU: kernelhub (sm90 and sm80 variants) vs torch eager, torch.compile and Liger.

`ours` is the variant the device's capability selects (sm90 on an H200); `ours_sm80` forces the
other one. Compiled configurations (`torch.compile(fullgraph=True)`, static shapes): `compile` (the
eager expression, default mode) and `compile[reduce-overhead]` (CUDA graphs), `liger[compiled]`,
`liger[reduce-overhead]`, `ours[compiled]`, `ours[reduce-overhead]` (kernelhub's custom ops traced).
Compiled code is reset per shape (each shape compiles once per pass and layout, and no shape pays
guard checks of another's); under reduce-overhead every call first marks a CUDA-graph step and the
`graph` timing is not taken (a CUDA graph cannot be captured inside another). Rows carry `base`
(implementation) and `config` (eager, compiled, reduce-overhead). Each (shape, pass, implementation)
is timed two ways:
  eager  N back-to-back calls as a user makes them (host overhead included), CUDA events around
         the loop; `host_us` is the CPU time to issue one call (perf_counter, before the sync).
  graph  the same calls captured in a CUDA graph and replayed: the kernels alone.
Bandwidth is reported as a fraction of the device-to-device copy bandwidth measured in the same
run; minimum bytes: forward 3 tensors (read gate, up; write out), forward+backward 8 (+ read dy,
gate, up; write d gate, d up). A tiny shape (1 x 128) measures pure host overhead per call.

Usage (from the repository root, on the GPU machine):
  PYTHONPATH=src python kernels_repo/swiglu/benchmarks/bench_swiglu.py
Env: OUT (JSON lines go to $OUT/swiglu_bench.jsonl, default /tmp), SHAPES="8192x14336,..." to
narrow, IMPLS="ours,liger,..." to narrow (full names: "ours[reduce-overhead]"), COMPILE=default,
reduce-overhead (the compiled configurations of liger and ours, and compile[reduce-overhead]; none:
only the eager ones and `compile`), ROUNDS (default 5: interleaved rounds of the per-eager-call timing
at the host-bound shapes, see `interleaved_eager`). Liger-Kernel is optional (import guarded).
DEVICE=cpu: smoke test without a GPU, same code path: tiny shapes (default SHAPES=64x256,8x128),
wall-clock timing, few repetitions, no graph timing, no `ours_sm80`.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch._dynamo
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
OUT = os.environ.get("OUT", "/tmp")
_log = None  # $OUT/swiglu_bench.jsonl, opened on the first row (importers of time_eager write none)
SHAPES = [(8192, 14336), (32768, 4096), (4096, 6144), (64, 14336)]
HOST_SHAPE = (1, 128)
DEV = torch.device(os.environ.get("DEVICE", "cuda:0"))
CUDA = DEV.type == "cuda"


def reps(n: int) -> int:
    """n timed calls on a GPU; a few on the CPU (smoke test: the code path, not the numbers)."""
    return n if CUDA else max(3, n // 200)


def config_of(name: str) -> tuple[str, str]:
    """(implementation, configuration) of an implementation's name."""
    if name == "compile":
        return "eager", "compiled"
    if name.endswith("]"):
        base, config = name[:-1].split("[")
        return ("eager" if base == "compile" else base), config
    return name, "eager"


def emit(**row) -> None:
    global _log
    if _log is None:
        _log = open(os.path.join(OUT, "swiglu_bench.jsonl"), "a")
    _log.write(json.dumps(row) + "\n")
    _log.flush()
    line = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
    print(line, flush=True)


def implementations() -> tuple[dict, object]:
    sys.path.insert(0, str(REPO.parents[1] / "src"))
    from kernelhub._bench_compile import compile_configs, compiled, raise_recompile_limit
    from kernelhub.hub import get_local_kernel

    k = get_local_kernel(REPO)
    # one compile per shape and grad mode must not exhaust dynamo's recompile limit (eager fallback)
    raise_recompile_limit()
    configs = compile_configs("bench_swiglu.py")

    # one function per configuration: each its own code object, so its own compiled cache (guards of
    # one configuration's graphs are not checked on the calls of another)
    def ours(g, u):
        return k.swiglu(g, u)

    def ours_compiled(g, u):
        return k.swiglu(g, u)

    def ours_graphed(g, u):
        return k.swiglu(g, u)

    def torch_swiglu(g, u):
        return F.silu(g) * u

    def torch_compiled(g, u):
        return F.silu(g) * u

    def torch_graphed(g, u):
        return F.silu(g) * u

    impls = {"ours": ours, "ours_sm80": lambda g, u: k.swiglu(g, u, impl="sm80"), "eager": torch_swiglu,
             "compile": compiled(torch_compiled, "compiled")}
    if not CUDA:
        del impls["ours_sm80"]  # (a Triton variant forced onto CPU tensors)
    compiled_twins = {"ours": (ours_compiled, ours_graphed), "compile": (None, torch_graphed)}
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        def liger_compiled(g, u):
            return LigerSiLUMulFunction.apply(g, u)

        def liger_graphed(g, u):
            return LigerSiLUMulFunction.apply(g, u)

        impls["liger"] = LigerSiLUMulFunction.apply
        compiled_twins["liger"] = (liger_compiled, liger_graphed)
    except Exception as e:  # noqa: BLE001
        print("liger unavailable:", type(e).__name__, e, flush=True)
    for config in configs:
        for name, twins in compiled_twins.items():
            fn = twins[0] if config == "compiled" else twins[1]
            if fn is not None:  # (`compile` itself is torch's expression compiled in the default mode)
                impls[f"{name}[{config}]"] = compiled(fn, config)
    only = os.environ.get("IMPLS")
    if only:
        impls = {n: f for n, f in impls.items() if n in only.split(",")}
    return impls, k


def call_fn(fn, g, u, dy, backward: bool):
    if not backward:
        return lambda: fn(g, u)
    # autograd.grad, not .backward(): no accumulation into .grad between calls
    return lambda: torch.autograd.grad(fn(g, u), (g, u), dy)


def time_eager(call, n: int) -> tuple[float, float]:
    """(GPU-inclusive ms per call, host us per call) over n back-to-back calls."""
    for _ in range(3):
        call()
    if not CUDA:  # smoke test: wall clock
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        host = (time.perf_counter() - t0) / n * 1e6
        return host / 1e3, host
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    host = (time.perf_counter() - t0) / n * 1e6
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n, host


def time_graph(call, per_graph: int, replays: int) -> float | None:
    """ms per call: `per_graph` calls captured once, the graph replayed `replays` times (None without
    CUDA)."""
    if not CUDA:
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graph asks
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) / (replays * per_graph)


def copy_bandwidth() -> float:
    # As ../shared/bench/peers.py measures it: 1 GiB copied by torch's copy kernel, do_bench median.
    # (A graph-captured copy_ becomes a memcpy node, which measured only ~2.7 TB/s on the H200.)
    a = torch.randn(1 << 29 if CUDA else 1 << 20, device=DEV, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    if CUDA:
        from triton.testing import do_bench

        ms = do_bench(lambda: b.copy_(a), warmup=25, rep=100, return_mode="median")
    else:
        ms = time_eager(lambda: b.copy_(a), 5)[0]
    bw = 2 * a.numel() * a.element_size() / (ms * 1e-3)
    emit(kind="ceiling", what="d2d_copy_GBps", value=bw / 1e9)
    return bw


def frac_copy(nbytes: int, ms: float | None, copy_bw: float) -> float | None:
    return None if ms is None else nbytes / (ms * 1e-3) / copy_bw


def us(ms: float | None) -> float | None:
    return None if ms is None else ms * 1e3


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def check(name, fn, T, I) -> dict:
    """Relative errors of forward and both gradients vs fp32 torch (fresh inputs)."""
    g = torch.randn(T, I, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    u = torch.randn(T, I, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, I, device=DEV, dtype=torch.bfloat16)
    gf, uf = g.detach().float().requires_grad_(), u.detach().float().requires_grad_()
    ref = F.silu(gf) * uf
    rdg, rdu = torch.autograd.grad(ref, (gf, uf), dy.float())
    ref = ref.detach()
    g0, u0 = g.detach().clone(), u.detach().clone()  # Liger's backward writes into its inputs
    y = fn(g, u)
    dg, du = torch.autograd.grad(y, (g, u), dy)
    out = {"err_fwd": relerr(y, ref), "err_dg": relerr(dg, rdg), "err_du": relerr(du, rdu)}
    if name.startswith("ours"):
        out["inputs_intact"] = bool(torch.equal(g.detach(), g0) and torch.equal(u.detach(), u0))
    return out


@torch.no_grad()
def bench_packed(kernel, T: int, I: int, copy_bw: float, host_only: bool = False) -> None:
    """The packed entry point (gate | up halves of one [T, 2I] tensor), forward only."""
    x = torch.randn(T, 2 * I, device=DEV, dtype=torch.bfloat16)

    def call():
        return kernel.swiglu_packed(x)

    if host_only:
        ms, host = time_eager(call, reps(2000))
        emit(kind="host_overhead", impl="ours_packed", pass_="fwd", T=T, I=I, us_per_call=ms * 1e3,
             host_us=host)
        return
    nbytes = 3 * T * I * 2
    n = reps(max(50, min(2000, int(2e10 / nbytes))))
    eager_ms, host = time_eager(call, n)
    graph_ms = time_graph(call, 5, max(10, n // 5))
    emit(kind="swiglu", impl="ours_packed", pass_="fwd", T=T, I=I, eager_us=eager_ms * 1e3,
         graph_us=us(graph_ms), host_us=host, frac_copy_eager=frac_copy(nbytes, eager_ms, copy_bw),
         frac_copy_graph=frac_copy(nbytes, graph_ms, copy_bw), base="ours", config="eager")


def interleaved_eager(impls: dict, shapes, rounds: int, copy_bw: float) -> None:
    """Per eager call at host-bound shapes, every implementation once per round, rounds interleaved.

    Why: at these shapes a call costs what the host takes to issue it, and the host's speed drifts
    by 10-20% within one run (the same kernels as `ours` and `ours_sm80` once read 255 and 210 us
    at 64x14336 forward+backward, timed one after the other); measured in turn,
    each implementation would get a different host. The median over the rounds is emitted as
    kind=swiglu_interleaved (eager only: under graph replay the host does not matter). Each shape
    twice: [T, I] and [1, T, I], the layout a model's MLP passes (leading dims take another path).
    Compiled code is reset per shape and layout: each compiles its own static graphs.
    """
    for (T, I), lead in itertools.product(shapes, ((), (1,))):
        torch.compiler.reset()
        # lead (1,): [1, T, I], the layout a model's MLP hands over (batch, sequence, features)
        g = torch.randn(*lead, T, I, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        u = torch.randn(*lead, T, I, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(*lead, T, I, device=DEV, dtype=torch.bfloat16)
        for backward, tensors in ((False, 3), (True, 8)):
            gg, uu = (g, u) if backward else (g.detach(), u.detach())
            calls = {name: call_fn(fn, gg, uu, dy, backward) for name, fn in impls.items()}
            times: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(rounds):
                for name, call in calls.items():
                    if name not in times:
                        continue
                    try:
                        times[name].append(time_eager(call, reps(300))[0])
                    except Exception as e:  # noqa: BLE001 - dropped from this shape; the others go on
                        error(name, T, I, e)
                        del times[name]
            for name, ms in times.items():
                median = sorted(ms)[len(ms) // 2]
                emit(kind="swiglu_interleaved", impl=name, pass_="fwdbwd" if backward else "fwd", T=T, I=I,
                     shape=list(g.shape), rounds=rounds, eager_us=median * 1e3, eager_us_min=min(ms) * 1e3,
                     eager_us_max=max(ms) * 1e3, frac_copy_eager=tensors * T * I * 2 / (median * 1e-3) / copy_bw,
                     **dict(zip(("base", "config"), config_of(name))))
        del g, u, dy


def error(name: str, T: int, I: int, e: Exception) -> None:
    emit(kind="error", impl=name, T=T, I=I, error=f"{type(e).__name__}: {str(e)[:300]}")


def host_overhead(impls: dict) -> None:
    """Pure host overhead per call: a tiny problem, where the GPU finishes each kernel before the
    next call. A failing implementation is an error row; the others are still timed."""
    T, I = HOST_SHAPE
    g = torch.randn(T, I, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    u = torch.randn(T, I, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, I, device=DEV, dtype=torch.bfloat16)
    for name, fn in impls.items():
        try:
            for backward in (False, True):
                gg, uu = (g, u) if backward else (g.detach(), u.detach())
                ms, host = time_eager(call_fn(fn, gg, uu, dy, backward), reps(2000))
                emit(kind="host_overhead", impl=name, pass_="fwdbwd" if backward else "fwd", T=T, I=I,
                     us_per_call=ms * 1e3, host_us=host, **dict(zip(("base", "config"), config_of(name))))
        except Exception as e:  # noqa: BLE001 - a peer that cannot run here must not end the run
            error(name, T, I, e)


def main() -> None:
    import triton

    print("torch", torch.__version__, "triton", triton.__version__,
          torch.cuda.get_device_name(DEV) if CUDA else "cpu", torch.cuda.get_device_capability(DEV) if CUDA else "",
          flush=True)
    t_start = time.time()
    impls, kernel = implementations()
    if CUDA:
        torch.cuda.set_device(DEV)
    probe = torch.empty(1, 8, device=DEV, dtype=torch.bfloat16)
    resolved = kernel._dispatch._resolve("bench", probe, None)  # (None on the CPU: the reference)
    print("ours resolves to", resolved[0] if resolved else "reference", flush=True)
    copy_bw = copy_bandwidth()
    shapes = SHAPES if CUDA else [(64, 256), (8, 128)]
    if os.environ.get("SHAPES"):
        shapes = [tuple(int(v) for v in s.split("x")) for s in os.environ["SHAPES"].split(",")]

    host_overhead(impls)
    bench_packed(kernel, *HOST_SHAPE, copy_bw, host_only=True)

    for T, I in shapes:
        n = T * I
        torch.compiler.reset()  # compiled code of the earlier shapes: no guard checks across shapes
        for name, fn in impls.items():
            try:
                errs = check(name, fn, T, I)
                # Fresh segments for the timed buffers. Placement moves the two-input forward at the
                # large shapes by ~7% for every implementation (H200): with check()'s fragments
                # reused, 1.01 of copy eager / 0.93-0.96 under graph; after this line 0.93 / 1.03.
                torch.cuda.empty_cache()
                g = torch.randn(T, I, device=DEV, dtype=torch.bfloat16, requires_grad=True)
                u = torch.randn(T, I, device=DEV, dtype=torch.bfloat16, requires_grad=True)
                dy = torch.randn(T, I, device=DEV, dtype=torch.bfloat16)
                for backward, tensors in ((False, 3), (True, 8)):
                    gg, uu = (g, u) if backward else (g.detach(), u.detach())
                    call = call_fn(fn, gg, uu, dy, backward)
                    # >= ~5 ms of work per measurement (25 calls at 4096x6144 read 1-3% noisy)
                    calls = reps(max(50, min(2000, int(2e10 / (tensors * n * 2)))))
                    eager_ms, host = time_eager(call, calls)
                    base, config = config_of(name)
                    # (reduce-overhead replays its own CUDA graphs: none is captured around them)
                    graph_ms = None if config == "reduce-overhead" else time_graph(call, 5, max(10, calls // 5))
                    nbytes = tensors * n * 2
                    emit(kind="swiglu", impl=name, pass_="fwdbwd" if backward else "fwd", T=T, I=I,
                         eager_us=eager_ms * 1e3, graph_us=us(graph_ms), host_us=host,
                         frac_copy_eager=frac_copy(nbytes, eager_ms, copy_bw),
                         frac_copy_graph=frac_copy(nbytes, graph_ms, copy_bw), base=base, config=config, **errs)
                del g, u, dy
            except Exception as e:  # noqa: BLE001
                error(name, T, I, e)
            torch.cuda.empty_cache()
        bench_packed(kernel, T, I, copy_bw)
        torch.cuda.empty_cache()
        print(f"-- {T}x{I} done at {time.time() - t_start:.0f}s", flush=True)

    # host-bound shapes (<= 64 MB per tensor): per eager call again, implementations interleaved
    host_bound = [(T, I) for T, I in shapes if T * I <= 2**25] + [HOST_SHAPE]
    interleaved_eager(impls, host_bound, int(os.environ.get("ROUNDS", 5)), copy_bw)
    print(f"-- interleaved done at {time.time() - t_start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
