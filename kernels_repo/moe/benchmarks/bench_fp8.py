"""fused_experts on fp8 block-quantized weights against its ceilings and peers, all in one run.

Usage (repo root, GPU): PYTHONPATH=src python kernels_repo/moe/benchmarks/bench_fp8.py
  env: TOKENS=1,32,512,4096,16384  SHAPES=deepseek_v3,qwen3_30b_a3b  PEERS=0 (kernelhub only)
       COMPILE=default,reduce-overhead: kernelhub's fp8 call (its custom op) and torch._scaled_grouped_mm's
         path also under torch.compile (fullgraph, static shapes; compiled after a reset per point,
         first calls excluded, a CUDA-graph step marked per reduce-overhead call); none: eager only
       DEVICE=cpu: smoke test without a GPU, same code path (default SHAPES=tiny, TOKENS=1,8; a
         plain timer; the Triton variants need TRITON_INTERPRET=1 there)
Ceilings (same run): the dense fp8 matmul rate (`torch._scaled_mm`, 8192^3, bf16 out) and the
copy bandwidth (a 2 GiB device copy). Per shape and T one line per implementation: ms (do_bench
median), TFLOP/s of the useful FLOPs (2 * T * K * 3 * H * I), that rate over the fp8 matmul rate,
the time of the weight bytes the call must read at copy bandwidth ("bw" = that bound / ms: 1.0 is
the memory ceiling, what decode is bound by), the relative error against kernelhub's bf16 path on
the dequantized weights, then kernelhub's fp8 against bf16 (speedup) and against the best peer.
Implementations: kernelhub fp8 (automatic variant; "sm80" its W8A16 kernel), kernelhub bf16 on the
dequantized weights, and the peers: transformers `FP8Experts` (eager loop, grouped_mm, batched_mm:
each needs a Hub kernel, `finegrained-fp8` or `deep-gemm`; with no network or cache they are
skipped with the reason printed) and `torch._scaled_grouped_mm` with row-wise scales (tokens
sorted by expert; weights re-quantized per output row, activations per token: what torch offers,
a looser quantization than 128-column groups). Every line is also a JSON row appended to
$OUT/bench_fp8.jsonl (default /tmp): kind=fp8_ceiling, fp8_fwd (one per point and implementation),
fp8_summary. A peer that fails (kernelhub's bf16 path out of memory included) is skipped with its
reason for the rest of the shape; the run goes on.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the GPU machine has no network: fail fast, not on timeouts

import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

from kernelhub._bench_compile import compile_configs, compiled  # noqa: E402
from kernelhub._loader import load_kernel_from_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
# E, H, I, K ("tiny": the CPU smoke run's, DEVICE=cpu)
SHAPES = {"deepseek_v3": (256, 7168, 2048, 8), "qwen3_30b_a3b": (128, 2048, 768, 8), "tiny": (8, 256, 128, 2)}
FP8 = torch.float8_e4m3fn
DEV = torch.device(os.environ.get("DEVICE", "cuda" if torch.cuda.is_available() else "cpu"))
CUDA = DEV.type == "cuda"


def emit(**row) -> None:
    """One JSON row to $OUT/bench_fp8.jsonl."""
    with open(Path(os.environ.get("OUT", "/tmp")) / "bench_fp8.jsonl", "a") as log:
        log.write(json.dumps(row) + "\n")


def bench(fn) -> float:
    """Median ms (do_bench on CUDA; a plain timer elsewhere, for a CPU smoke run)."""
    if CUDA:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def ceilings(dev: torch.device) -> tuple[float, float]:
    """(dense fp8 matmul TFLOP/s, copy GB/s) of this device, measured now."""
    n = 8192 if dev.type == "cuda" else 256
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    bf16_rate = 2 * n**3 / bench(partial(torch.matmul, a, b)) / 1e9
    print(f"ceiling bf16 matmul {bf16_rate:.0f} TFLOP/s")
    a8, b8 = a.to(FP8), b.to(FP8).t().contiguous().t()
    one = torch.ones((), device=dev)
    fp8_rate = 2 * n**3 / bench(partial(torch._scaled_mm, a8, b8, one, one, out_dtype=torch.bfloat16)) / 1e9
    print(f"ceiling fp8 _scaled_mm {fp8_rate:.0f} TFLOP/s")
    del a, b, a8, b8
    src = torch.empty(1 << (31 if dev.type == "cuda" else 24), device=dev, dtype=torch.uint8)
    dst = torch.empty_like(src)
    gbs = 2 * src.numel() / bench(partial(dst.copy_, src)) / 1e6  # read + write
    print(f"ceiling copy bandwidth {gbs:.0f} GB/s")
    emit(kind="fp8_ceiling", fp8_mm_TFLOPs=fp8_rate, bf16_mm_TFLOPs=bf16_rate, copy_GBps=gbs, n=n,
         device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu")
    del src, dst
    return fp8_rate, gbs


def quantized(ref, E: int, shape: tuple[int, int], dev, g) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weights, block scales, the bf16 dequantized weights), 16 experts at a time (the fp32
    temporaries of all E experts do not fit beside the rest)."""
    q = torch.empty(E, *shape, device=dev, dtype=FP8)  # (filled in place: no second copy of each)
    d = torch.empty(E, *shape, device=dev, dtype=torch.bfloat16)
    s = torch.empty(E, -(-shape[0] // 128), -(-shape[1] // 128), device=dev, dtype=torch.float32)
    for e in range(0, E, 16):
        w = torch.randn(min(16, E - e), *shape, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
        q[e:e + 16], s[e:e + 16] = ref.quantize_blocks(w)
        d[e:e + 16] = ref.dequantize_blocks(q[e:e + 16], s[e:e + 16]).to(torch.bfloat16)
    return q, s, d


# ---- peer: torch._scaled_grouped_mm with row-wise scales ----

def rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, C] (16/32-bit) -> (fp8, fp32 scale [..., R]) per row over all C columns."""
    amax = w.float().abs().amax(-1).clamp(min=1e-4)
    return (w.float() * (448.0 / amax)[..., None]).to(FP8), amax / 448.0


def rowwise_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [E, N, K] -> (fp8 [E, K, N] column-major, as _scaled_grouped_mm takes it; scales [E, N])."""
    q = torch.empty(w.shape, device=w.device, dtype=FP8)  # filled in place: no second weight-sized copy
    s = torch.empty(w.shape[:2], device=w.device, dtype=torch.float32)
    for e in range(0, w.shape[0], 16):
        q[e:e + 16], s[e:e + 16] = rowwise(w[e:e + 16])
    return q.transpose(1, 2), s


def scaled_grouped_forward(x, gu_t, gu_s, dn_t, dn_s, idx, w):
    """out [T, H]: tokens sorted by expert, x and h quantized per row, two grouped fp8 GEMMs with
    row-wise scales, SwiGLU and the weighted sum in torch (no host sync)."""
    T, K = idx.shape
    E = gu_t.shape[0]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # offsets by searchsorted on the sorted ids, not cumsum(bincount): bincount's output size depends
    # on the data (a host sync on CUDA, and no CUDA graph under reduce-overhead)
    sorted_ids = flat[order]
    ends = torch.searchsorted(sorted_ids, torch.arange(E, device=x.device, dtype=sorted_ids.dtype),
                              right=True).to(torch.int32)
    xs = x[order // K]
    xq, xsc = rowwise(xs)
    gu = torch._scaled_grouped_mm(xq, gu_t, xsc, gu_s, offs=ends, out_dtype=torch.bfloat16)
    g, u = gu.chunk(2, dim=-1)
    h = torch.nn.functional.silu(g) * u
    hq, hsc = rowwise(h)
    y = torch._scaled_grouped_mm(hq, dn_t, hsc, dn_s, offs=ends, out_dtype=torch.bfloat16)
    y = y * w.reshape(-1)[order, None].to(y.dtype)
    out = torch.zeros(T * K, x.shape[1], device=x.device, dtype=y.dtype)
    out[order] = y
    return out.view(T, K, -1).sum(1)


# ---- peers: transformers FP8Experts ----

def transformers_experts(E, H, I, guq, gus, dnq, dns):
    """(FP8Experts module holding our fp8 weights, its module) or (None, reason)."""
    try:
        import transformers
        from transformers.integrations import finegrained_fp8 as tf8

        cfg = transformers.PretrainedConfig(hidden_size=H, intermediate_size=I, moe_intermediate_size=I,
                                            num_local_experts=E, num_experts=E, hidden_act="silu")
        with torch.device("meta"):
            m = tf8.FP8Experts(cfg, block_size=(128, 128))
        for name, t in (("gate_up_proj", guq), ("gate_up_proj_scale_inv", gus), ("down_proj", dnq),
                        ("down_proj_scale_inv", dns)):
            setattr(m, name, torch.nn.Parameter(t, requires_grad=False))
        if not hasattr(m, "_is_expert_parallel"):
            m._is_expert_parallel = False
        return m.eval(), tf8
    except Exception as e:  # noqa: BLE001 - another transformers version: say why and go on
        return None, f"{type(e).__name__}: {str(e)[:200]}"


def transformers_paths(m, tf8) -> dict:
    paths = {"tf_eager": lambda x, i, w: m.forward(x, i, w)}
    for label, name in (("tf_grouped_mm", "fp8_grouped_mm_experts_forward"),
                        ("tf_batched_mm", "fp8_batched_mm_experts_forward")):
        fn = getattr(tf8, name, None)
        if fn is not None:
            paths[label] = partial(fn, m)
    return paths


def try_peer(label, run, want, skipped: dict, warm: int = 1) -> tuple[float, float] | None:
    """(ms, relative error) of a peer after `warm` untimed calls (compiled: compile, CUDA-graph
    warm-up and recording), or None with the reason recorded once per peer."""
    if label in skipped:
        return None
    try:
        for _ in range(warm):
            out = run()
        err = math.nan if want is None else ((out.float() - want).norm() / want.norm()).item()
        return bench(run), err
    except Exception as e:  # noqa: BLE001 - a peer that cannot run here (no Hub kernel offline, no sm90 ...)
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if os.environ.get("BENCH_TRACE"):
            traceback.print_exc()
        skipped[label] = reason
        print(f"skip {label}: {reason}", flush=True)
        return None


def try_compiled(name: str, config: str, fn, args: tuple, want, skipped: dict,
                 **kwargs) -> tuple[str, tuple[float, float] | None]:
    """(row label f"{name}[{config}]", try_peer of `fn(*args, **kwargs)` compiled under `config`)."""
    label = f"{name}[{config}]"
    torch.compiler.reset()  # (this point's shapes compiled afresh: no recompile limit)
    r = try_peer(label, partial(compiled(fn, config), *args, **kwargs), want, skipped, warm=3)
    torch.compiler.reset()  # (frees its CUDA-graph pool)
    return label, r


def main() -> None:
    moe = load_kernel_from_dir(ROOT / "kernels_repo" / "moe")
    ref = sys.modules[moe.__name__ + ".reference_fp8"]
    dev = DEV
    fp8_rate, gbs = ceilings(dev)
    tokens = [int(t) for t in os.environ.get("TOKENS", "1,32,512,4096,16384" if CUDA else "1,8").split(",")]
    shapes = [s for s in os.environ.get("SHAPES", "deepseek_v3,qwen3_30b_a3b" if CUDA else "tiny").split(",") if s]
    peers = os.environ.get("PEERS", "1") != "0"
    configs = compile_configs("bench_fp8.py")
    for name in shapes:
        E, H, I, K = SHAPES[name]
        g = torch.Generator(device=dev).manual_seed(0)
        guq, gus, gud = quantized(ref, E, (2 * I, H), dev, g)
        dnq, dns, dnd = quantized(ref, E, (H, I), dev, g)
        skipped: dict[str, str] = {}
        gu_t = gu_s = dn_t = dn_s = tf = None
        if peers:
            gu_t, gu_s = rowwise_weights(gud)
            dn_t, dn_s = rowwise_weights(dnd)
            tf, tf8 = transformers_experts(E, H, I, guq, gus, dnq, dns)
            if tf is None:
                print(f"skip transformers FP8Experts: {tf8}", flush=True)
        for T in tokens:
            x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
            idx = torch.stack([torch.randperm(E, device=dev, generator=g)[:K] for _ in range(T)])
            w = torch.rand(T, K, device=dev, generator=g)
            flops = 2 * T * K * 3 * H * I
            # weight bytes the call must read: every touched expert's fp8 weights once (+ scales)
            touched = int(torch.unique(idx).numel())
            bound_ms = touched * 3 * H * I / (gbs * 1e6)
            res: dict[str, tuple[float, float]] = {}

            def record(label: str, r: tuple[float, float] | None, name=name, T=T, flops=flops,
                       bound_ms=bound_ms, res=res) -> None:
                """Print and write one implementation's row as soon as it is timed (a run cut by its
                timeout keeps it)."""
                if r is None:
                    return
                res[label] = r
                ms, err = r
                rate = flops / ms / 1e9
                print(f"fp8 {name} T={T} {label}: {ms:.4f} ms  {rate:.0f} TF/s  {rate / fp8_rate:.2f} of fp8 rate  "
                      f"bw {bound_ms / ms:.2f}  relerr {err:.3f}", flush=True)
                emit(kind="fp8_fwd", shape=name, T=T, impl=label, ms=ms, TFLOPs=rate,
                     frac_fp8_rate=rate / fp8_rate, bound_ms=bound_ms, frac_bw=bound_ms / ms, relerr=err)

            with torch.no_grad():
                bf16 = partial(moe.fused_experts, x, gud, dnd, idx, w)
                want = None
                if "kernelhub_bf16" not in skipped:
                    try:  # (the errors' reference: kernelhub's bf16 path on the dequantized weights)
                        want = bf16().float()
                    except Exception as e:  # noqa: BLE001 - out of memory at the largest T, say
                        skipped["kernelhub_bf16"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                        print(f"skip kernelhub_bf16: {skipped['kernelhub_bf16']}", flush=True)
                for label, kw in (("kernelhub_fp8", {}), ("kernelhub_fp8_w8a16", {"variant": "sm80"})):
                    run = partial(moe.fused_experts, x, guq, dnq, idx, w, gate_up_proj_scale_inv=gus,
                                  down_proj_scale_inv=dns, **kw)
                    record(label, try_peer(label, run, want, skipped))
                for config in configs:  # (what a user who compiles the model gets: the custom op)
                    record(*try_compiled(
                        "kernelhub_fp8", config, moe.fused_experts, (x, guq, dnq, idx, w), want, skipped,
                        gate_up_proj_scale_inv=gus, down_proj_scale_inv=dns))
                record("kernelhub_bf16", try_peer("kernelhub_bf16", bf16, want, skipped))
                if peers:
                    record("torch_scaled_grouped_mm", try_peer("torch_scaled_grouped_mm", partial(
                        scaled_grouped_forward, x, gu_t, gu_s, dn_t, dn_s, idx, w), want, skipped))
                    for config in configs:
                        record(*try_compiled(
                            "torch_scaled_grouped_mm", config, scaled_grouped_forward,
                            (x, gu_t, gu_s, dn_t, dn_s, idx, w), want, skipped))
                    if tf is not None:
                        for label, fn in transformers_paths(tf, tf8).items():
                            record(label, try_peer(label, partial(fn, x, idx, w), want, skipped))
            ours = res.get("kernelhub_fp8")
            peer_ms = {k: ms for k, (ms, _) in res.items() if not k.startswith("kernelhub")}
            if ours:
                bf16_ms = res.get("kernelhub_bf16", (math.nan,))[0]
                line = (f"fp8 {name} T={T} summary: kernelhub fp8 {ours[0]:.4f} ms, "
                        f"{flops / ours[0] / 1e9 / fp8_rate:.2f} of fp8 rate, "
                        f"{bf16_ms / ours[0]:.2f}x bf16 (time {ours[0] / bf16_ms:.2f}x)")
                best = min(peer_ms, key=peer_ms.get) if peer_ms else None
                if best:
                    line += f", {peer_ms[best] / ours[0]:.2f}x best peer ({best})"
                # kernelhub compiled over its eager call (issue: compiled no slower than eager)
                vs_eager = {c: res[f"kernelhub_fp8[{c}]"][0] / ours[0] for c in configs
                            if f"kernelhub_fp8[{c}]" in res}
                line += "".join(f", {c} / eager {v:.2f}" for c, v in vs_eager.items())
                print(line, flush=True)
                emit(kind="fp8_summary", shape=name, T=T, ms=ours[0], frac_fp8_rate=flops / ours[0] / 1e9 / fp8_rate,
                     speedup_bf16=bf16_ms / ours[0], best_peer=best,
                     speedup_best_peer=peer_ms[best] / ours[0] if best else None, compiled_over_eager=vs_eager)
        del guq, gus, gud, dnq, dns, dnd, gu_t, gu_s, dn_t, dn_s, tf
        if dev.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
