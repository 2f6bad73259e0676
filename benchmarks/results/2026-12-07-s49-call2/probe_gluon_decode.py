"""s49-2 probe: a Gluon fp8 decode gate/up kernel (explicit layouts: x loaded once per thread's
column run, no shared memory; fp32 or fp16 run sums) against the shipped Triton gate/up kernel,
Qwen3-30B-A3B T=1, each alone (torch.profiler GPU time, L2 flushed before each call) and h compared."""
import importlib
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "kernels_repo" / "moe" / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gdec  # noqa: E402
from profile_moe import kernel_times  # noqa: E402
from tune_moe import DEV, SHAPES, fp8_weights, moe  # noqa: E402

s = SHAPES["qwen3_30b_a3b"]
E, H, I, K = s["E"], s["H"], s["I"], s["K"]
gu, gus = fp8_weights(E, 2 * I, H)
fp8x = importlib.import_module(moe.__name__ + "._fp8_experts")
g = torch.Generator(device=DEV).manual_seed(0)
x = torch.randn(1, H, device=DEV, dtype=torch.bfloat16, generator=g)
idx = torch.randperm(E, device=DEV, generator=g)[:K][None]
flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEV)
dn, dns = fp8_weights(E, H, I)
w = torch.rand(1, K, device=DEV, generator=g)
shipped = {"max_tokens": 1, "gate_up": {"BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 8, "num_stages": 2},
           "down": {"BLOCK_N": 4, "BLOCK_K": 128, "num_warps": 8, "num_stages": 2}}


def triton_h():
    h = torch.empty(K, I, device=DEV, dtype=torch.bfloat16)
    fp8x._decode_gate_up_launch.split(
        (K, I // 4), 0, (x, gu, gus, idx, h),
        (H, I, E, x.stride(0), idx.stride(0), idx.stride(1), gu.stride(0), gu.stride(1), gus.stride(0), gus.stride(1),
         h.stride(0)),
        fp8x.DecodeGateUpConstexprs(TOPK=K, W_BITS=False, UPCAST=False, SCALE_N=128, SCALE_K=128, BLOCK_N=4,
                                    BLOCK_K=512, PREFETCH=False, LOAD_STAGES=1, TRIGGER=False),
        num_warps=8, num_stages=2)
    return h


def gluon_h(bn, bk, nw, f16):
    h = torch.empty(K, I, device=DEV, dtype=torch.bfloat16)
    gdec._gate_up_kernel[(K, math.ceil(I / bn))](
        x, gu, gus, idx, h, H, I, E, x.stride(0), idx.stride(0), idx.stride(1), gu.stride(0), gu.stride(1),
        gus.stride(0), gus.stride(1), h.stride(0), TOPK=K, SCALE_N=128, SCALE_K=128, BLOCK_N=bn, BLOCK_K=bk,
        F16=f16, num_warps=nw)
    return h


# the reference h: dequantized weights in float64
gq = gu[idx[0]].double() * gus[idx[0]].repeat_interleave(128, 1)[:, :2 * I].repeat_interleave(128, 2)[:, :, :H].double()
prod = gq @ x[0].double()
ref = torch.nn.functional.silu(prod[:, :I]) * prod[:, I:]
want = triton_h()
print("triton h err", ((want.double() - ref).norm() / ref.norm()).item(), flush=True)
t, _ = kernel_times(triton_h, 20, before=flush.zero_)
print("triton shipped (4,512,8):", {k: round(v[0], 2) for k, v in t.items() if "flush" not in k and "fill" not in k},
      flush=True)
for bn, bk, nw in ((8, 512, 8), (8, 256, 4), (16, 256, 4), (16, 512, 8), (4, 256, 2), (32, 512, 8),
                   (16, 128, 4)):
    for f16 in (False, True):
        try:
            got = gluon_h(bn, bk, nw, f16)
            err = ((got.double() - ref).norm() / ref.norm()).item()
            t, _ = kernel_times(lambda bn=bn, bk=bk, nw=nw, f16=f16: gluon_h(bn, bk, nw, f16), 20, before=flush.zero_)
            us = [v[0] for k, v in t.items() if "gate_up" in k]
            print(f"gluon ({bn},{bk},{nw}) f16={f16}: {us[0]:.2f} us err {err:.2e}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"gluon ({bn},{bk},{nw}) f16={f16}: {type(e).__name__} {str(e)[:300]}", flush=True)
t, _ = kernel_times(triton_h, 20, before=flush.zero_)
print("triton shipped again:", {k: round(v[0], 2) for k, v in t.items() if "gate_up" in k}, flush=True)
