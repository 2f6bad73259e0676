"""A/B of the opt-in sm90 fp8 stage keys against the shipped tiles at large T (issue 31), one run.

Why: the fp8 grouped GEMMs scale each K-block's product before accumulating it, so Triton waits
for every K-block's MMAs (`wgmma.wait_group 0`) and the tensor cores idle while the CUDA cores
scale. The "WS" stage key warp-specializes the K loop (a TMA producer warp group, two consumer
warp groups of 64 rows: one scales while the other's MMAs run). This times the shipped bucket
against a short list of candidates in the same process, on the same inputs.

Usage (repo root, GPU; `bash benchmarks/gpu_run.sh fp8ab`):
    PYTHONPATH=src python tools/ab_fp8_ws.py
    env: FP8AB_SHAPES=deepseek_v3,qwen3_30b_a3b  FP8AB_TOKENS=4096,16384  FP8AB_ONLY=name,... (candidates)
One line per (shape, T, candidate): forward ms (do_bench median), TFLOP/s of the useful FLOPs
(2 * T * K * 3 * H * I), that rate over the dense fp8 matmul rate measured first (`torch._scaled_mm`
8192^3), the speedup over the shipped bucket and the relative difference of the output from the
shipped bucket's (fp8 rounding of h may flip single elements: ~1e-3; a broken path: ~1). A
candidate whose kernels fail to compile (e.g. Triton's warp specialization on another Triton
version) is reported and skipped: each "WS" candidate is first run on a small problem in a child
process (a compiler crash there cannot end this run), then its Python errors are caught here.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import traceback
from functools import partial
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from kernelhub._loader import load_kernel_from_dir  # noqa: E402

SHAPES = {"deepseek_v3": (256, 7168, 2048, 8), "qwen3_30b_a3b": (128, 2048, 768, 8)}  # E, H, I, K
FP8 = torch.float8_e4m3fn
# the "WS" stages: 128-row tiles (64 rows per consumer warp group), 4 warps per warp group
WS_GATE_UP = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3, "WS": True}
WS_DOWN = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "WS": True}


def candidates(shipped: dict) -> list[tuple[str, dict]]:
    """The shipped bucket; its tiles on 128-row alignment (the control: "WS" needs block_m 128, this
    is what that alone costs); "WS" on down, on gate/up and on both."""
    base = {k: v for k, v in shipped.items() if k != "max_rows_per_expert"}
    bm = base["block_m"]
    at128 = {**base, "block_m": 128, **{s: {"BLOCK_M": bm, **base[s]} for s in ("gate_up", "down")}}
    out = [("shipped", base)]
    if bm != 128:
        out.append(("shipped_bm128", at128))
    out += [("ws_down", {**at128, "down": WS_DOWN}), ("ws_gate_up", {**at128, "gate_up": WS_GATE_UP}),
            ("ws_both", {**at128, "gate_up": WS_GATE_UP, "down": WS_DOWN})]
    only = [n for n in os.environ.get("FP8AB_ONLY", "").split(",") if n]
    return [(n, c) for n, c in out if not only or n == "shipped" or n in only]


def fp8_weights(E: int, n: int, k: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 weights [E, n, k] (random normal values, 16 experts at a time) and plausible block scales."""
    w = torch.empty(E, n, k, device=dev, dtype=FP8)
    for e in range(0, E, 16):
        w[e:e + 16] = torch.randn(min(16, E - e), n, k, device=dev, dtype=torch.bfloat16).to(FP8)
    s = torch.rand(E, -(-n // 128), -(-k // 128), device=dev) * 1e-3 + 1e-3
    return w, s


def inputs(E: int, H: int, I: int, K: int, T: int, dev, seed: int = 0):
    torch.manual_seed(seed)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    idx = torch.rand(T, E, device=dev).topk(K, dim=1).indices
    w = torch.rand(T, K, device=dev)
    return x, idx, w


def fp8_rate(dev) -> float:
    """Dense fp8 matmul TFLOP/s of this device, measured now."""
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16).to(FP8)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16).to(FP8).t().contiguous().t()
    one = torch.ones((), device=dev)
    ms = triton.testing.do_bench(partial(torch._scaled_mm, a, b, one, one, out_dtype=torch.bfloat16), warmup=25,
                                 rep=100, return_mode="median")
    return 2 * n**3 / ms / 1e9


def probe(names: list[str]) -> dict[str, str]:
    """{name: "ok" or the reason} for candidates run on a small problem in child processes: a child
    that dies (a compiler abort) marks the first candidate it did not report and the rest run in
    a new child."""
    verdict: dict[str, str] = {}
    todo = list(names)
    while todo:
        try:
            res = subprocess.run([sys.executable, __file__, "--probe", *todo], capture_output=True, text=True,
                                 timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
            out, why = res.stdout, f"child exit {res.returncode}: {(res.stderr.strip().splitlines() or [''])[-1][:300]}"
        except subprocess.TimeoutExpired as e:
            out, why = e.stdout or "", "child timed out"
            out = out.decode() if isinstance(out, bytes) else out
        for line in out.splitlines():
            if line.startswith("probe "):
                _, name, text = line.split(" ", 2)
                verdict[name] = text
        left = [n for n in todo if n not in verdict]
        if left:  # the child ended before reporting left[0]
            verdict[left[0]] = why
        todo = left[1:]
    return verdict


def run_probe(names: list[str]) -> None:
    """Child: each named candidate on a small problem (Qwen3 widths, 8 experts), printing its verdict."""
    moe = load_kernel_from_dir(ROOT / "kernels_repo" / "moe")
    dev = torch.device("cuda")
    E, H, I, K, T = 8, 2048, 768, 8, 512
    gu, gus = fp8_weights(E, 2 * I, H, dev)
    dn, dns = fp8_weights(E, H, I, dev)
    x, idx, w = inputs(E, H, I, K, T, dev)
    shipped = dict(candidates({"block_m": 64, "gate_up": {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
                               "down": {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3}}))
    for name in names:
        try:
            out = moe.fused_experts(x, gu, dn, idx, w, variant="sm90", config=shipped[name],
                                    gate_up_proj_scale_inv=gus, down_proj_scale_inv=dns)
            torch.cuda.synchronize()
            print(f"probe {name} {'ok' if torch.isfinite(out).all() else 'non-finite output'}", flush=True)
        except Exception as e:  # noqa: BLE001 - reported, the next candidate runs
            print(f"probe {name} {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", flush=True)


def main() -> None:
    moe = load_kernel_from_dir(ROOT / "kernels_repo" / "moe")
    fp8c = importlib.import_module(moe.__name__ + "._fp8_configs")  # (not imported by the package itself)
    dev = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name(dev)} torch {torch.__version__} triton {triton.__version__}", flush=True)
    rate = fp8_rate(dev)
    print(f"ceiling fp8 _scaled_mm {rate:.0f} TFLOP/s", flush=True)
    shapes = [s for s in os.environ.get("FP8AB_SHAPES", "deepseek_v3,qwen3_30b_a3b").split(",") if s]
    tokens = [int(t) for t in os.environ.get("FP8AB_TOKENS", "4096,16384").split(",") if t]
    smem = torch.cuda.get_device_properties(dev).shared_memory_per_block_optin
    names = [n for n, c in candidates(fp8c.pick_fp8_config("sm90", 256, 7168, 2048, 16384 * 8))
             if any(c[s].get("WS", False) for s in ("gate_up", "down"))]
    verdict = probe(names)
    for n in names:
        print(f"probe {n}: {verdict[n]}", flush=True)
    for shape in shapes:
        E, H, I, K = SHAPES[shape]
        gu, gus = fp8_weights(E, 2 * I, H, dev)
        dn, dns = fp8_weights(E, H, I, dev)
        for T in tokens:
            x, idx, w = inputs(E, H, I, K, T, dev)
            flops = 2 * T * K * 3 * H * I
            shipped = fp8c.picked_fp8_config("sm90", E, H, I, T * K, smem, x.element_size())
            base_ms = want = None
            for name, cfg in candidates(shipped):
                if verdict.get(name, "ok") != "ok":
                    print(f"fp8ab {shape} T={T} {name:14s} skipped ({verdict[name]})", flush=True)
                    continue
                run = partial(moe.fused_experts, x, gu, dn, idx, w, variant="sm90", config=cfg,
                              gate_up_proj_scale_inv=gus, down_proj_scale_inv=dns)
                try:
                    with torch.no_grad():
                        out = run().float()
                        ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
                except Exception as e:  # noqa: BLE001 - one candidate failing must not end the A/B
                    print(f"fp8ab {shape} T={T} {name:14s} FAILED {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:300] if str(e) else ''}", flush=True)
                    traceback.print_exc(limit=2)
                    continue
                if want is None:
                    base_ms, want = ms, out
                diff = ((out - want).norm() / want.norm().clamp(min=1e-30)).item()
                tf = flops / ms / 1e9
                print(f"fp8ab {shape} T={T} {name:14s} {ms:8.3f} ms {tf:6.0f} TFLOP/s {tf / rate:5.2f} of fp8 mm  "
                      f"x{base_ms / ms:4.2f} vs shipped  diff {diff:.1e}  {json.dumps(cfg, sort_keys=True)}",
                      flush=True)
                del out
            del x, idx, w, want
        del gu, gus, dn, dns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"]:
        run_probe(sys.argv[2:])
    else:
        main()
