"""Benchmark fused_experts against its peers on one GPU, in one run.

Peers: transformers experts `eager`, `grouped_mm`, `batched_mm` and Liger-Kernel's fused MoE (when
importable), each as a user calls it (eager) and compiled: `torch.compile(fullgraph=True)` in the
default mode (`[compiled]`) and with CUDA graphs (`[reduce-overhead]`). kernelhub likewise: its eager
call, the kernelized module compiled both ways, and at decode a replayed CUDA graph (`kernelhub_graph`).
Shapes Qwen3-30B-A3B, Mixtral 8x7B, DeepSeek-V3; T in 1, 32, 512, 4096, 16384; forward (no_grad) and
forward+backward. The best peer of a point is the fastest of all peer configurations, named with its
configuration (`hf_grouped_mm[reduce-overhead]`). Floor = max(FLOPs / measured bf16 matmul rate,
touched-weight bytes / measured copy rate), with touched experts = distinct ids in topk_idx; for
forward+backward, max(3 x those FLOPs / the rate, bytes / the copy rate) with bytes = the touched weights
read twice (forward, dx) plus the weight gradients of all E experts written (a parameter's gradient is
dense: zeros for an expert no token reached, which dominates at small T) plus x, dy, dx and out. Also
prints peak memory of forward+backward (and the allocator retries of its timed loop, `alloc_retries`)
and the tile config chosen, so `tune_moe.py` knows where to look.

Compiled configurations are compiled once per (implementation, shape, T, pass) with static shapes,
after `torch.compiler.reset()` (so no configuration pays guard checks of another's cache entries); the
first calls (compile, CUDA-graph warm-up and recording) are timed apart as `compile_s` and excluded.
Under `reduce-overhead` every call is preceded by `torch.compiler.cudagraph_mark_step_begin()`.
Run order: every T's core (all eager configurations, then kernelhub and hf_grouped_mm compiled), then
every T's extras (the other compiled configurations): a run cut short by a timeout keeps the main
comparison at every T.

Usage (repo root): PYTHONPATH=src python kernels_repo/moe/benchmarks/bench_moe.py
  env: SHAPES=qwen3_30b_a3b,mixtral_8x7b,deepseek_v3  TOKENS=1,32,512,4096,16384
       IMPLS=kernelhub,hf_grouped_mm,...: a base name selects all its configurations, a full name
         (hf_grouped_mm[reduce-overhead]) one; kernelhub_compiled means kernelhub[compiled]
       COMPILE=default,reduce-overhead: the compiled configurations (none: eager only)
       COMPILE_IMPLS=kernelhub,hf_grouped_mm,hf_batched_mm,liger: which get them (hf_eager compiles a
         loop over the experts with data-dependent shapes: only when named here)
       KH_COMPILED=kernelize|function: kernelhub compiled as a kernelized experts module
         (Mode.INFERENCE / Mode.TRAINING | Mode.TORCH_COMPILE; the default) or fused_experts under
         torch.compile (always with MOE_DIR, which kernelize would not load)
       MODES=fwd,fwdbwd  STAGES=1 (per-stage kernelhub times; 0: off)
       ORDER=compiled-first: each point's compiled configurations before the eager ones (default
         eager first), so that two runs in opposite orders tell a compiled/eager gap from the
         card's drift (clocks, power) across one point's minutes
       OUT=/tmp (appends $OUT/bench_moe.jsonl)  MOE_DIR=DIR (the kernel repository to time; default ours)
       SKEW=s: skewed routing, as a trained router's hot experts: expert logits get a bias of
         -s * log(1 + rank) over a random ranking of the experts (0, the default: uniform); rows
         then carry skew=s and the "--" line the hottest expert's load over the mean
       DEVICE=cpu: smoke test without a GPU, same code path (default SHAPES=tiny, TOKENS=1,8; CPU
         wall-clock timing instead of do_bench; no CUDA graphs, stages or peak memory)
  Rows: impl (full name), base (implementation), config (eager, compiled, reduce-overhead, graph),
  compile_s (first calls, excluded from ms), recompiles (graphs compiled while timing; should be 0).
  Liger-Kernel autotunes its MoE kernels on first use of a shape, for minutes at Mixtral and
  DeepSeek-V3 sizes: give such a run a long timeout, or keep the tuning between runs
  (benchmarks/README.md).
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._dynamo

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "src"))
from kernelhub._bench_compile import compile_configs, compiled, raise_recompile_limit  # noqa: E402
from kernelhub._loader import load_kernel_from_dir  # noqa: E402

# MOE_DIR: another copy of the kernel repository (an older commit, say), for an A/B in one call
MOE_DIR = os.environ.get("MOE_DIR")
moe = load_kernel_from_dir(Path(MOE_DIR or ROOT / "kernels_repo" / "moe"))
DEV = torch.device(os.environ.get("DEVICE", "cuda"))
CUDA = DEV.type == "cuda"
OUT = os.environ.get("OUT", "/tmp")
LOG = open(os.path.join(OUT, "bench_moe.jsonl"), "a")
SHAPES = {
    "qwen3_30b_a3b": dict(E=128, H=2048, I=768, K=8),
    "mixtral_8x7b": dict(E=8, H=4096, I=14336, K=2),
    "deepseek_v3": dict(E=256, H=7168, I=2048, K=8),
    "tiny": dict(E=8, H=64, I=32, K=2),  # the CPU smoke test's; never run unless named (or DEVICE=cpu)
}
# transformers' experts dispatch calls lru_cache'd version checks, which dynamo warns about on every compile
warnings.filterwarnings("ignore", message=".*functools.lru_cache.*", category=UserWarning)
ROWS: list[dict] = []  # this run's rows, for the closing table


def emit(**row) -> None:
    if SKEW and row.get("kind", "").startswith("moe_"):
        row["skew"] = SKEW
    ROWS.append(row)
    LOG.write(json.dumps(row) + "\n")
    LOG.flush()
    text = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
    print(text, flush=True)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


MIN_SAMPLES = 10  # timed calls per median at least


def bench(fn, grad_to_none=None) -> float:
    """Median ms of fn: do_bench on a GPU; on the CPU (smoke test) a few wall-clock calls.

    On the GPU: `grad_to_none` is cleared before every call, do_bench's estimate and warm-up calls
    included (it clears only before the timed ones, so those accumulated into the previous call's
    gradients: 22.5 GB of weight gradients read and written again per call at DeepSeek-V3), and
    do_bench's time budget covers at least MIN_SAMPLES calls (its 100 ms gave a 70 ms call one
    sample)."""
    if CUDA:
        from triton.testing import do_bench

        timed = fn
        if grad_to_none:
            def timed():
                for p in grad_to_none:
                    p.grad = None
                fn()
        timed()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        timed()
        end.record()
        torch.cuda.synchronize()
        rep = max(100.0, MIN_SAMPLES * start.elapsed_time(end))
        return do_bench(timed, warmup=25, rep=rep, return_mode="median")
    times = []
    for _ in range(5):
        for p in grad_to_none or ():
            p.grad = None
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def ceilings() -> tuple[float, float]:
    n, m = (1 << 29, 8192) if CUDA else (1 << 20, 256)
    src = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() * 2 / (bench(lambda: dst.copy_(src)) * 1e-3)
    lhs = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    rhs = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    mm = 2 * m**3 / (bench(lambda: lhs @ rhs) * 1e-3)
    emit(kind="ceiling", copy_GBps=copy_bw / 1e9, bf16_mm_TFLOPs=mm / 1e12)
    return copy_bw, mm


def hf_experts(E, H, I, K):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = "grouped_mm"
    with torch.device("meta"):  # bf16 storage straight on the device (no fp32 copy on the host)
        mod = Qwen3MoeExperts(cfg).to(torch.bfloat16)
    mod = mod.to_empty(device=DEV)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.02)
    return mod


def experts_view(base, impl: str):
    """Another experts module of base's class on base's weights (shared, not copied) with its own
    config, so each configuration is its own module (own compiled code, own kernelize binding)."""
    cfg = copy.copy(base.config)
    with torch.device("meta"):
        mod = type(base)(cfg)
    mod.gate_up_proj = base.gate_up_proj
    mod.down_proj = base.down_proj
    mod.config._experts_implementation = impl
    return mod


SKEW = float(os.environ.get("SKEW", "0"))


def routing(T, E, K):
    logits = torch.randn(T, E, device=DEV, dtype=torch.float32)
    if SKEW:
        rank = torch.randperm(E, device=DEV).to(torch.float32)
        logits = logits - SKEW * torch.log1p(rank)
    w, idx = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    return idx, (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)


def graphed(fn, base, T, H):
    x_static = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn(x_static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(x_static)

    def run(xx):
        x_static.copy_(xx)
        graph.replay()
        return out

    return run


@dataclass
class Impl:
    """One configuration to time: `fwd` / `fwdbwd` map x to the output (None: pass not run)."""

    name: str  # e.g. hf_grouped_mm[reduce-overhead]
    base: str  # e.g. hf_grouped_mm
    config: str  # eager, compiled, reduce-overhead, graph
    fwd: Callable | None
    fwdbwd: Callable | None


def kernelhub_compiled(base, idx, w, config: str) -> tuple[Callable, Callable]:
    """(forward, forward+backward) of kernelhub under torch.compile in `config`."""
    if MOE_DIR or os.environ.get("KH_COMPILED", "kernelize") == "function":
        def kh(xx):
            return moe.fused_experts(xx, base.gate_up_proj, base.down_proj, idx, w)

        fn = compiled(kh, config)
        return fn, fn
    from kernelhub import Mode, kernelize, kernelize_report

    fns = []
    for mode in (Mode.INFERENCE | Mode.TORCH_COMPILE, Mode.TRAINING | Mode.TORCH_COMPILE):
        mod = experts_view(base, "grouped_mm")
        kernelize(mod, mode=mode)
        entry = kernelize_report(mod).entries[0]
        if entry.fallback_reason is not None:
            raise RuntimeError(f"kernelize({mode}) left the experts eager: {entry.fallback_reason}")
        cm = compiled(mod, config)
        fns.append(lambda xx, cm=cm: cm(xx, idx, w))
    return fns[0], fns[1]


CORE = ("kernelhub", "hf_grouped_mm")  # implementations whose compiled configurations run first


def impls_for(base, T, E, H, I, K, idx, w, wanted, configs, compiled_bases, phase: str = "core") -> list[Impl]:
    """Every configuration that applies at this size, is selected and belongs to `phase` (built
    lazily: only those). "core": every eager configuration and the compiled ones of CORE; "extra":
    the other compiled ones (run after every T's core, so a run cut short has the main comparison)."""
    out: list[Impl] = []

    def selected(name: str, base_name: str, config: str) -> bool:
        core = config in ("eager", "graph") or base_name in CORE
        if core != (phase == "core"):
            return False
        return not wanted or name in wanted or base_name in wanted

    def add(base_name: str, config: str, build: Callable[[], tuple[Callable, Callable | None]]) -> None:
        name = base_name if config == "eager" else f"{base_name}[{config}]"
        if config == "graph":  # (selected by its own name only, as before configurations had names)
            name = base_name + "_graph"
        if not selected(name, name if config == "graph" else base_name, config):
            return
        try:
            fwd, fwdbwd = build()
        except Exception as e:  # noqa: BLE001
            emit(kind="moe_error", impl=name, T=T, error=f"{type(e).__name__}: {str(e)[:300]}")
            return
        out.append(Impl(name, base_name, config, fwd, fwdbwd))

    def kh(xx):
        # check_indices=False: what the layer / kernelize path calls (no host sync per call).
        return moe.fused_experts(xx, base.gate_up_proj, base.down_proj, idx, w, check_indices=False)

    add("kernelhub", "eager", lambda: (kh, kh))
    for config in configs if "kernelhub" in compiled_bases else ():
        add("kernelhub", config, lambda config=config: kernelhub_compiled(base, idx, w, config))
    if T <= 64 and CUDA:
        # Decode is launch-bound in eager mode; the replayed CUDA graph shows the GPU-side time
        # (how serving engines run decode). Forward only.
        add("kernelhub", "graph", lambda: (graphed(kh, base, T, H), None))
    for impl in ("eager", "grouped_mm", "batched_mm"):
        if impl == "batched_mm" and T * K * H * I > 2**33:
            continue
        if impl == "eager" and T >= 16384 and E >= 128:
            continue
        mod = experts_view(base, impl)

        def hf(xx, mod=mod):
            return mod(xx, idx, w)

        add("hf_" + impl, "eager", lambda hf=hf: (hf, hf))
        for config in configs if "hf_" + impl in compiled_bases else ():
            def build(impl=impl, config=config):
                cm = compiled(experts_view(base, impl), config)
                fn = lambda xx: cm(xx, idx, w)  # noqa: E731
                return fn, fn

            add("hf_" + impl, config, build)
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except Exception as e:  # noqa: BLE001
        if T == 1 and phase == "core":
            print("liger unavailable:", e)
    else:
        idx32 = idx.to(torch.int32)

        def liger(xx):
            return LigerFusedMoEFunction.apply(xx, base.gate_up_proj, base.down_proj, idx32, w)

        add("liger", "eager", lambda: (liger, liger))
        for config in configs if "liger" in compiled_bases else ():
            add("liger", config, lambda config=config: (compiled(liger, config),) * 2)
    # eager configurations first (no compile), then each compiled mode with kernelhub next to its
    # closest peers: a point cut short by a timeout still holds comparable pairs
    config_rank = {"eager": 0, "graph": 1, "compiled": 2, "reduce-overhead": 3}
    if os.environ.get("ORDER") == "compiled-first":
        config_rank = {c: -r for c, r in config_rank.items()}
    base_rank = {"kernelhub": 0, "hf_grouped_mm": 1, "liger": 2, "hf_batched_mm": 3, "hf_eager": 4}
    return sorted(out, key=lambda i: (config_rank[i.config], base_rank.get(i.base, 5)))


def stage_breakdown(base, x, idx, w, dy, sname, T, variant) -> None:
    """Per-stage times of kernelhub with the bucket it picks: where a retune would pay."""
    launch = sys.modules[moe.__name__ + "._experts_launch"]
    pipeline = sys.modules[moe.__name__ + "._experts_pipeline"]
    rt = sys.modules[moe.__name__ + "._experts_routing"]
    gu, dn = base.gate_up_proj.detach(), base.down_proj.detach()
    E, two_i, H = gu.shape
    inter, K = two_i // 2, idx.shape[1]
    cfg = pipeline.bucket(variant, E, H, inter, idx.numel(), None, DEV, x.element_size())
    r = rt.align_rows(idx, E, cfg["block_m"])
    P = r.num_rows
    tma = pipeline.use_tma(variant, cfg, gu, dn)
    pair = bool(cfg.get("pair_m", False))  # as the pipeline's forward / backward run the GEMMs
    rows = bool(cfg["gate_up"].get("ROWS", False))
    h = torch.empty(P, inter, device=DEV, dtype=x.dtype)
    aux = torch.empty(P, two_i, device=DEV, dtype=x.dtype)
    y = torch.empty(P, H, device=DEV, dtype=x.dtype)
    out = torch.empty_like(x)
    wf = w.reshape(-1).contiguous()
    dws = torch.zeros(wf.shape[0], device=DEV, dtype=torch.float32)
    hw = torch.zeros(P, inter, device=DEV, dtype=x.dtype)  # TMA boxes also read padding rows
    dgu = torch.zeros(P, two_i, device=DEV, dtype=x.dtype)
    dwd = torch.empty_like(dn)
    dwgu = torch.empty_like(gu)
    stages = {
        "align": lambda: rt.align_rows(idx, E, cfg["block_m"]),
        # (gate_up "ROWS": timed with its row copy of x, as the pipeline's forward runs it)
        "gate_up": lambda: launch.gemm(launch.gather_rows(x, r, K) if rows else x, gu, h, r, cfg["gate_up"], n=inter,
                                    k=H, epilogue=1, gather_a=not rows, b_ncontig=False, topk=K, use_tma=tma,
                                    aux=aux, save_aux=True, pair=pair),
        "down": lambda: launch.gemm(h, dn, y, r, cfg["down"], n=H, k=inter, epilogue=0, gather_a=False,
                                 b_ncontig=False, topk=K, use_tma=tma, pair=pair),
        "combine": lambda: launch.combine(y, r.token_topk_to_pos, w, out),
        "dgrad": lambda: launch.gemm(dy, dn, dgu, r, cfg["dgrad"], n=inter, k=H, epilogue=2, gather_a=True,
                                  b_ncontig=True, topk=K, use_tma=tma, aux=aux, scale=wf, dscale=dws, h=hw,
                                  pair=pair),
        "dx": lambda: launch.gemm(dgu, gu, y, r, cfg["down"], n=H, k=two_i, epilogue=0, gather_a=False,
                               b_ncontig=True, topk=K, use_tma=tma, pair=pair),
    }
    wc = cfg["wgrad"]  # as the pipeline's backward runs them (ROWS copies included when the bucket sets it)
    stages["wgrad_down"] = lambda: launch.wgrad_token_operand(dy, hw, dwd, r, wc, src_is_a=True, topk=K, use_tma=tma)
    stages["wgrad_gate_up"] = lambda: launch.wgrad_token_operand(x, dgu, dwgu, r, wc, src_is_a=False, topk=K,
                                                              use_tma=tma)
    times = {k: bench(v) for k, v in stages.items()}
    emit(kind="moe_stages", shape=sname, T=T, P=P, block_m=cfg["block_m"], pair_m=pair, tma=tma,
         **{f"{k}_ms": v for k, v in times.items()})


def unique_graphs() -> int:
    """Graphs dynamo has compiled so far in this process (a count that grows on every recompile)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001
        return 0


def fields(impl: Impl) -> dict:
    return dict(impl=impl.name, base=impl.base, config=impl.config)


def measure(impl: Impl, x, dy, ref, base, modes, sname, T, flops, floors) -> None:
    floor_ms, floor_fb_ms = floors
    warm = 1 if impl.config == "eager" else 3  # compile; CUDA-graph trees: warm-up run, record, replay
    if "fwd" in modes and impl.fwd is not None:
        fn = impl.fwd
        if impl.config in ("compiled", "reduce-overhead"):
            torch.compiler.reset()
        with torch.no_grad():
            t0 = time.perf_counter()
            for _ in range(warm):
                y = fn(x)
            err = ((y.float() - ref).norm() / ref.norm()).item()  # (read before the next replay)
            sync()
            compile_s = time.perf_counter() - t0
            graphs = unique_graphs()
            ms = bench(lambda: fn(x))
        emit(kind="moe_fwd", shape=sname, T=T, ms=ms, TFLOPs=flops / (ms * 1e-3) / 1e12, floor_ms=floor_ms,
             frac_floor=floor_ms / ms, relerr=err, compile_s=compile_s, recompiles=unique_graphs() - graphs,
             **fields(impl))
    if "fwdbwd" in modes and impl.fwdbwd is not None:
        fn = impl.fwdbwd
        if impl.config in ("compiled", "reduce-overhead"):
            torch.compiler.reset()
        xx = x.clone().requires_grad_()
        params = [xx, base.gate_up_proj, base.down_proj]

        def fb():
            fn(xx).backward(dy)

        def clear():
            for p in params:
                p.grad = None

        t0 = time.perf_counter()
        for _ in range(warm):
            clear()
            fb()
        sync()
        compile_s = time.perf_counter() - t0
        clear()
        graphs = unique_graphs()
        retries = alloc_retries()
        ms = bench(fb, grad_to_none=params)
        recompiles = unique_graphs() - graphs
        retries = None if retries is None else alloc_retries() - retries
        clear()
        peak = None
        if CUDA:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            fb()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - before) / 2**20
            clear()
        emit(kind="moe_fwdbwd", shape=sname, T=T, ms=ms, TFLOPs=3 * flops / (ms * 1e-3) / 1e12,
             floor_ms=floor_fb_ms, frac_floor=floor_fb_ms / ms, peak_extra_MiB=peak, compile_s=compile_s,
             recompiles=recompiles, alloc_retries=retries, **fields(impl))


def alloc_retries() -> int | None:
    """The caching allocator's retries so far (a failed allocation that freed its cached blocks, with a
    device sync, and tried again): a timed loop that adds some ran near the card's memory."""
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if CUDA else None


def point(base, sname, T, E, H, I, K, copy_bw, mm, variant, cfgs, wanted) -> tuple:
    """Inputs, reference and floor of one (shape, T); prints its routing and tile line and times
    kernelhub's stages."""
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    idx, w = routing(T, E, K)
    dy = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    touched = int(torch.unique(idx).numel())
    flops = 6 * T * K * H * I
    weight_bytes = 3 * H * I * 2
    floor_ms = max(flops / mm, (touched * weight_bytes + 2 * T * H * 2) / copy_bw) * 1e3
    floor_fb_ms = max(3 * flops / mm, ((2 * touched + E) * weight_bytes + 4 * T * H * 2) / copy_bw) * 1e3
    load = torch.bincount(idx.reshape(-1), minlength=E).float()
    tiles = ""
    if CUDA:
        bucket = cfgs.pick_config(90 if variant == "sm90" else 80, E, H, I, T * K)
        tiles = f" block_m={bucket['block_m']} gate_up={bucket['gate_up']} down={bucket['down']}"
    print(f"-- {sname} T={T} touched={touched} hottest/mean={float(load.max() / load.mean()):.2f} "
          f"variant={variant}{tiles}", flush=True)
    with torch.no_grad():
        ref = moe.fused_experts_reference(x, base.gate_up_proj, base.down_proj, idx, w).float()
    if CUDA and os.environ.get("STAGES", "1") == "1" and (not wanted or "kernelhub" in wanted):
        try:
            stage_breakdown(base, x, idx, w, dy, sname, T, variant)
        except Exception as e:  # noqa: BLE001
            emit(kind="moe_error", shape=sname, impl="kernelhub_stages", T=T,
                 error=f"{type(e).__name__}: {str(e)[:300]}")
    return x, idx, w, dy, ref, flops, (floor_ms, floor_fb_ms)


def env_list(name: str, default: str) -> list[str]:
    return [s for s in os.environ.get(name, default).split(",") if s]


def main() -> None:
    import transformers
    import triton

    print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__,
          torch.cuda.get_device_name(DEV) if CUDA else "cpu", torch.cuda.get_device_capability(DEV) if CUDA else "",
          flush=True)
    # every (configuration, pass) compiles after a reset; the limits only guard against surprises
    raise_recompile_limit()
    copy_bw, mm = ceilings()
    only = env_list("SHAPES", "" if CUDA else "tiny")
    tokens = [int(t) for t in env_list("TOKENS", "1,32,512,4096,16384" if CUDA else "1,8")]
    wanted = ["kernelhub[compiled]" if s == "kernelhub_compiled" else s for s in env_list("IMPLS", "")]
    modes = env_list("MODES", "fwd,fwdbwd")
    configs = compile_configs("bench_moe.py")
    compiled_bases = env_list("COMPILE_IMPLS", "kernelhub,hf_grouped_mm,hf_batched_mm,liger")
    variant = moe.select_variant(DEV)
    cfgs = __import__(moe.__name__ + "._experts_configs", fromlist=["pick_config"])
    for sname, s in SHAPES.items():
        if (only and sname not in only) or (not only and sname == "tiny"):
            continue
        E, H, I, K = s["E"], s["H"], s["I"], s["K"]
        base = hf_experts(E, H, I, K)
        points = {}  # T -> the point's inputs, kept for the second phase
        for phase in ("core", "extra"):  # every T's core configurations before any T's extras
            for T in tokens:
                t0 = time.time()
                if phase == "core":
                    points[T] = point(base, sname, T, E, H, I, K, copy_bw, mm, variant, cfgs, wanted)
                x, idx, w, dy, ref, flops, floors = points[T]
                for impl in impls_for(base, T, E, H, I, K, idx, w, wanted, configs, compiled_bases, phase):
                    try:
                        measure(impl, x, dy, ref, base, modes, sname, T, flops, floors)
                    except Exception as e:  # noqa: BLE001
                        emit(kind="moe_error", shape=sname, impl=impl.name, T=T,
                             error=f"{type(e).__name__}: {str(e)[:300]}")
                    if impl.config in ("compiled", "reduce-overhead"):
                        torch.compiler.reset()  # (frees its CUDA-graph pool before the next configuration)
                    if CUDA:
                        torch.cuda.empty_cache()
                print(f"-- {sname} T={T} {phase} took {time.time() - t0:.1f}s", flush=True)
        del base, points
        if CUDA:
            torch.cuda.empty_cache()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import summarize

        print()
        summarize.moe(ROWS)
    except Exception as e:  # noqa: BLE001
        print("summary table failed:", type(e).__name__, e)


if __name__ == "__main__":
    main()
