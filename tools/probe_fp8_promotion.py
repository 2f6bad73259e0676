"""Compile probe (no GPU): can Triton keep an fp8 MMA in flight while the previous K-block's product
is scaled (the "promotion" of block-scaled fp8 GEMMs)?

Why: the fp8 experts GEMM (`_fp8_gemm_kernel`) scales each 128-column K-block's product before it
is accumulated, and its PTX waits for every MMA right after issuing it, so the tensor cores idle
while the scales are applied. DeepGEMM hides that with two accumulator buffers (issue block k+1,
then promote block k). This compiles three stripped loops for sm90 and prints the `pendings` of the
wait that follows each MMA (0: nothing stays in flight):
  rescale    acc = dot(a, b, acc * r)                         (the shipped RESCALE form)
  two_chain  two half-height accumulators, each rescaled and fed to its own dot
  deferred   d = dot(a, b); acc += d_prev * s_prev; d_prev = d  (promote the previous block after
             issuing this one: DeepGEMM's order)
  unscaled   acc = dot(a, b, acc): the control, no scales (one MMA group stays in flight)
Finding (triton 3.7.1, 2026-12-06): pendings 0 in all three scaled forms, 1 in the control's
loop: Triton's pipeliner keeps a dot async only where its result feeds the next dot's accumulator
unchanged, and warp specialization does not apply on sm90 (docs/history/performance-log.md, ninth
session). Usage (repo root, TRITON_INTERPRET
unset):

    python tools/probe_fp8_promotion.py
"""

from __future__ import annotations

import os
import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

os.environ.pop("TRITON_INTERPRET", None)


@triton.jit
def _promote(a_desc, b_desc, s_ptr, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             FORM: tl.constexpr):
    row = tl.program_id(0) * BM
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    if FORM == 0:  # rescale
        acc = tl.zeros((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            r = tl.load(s_ptr + k // BK + offs_m)
            acc = tl.dot(a_desc.load([row, k]), b_desc.load([0, k]).T, acc * r[:, None])
        tl.store(c_ptr + offs_m[:, None] * BN + offs_n[None, :], acc)
    elif FORM == 1:  # two_chain
        half = tl.arange(0, BM // 2)
        acc_a = tl.zeros((BM // 2, BN), tl.float32)
        acc_b = tl.zeros((BM // 2, BN), tl.float32)
        for k in tl.range(0, K, BK):
            b = b_desc.load([0, k]).T
            acc_a = tl.dot(a_desc.load([row, k]), b, acc_a * tl.load(s_ptr + k // BK + half)[:, None])
            r_b = tl.load(s_ptr + k // BK + BM // 2 + half)
            acc_b = tl.dot(a_desc.load([row + BM // 2, k]), b, acc_b * r_b[:, None])
        tl.store(c_ptr + half[:, None] * BN + offs_n[None, :], acc_a + acc_b)
    elif FORM == 2:  # deferred
        acc = tl.zeros((BM, BN), tl.float32)
        d_prev = tl.zeros((BM, BN), tl.float32)
        s_prev = tl.zeros((BM,), tl.float32)
        for k in tl.range(0, K, BK):
            d = tl.dot(a_desc.load([row, k]), b_desc.load([0, k]).T)
            acc += d_prev * s_prev[:, None]
            s_prev = tl.load(s_ptr + k // BK + offs_m)
            d_prev = d
        acc += d_prev * s_prev[:, None]
        tl.store(c_ptr + offs_m[:, None] * BN + offs_n[None, :], acc)
    else:  # unscaled: the control, a plain chained accumulator
        acc = tl.zeros((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            acc = tl.dot(a_desc.load([row, k]), b_desc.load([0, k]).T, acc)
        tl.store(c_ptr + offs_m[:, None] * BN + offs_n[None, :], acc)


def waits(form: int, bm: int = 128, bn: int = 128, num_warps: int = 8) -> list[int]:
    """The pendings of every MMA wait in the sm90 TTGIR of one loop form."""
    box = bm // 2 if form == 1 else bm
    sig = {"a_desc": f"tensordesc<fp8e4nv[{box}, 128]>", "b_desc": f"tensordesc<fp8e4nv[{bn}, 128]>",
           "s_ptr": "*fp32", "c_ptr": "*fp32", "K": "i32",
           "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "FORM": "constexpr"}
    const = {"BM": bm, "BN": bn, "BK": 128, "FORM": form}
    k = triton.compile(ASTSource(_promote, sig, const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps, "num_stages": 3})
    return [int(p) for p in re.findall(r"warp_group_dot_wait .*?pendings = (\d+)", k.asm["ttgir"])]


def main() -> None:
    print("triton", triton.__version__)
    for form, name in enumerate(("rescale", "two_chain", "deferred", "unscaled")):
        print(f"{name:10s} MMA wait pendings: {waits(form)}")


if __name__ == "__main__":
    main()
