"""Benchmark fused_experts against its peers on one GPU, in one run.

Peers (each as a user calls it, eager): transformers experts `eager`, `grouped_mm`,
`batched_mm`, and Liger-Kernel's fused MoE when importable. Shapes Qwen3-30B-A3B, Mixtral 8x7B,
DeepSeek-V3; T in 1, 32, 512, 4096, 16384; forward (no_grad) and forward+backward.
Floor = max(FLOPs / measured bf16 matmul rate, touched-weight bytes / measured copy rate), with
touched experts = distinct ids in topk_idx. Also prints peak memory of forward+backward and the
tile config chosen, so `tune_moe.py` knows where to look.

Usage (repo root): PYTHONPATH=src python kernels_repo/moe/benchmarks/bench_moe.py
  env: SHAPES=qwen3_30b_a3b,mixtral_8x7b,deepseek_v3  TOKENS=1,32,512,4096,16384
       IMPLS=kernelhub,hf_grouped_mm,...  MODES=fwd,fwdbwd  STAGES=1 (per-stage kernelhub times; 0: off)
       (IMPLS may also name kernelhub_compiled: torch.compile of the same call; never run by default)
       OUT=/tmp (appends $OUT/bench_moe.jsonl)  MOE_DIR=DIR (the kernel repository to time; default ours)
       SKEW=s: skewed routing, as a trained router's hot experts: expert logits get a bias of
         -s * log(1 + rank) over a random ranking of the experts (0, the default: uniform); rows
         then carry skew=s and the "--" line the hottest expert's load over the mean
  Liger-Kernel autotunes its MoE kernels on first use of a shape, for minutes at Mixtral and
  DeepSeek-V3 sizes: give such a run a long timeout, or keep the tuning between runs
  (benchmarks/README.md).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "src"))
from kernelhub._loader import load_kernel_from_dir  # noqa: E402

# MOE_DIR: another copy of the kernel repository (an older commit, say), for an A/B in one call
moe = load_kernel_from_dir(Path(os.environ.get("MOE_DIR", ROOT / "kernels_repo" / "moe")))
DEV = torch.device("cuda")
OUT = os.environ.get("OUT", "/tmp")
LOG = open(os.path.join(OUT, "bench_moe.jsonl"), "a")
SHAPES = {
    "qwen3_30b_a3b": dict(E=128, H=2048, I=768, K=8),
    "mixtral_8x7b": dict(E=8, H=4096, I=14336, K=2),
    "deepseek_v3": dict(E=256, H=7168, I=2048, K=8),
}


def emit(**row) -> None:
    if SKEW and row.get("kind", "").startswith("moe_"):
        row["skew"] = SKEW
    LOG.write(json.dumps(row) + "\n")
    LOG.flush()
    text = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
    print(text, flush=True)


def bench(fn, grad_to_none=None) -> float:
    return do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")


def ceilings() -> tuple[float, float]:
    src = torch.randn(1 << 29, device=DEV, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() * 2 / (bench(lambda: dst.copy_(src)) * 1e-3)
    m = 8192
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
    mod = Qwen3MoeExperts(cfg).to(DEV, torch.bfloat16)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.02)
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


def impls_for(base, T, E, H, I, K, idx, w, wanted):
    """name -> fn(x) for every implementation that applies at this size."""
    out = {}

    def kh(xx):
        # check_indices=False: what the layer / kernelize path calls (no host sync per call).
        return moe.fused_experts(xx, base.gate_up_proj, base.down_proj, idx, w, check_indices=False)

    out["kernelhub"] = kh
    if "kernelhub_compiled" in wanted:  # torch.compile'd (the custom-op path), only when asked for
        out["kernelhub_compiled"] = torch.compile(kh, fullgraph=True)
    if T <= 64:
        # Decode is launch-bound in eager mode; the replayed CUDA graph shows the GPU-side time
        # (how serving engines run decode). Forward only.
        try:
            out["kernelhub_graph"] = graphed(kh, base, T, H)
        except Exception as e:  # noqa: BLE001
            emit(kind="moe_error", impl="kernelhub_graph", T=T, error=f"{type(e).__name__}: {str(e)[:300]}")
    for impl in ("eager", "grouped_mm", "batched_mm"):
        if impl == "batched_mm" and T * K * H * I > 2**33:
            continue
        if impl == "eager" and T >= 16384 and E >= 128:
            continue

        def hf(xx, impl=impl):
            base.config._experts_implementation = impl
            return base(xx, idx, w)

        out["hf_" + impl] = hf
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

        idx32 = idx.to(torch.int32)
        out["liger"] = lambda xx: LigerFusedMoEFunction.apply(xx, base.gate_up_proj, base.down_proj, idx32, w)
    except Exception as e:  # noqa: BLE001
        if T == 1:
            print("liger unavailable:", e)
    return {k: v for k, v in out.items() if not wanted or k in wanted}


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


def measure(name, fn, x, dy, ref, base, modes, sname, T, flops, floor_ms) -> None:
    if "fwd" in modes:
        with torch.no_grad():
            err = ((fn(x).float() - ref).norm() / ref.norm()).item()
            ms = bench(lambda: fn(x))
        emit(kind="moe_fwd", shape=sname, impl=name, T=T, ms=ms, TFLOPs=flops / (ms * 1e-3) / 1e12,
             floor_ms=floor_ms, frac_floor=floor_ms / ms, relerr=err)
    if "fwdbwd" in modes and not name.endswith("_graph"):
        xx = x.clone().requires_grad_()
        params = [xx, base.gate_up_proj, base.down_proj]

        def fb():
            fn(xx).backward(dy)

        ms = bench(fb, grad_to_none=params)
        for p in params:
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fb()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20
        for p in params:
            p.grad = None
        emit(kind="moe_fwdbwd", shape=sname, impl=name, T=T, ms=ms, TFLOPs=3 * flops / (ms * 1e-3) / 1e12,
             floor_ms=3 * floor_ms, frac_floor=3 * floor_ms / ms, peak_extra_MiB=peak)


def main() -> None:
    import transformers
    import triton

    print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__,
          torch.cuda.get_device_name(), torch.cuda.get_device_capability(), flush=True)
    copy_bw, mm = ceilings()
    only = [s for s in os.environ.get("SHAPES", "").split(",") if s]
    tokens = [int(t) for t in os.environ.get("TOKENS", "1,32,512,4096,16384").split(",")]
    wanted = [s for s in os.environ.get("IMPLS", "").split(",") if s]
    modes = os.environ.get("MODES", "fwd,fwdbwd").split(",")
    variant = moe.select_variant(DEV)
    cfgs = __import__(moe.__name__ + "._experts_configs", fromlist=["pick_config"])
    for sname, s in SHAPES.items():
        if only and sname not in only:
            continue
        E, H, I, K = s["E"], s["H"], s["I"], s["K"]
        base = hf_experts(E, H, I, K)
        for T in tokens:
            t0 = time.time()
            x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
            idx, w = routing(T, E, K)
            dy = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
            touched = int(torch.unique(idx).numel())
            flops = 6 * T * K * H * I
            floor_ms = max(flops / mm, (touched * 3 * H * I * 2 + 2 * T * H * 2) / copy_bw) * 1e3
            bucket = cfgs.pick_config(90 if variant == "sm90" else 80, E, H, I, T * K)
            load = torch.bincount(idx.reshape(-1), minlength=E).float()
            print(f"-- {sname} T={T} touched={touched} hottest/mean={float(load.max() / load.mean()):.2f} "
                  f"variant={variant} block_m={bucket['block_m']} "
                  f"gate_up={bucket['gate_up']} down={bucket['down']}", flush=True)
            base.config._experts_implementation = "grouped_mm"
            with torch.no_grad():
                ref = moe.fused_experts_reference(x, base.gate_up_proj, base.down_proj, idx, w).float()
            if os.environ.get("STAGES", "1") == "1" and (not wanted or "kernelhub" in wanted):
                try:
                    stage_breakdown(base, x, idx, w, dy, sname, T, variant)
                except Exception as e:  # noqa: BLE001
                    emit(kind="moe_error", shape=sname, impl="kernelhub_stages", T=T,
                         error=f"{type(e).__name__}: {str(e)[:300]}")
            for name, fn in impls_for(base, T, E, H, I, K, idx, w, wanted).items():
                try:
                    measure(name, fn, x, dy, ref, base, modes, sname, T, flops, floor_ms)
                except Exception as e:  # noqa: BLE001
                    emit(kind="moe_error", shape=sname, impl=name, T=T,
                         error=f"{type(e).__name__}: {str(e)[:300]}")
                torch.cuda.empty_cache()
            print(f"-- {sname} T={T} took {time.time() - t0:.1f}s", flush=True)
        del base
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
