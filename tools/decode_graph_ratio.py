"""fp8 and bf16 decode calls by GPU time: fused_experts on fp8 weights (the configs in effect:
KERNELHUB_MOE_CONFIG_DIR) and on their bf16 dequantization, each captured 50 times in one CUDA graph
with L2 flushed before each call, less the flush alone. `bench_fp8.py` times eager calls, which at
T=1 follow the host when the host is slower than the GPU (H200 machines: 0.021-0.113 ms for one fp8
configuration across processes); this says what the GPU spends, fp8 over bf16 in the same process.

Usage (repo root, GPU): PYTHONPATH=src python tools/decode_graph_ratio.py   env: SHAPES=qwen3_30b_a3b,deepseek_v3  T=1
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels_repo" / "moe" / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from diag_fp8_decode import _graph_us  # noqa: E402  (tools/)
from tune_moe import DEV, SHAPES, fp8_weights, moe  # noqa: E402  (kernels_repo/moe/benchmarks/)


def point(name: str, T: int, flush: torch.Tensor, alone: float) -> None:
    ref = sys.modules[moe.__name__ + ".reference_fp8"]
    s = SHAPES[name]
    E, H, I, K = s["E"], s["H"], s["I"], s["K"]
    gu, gus = fp8_weights(E, 2 * I, H)
    dn, dns = fp8_weights(E, H, I)
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, generator=g)
    idx = torch.stack([torch.randperm(E, device=DEV, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, device=DEV, generator=g)
    fp8 = _graph_us(lambda: (flush.zero_(), moe.fused_experts(x, gu, dn, idx, w, gate_up_proj_scale_inv=gus,
                                                              down_proj_scale_inv=dns))) - alone
    gub = torch.stack([ref.dequantize_blocks(gu[e], gus[e]).to(torch.bfloat16) for e in range(E)])
    dnb = torch.stack([ref.dequantize_blocks(dn[e], dns[e]).to(torch.bfloat16) for e in range(E)])
    bf16 = _graph_us(lambda: (flush.zero_(), moe.fused_experts(x, gub, dnb, idx, w))) - alone
    print(f"{name} T={T}: fp8 {fp8:.1f} us, bf16 {bf16:.1f} us, fp8 / bf16 {fp8 / bf16:.2f} "
          f"(CUDA graph replay, L2 flushed before each call)", flush=True)


def main() -> None:
    T = int(os.environ.get("T", "1"))
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEV)
    alone = _graph_us(flush.zero_)
    for name in os.environ.get("SHAPES", "qwen3_30b_a3b,deepseek_v3").split(","):
        point(name, T, flush, alone)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
