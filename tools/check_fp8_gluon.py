"""The Gluon fp8 grouped GEMM (`_gluon_gemm`, bucket stage key "GLUON") against the shipped Triton
tiles on the GPU: the same inputs through `fused_experts` with each bucket pinned, the outputs
compared with each other and (T=4096) with the float64 emulation of the activation quantization,
then timed (do_bench median and CUDA-graph replay).

Usage (repo root, on an sm90 GPU): PYTHONPATH=src python tools/check_fp8_gluon.py
    env: POINTS=deepseek_v3:4096,deepseek_v3:16384,qwen3_30b_a3b:4096,qwen3_30b_a3b:16384
         VARIANTS=4,3 (num_stages of the Gluon stages; fewer where they do not fit)
Prints one line per (point, bucket): ms, TFLOP/s, relative error against the emulation.
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from kernelhub._loader import load_kernel_from_dir  # noqa: E402

moe = load_kernel_from_dir(ROOT / "kernels_repo" / "moe")
fp8c = importlib.import_module(moe.__name__ + "._fp8_configs")
SHAPES = {"deepseek_v3": (256, 7168, 2048, 8), "qwen3_30b_a3b": (128, 2048, 768, 8),
          "odd": (8, 1280, 384, 2)}  # (odd numbers of K-blocks in both GEMMs)


def inputs(E, H, I, K, T, seed=0):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(T, H, device=dev, generator=g).bfloat16()
    idx = torch.rand(T, E, device=dev, generator=g).argsort(1)[:, :K].contiguous()
    w = torch.rand(T, K, device=dev, generator=g).bfloat16()
    guq, gus = quantized(E, 2 * I, H, g)
    dq, ds = quantized(E, H, I, g)
    return x, guq, dq, idx, w, gus, ds


def quantized(E, N, K, g, chunk=16):
    """Random fp8 block-quantized weights [E, N, K], a few experts at a time (DeepSeek-V3's fp32
    weights at once would need 30 GB)."""
    parts = [moe.quantize_blocks(torch.randn(min(chunk, E - e), N, K, device=g.device, generator=g) * K**-0.5)
             for e in range(0, E, chunk)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def graph_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=10, rep=100, return_mode="median")


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main() -> None:
    points = os.environ.get("POINTS", "deepseek_v3:4096,deepseek_v3:16384,qwen3_30b_a3b:4096,qwen3_30b_a3b:16384")
    variants = [int(v) for v in os.environ.get("VARIANTS", "4,3").split(",")]
    print("gpu", torch.cuda.get_device_name(), flush=True)
    for point in points.split(","):
        name, T = point.split(":")
        run_point(name, int(T), variants)
        torch.cuda.empty_cache()


def run_point(name: str, T: int, variants: list) -> None:
    E, H, I, K = SHAPES[name]
    x, guq, dq, idx, w, gus, ds = inputs(E, H, I, K, T)
    shipped = fp8c.picked_fp8_config("sm90", E, H, I, T * K, None, 2)
    buckets = [("shipped", shipped)]
    for stages in variants:
        b = copy.deepcopy(shipped)
        b["block_m"] = 128
        b.pop("decode", None)
        for stage in ("gate_up", "down"):
            b[stage] = {"BLOCK_N": 128, "num_warps": 4, "num_stages": stages, "GLUON": True}
        buckets.append((f"gluon stages={stages}", b))
    emu = None
    if E * H * I <= 2**28:  # (float64 dequantized weights: DeepSeek-V3's would need 60 GB)
        emu = moe.fused_experts_fp8_reference(x.double(), guq, dq, idx, w.double(), quantize_activations=True,
                                              gate_up_proj_scale_inv=gus, down_proj_scale_inv=ds).float()
    flops = 2 * T * K * 3 * H * I
    base = None
    for label, b in buckets:
        def call(b=b):
            return moe.fused_experts(x, guq, dq, idx, w, variant="sm90", config=b, gate_up_proj_scale_inv=gus,
                                     down_proj_scale_inv=ds)
        try:
            with torch.no_grad():
                out = call()
                torch.cuda.synchronize()
                ms = do_bench(call, warmup=10, rep=100, return_mode="median")
                gms = graph_ms(call)
        except Exception as e:  # noqa: BLE001 - report and go on to the next bucket
            print(f"{name} T={T} {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        base = out if base is None else base
        err = f" err_vs_emulation={rel(out, emu):.4f} (shipped {rel(base, emu):.4f})" if emu is not None else ""
        print(f"{name} T={T} {label}: {ms:.3f} ms (graph {gms:.3f}), {flops / gms / 1e9:.0f} TFLOP/s, "
              f"vs shipped rel {rel(out, base):.4f}{err}", flush=True)


if __name__ == "__main__":
    main()
