"""How much of the grouped GEMMs' M dimension is padding, for the routing `bench_moe.py` times.

Each expert's rows are padded to a multiple of the bucket's block_m, so one M-tile never spans two
experts; the padding rows cost MMA work like real ones. With random routing (softmax of normal
logits, top-k, as in the benchmark) an expert of a T*K/E ~ 256-row load gets 2 or 3 tiles of 128
about equally often. Prints the padded fraction per shape, T and block_m (CPU; no GPU needed).

    python tools/padding_stats.py [SEED]
"""

from __future__ import annotations

import sys

import torch

SHAPES = {"qwen3_30b_a3b": (128, 8), "mixtral_8x7b": (8, 2), "deepseek_v3": (256, 8)}  # (E, K)


def expert_counts(T: int, E: int, K: int, gen: torch.Generator) -> torch.Tensor:
    logits = torch.randn(T, E, generator=gen)
    idx = torch.topk(torch.softmax(logits, -1), K, dim=-1).indices
    return torch.bincount(idx.flatten(), minlength=E)


def padded_fraction(counts: torch.Tensor, block_m: int) -> float:
    padded = ((counts + block_m - 1) // block_m * block_m).sum().item()
    return 1 - counts.sum().item() / padded


def main() -> None:
    gen = torch.Generator().manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    for name, (E, K) in SHAPES.items():
        for T in (512, 4096, 16384):
            counts = expert_counts(T, E, K, gen)  # one routing for every block_m: comparable columns
            fracs = ", ".join(f"block_m={bm}: {padded_fraction(counts, bm):.3f}" for bm in (32, 64, 128))
            print(f"{name} T={T} rows per expert {T * K / E:.0f}: padded fraction {fracs}")


if __name__ == "__main__":
    main()
