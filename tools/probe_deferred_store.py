"""Compile probe (no GPU): can Triton overlap a weight-gradient tile's store with the next tile's MMAs?

Why: the flattened persistent wgrad loop (`_wgrad_flat_tiles`) is latency-bound on an H200 (ncu,
thirteenth session: ~50% of L2, DRAM and SM throughput at DeepSeek-V3 T=4096), because a tile's
epilogue and TMA store run between its last MMA and the next tile's first. This builds a stripped
copy of that loop (`flat_now`) and a variant that carries the finished accumulator to the next tile
and stores it after that tile's first MMA (`flat_defer`), compiles both for sm90 and prints shared
memory, registers, spills and where the PTX waits for the MMAs. Finding (triton 3.7.1, 2026-12-05):
`flat_now` keeps one MMA group in flight in the loop (`wgmma.wait_group 1`); `flat_defer` waits for
every MMA right after issuing it (`wgmma.wait_group 0`) and needs 238-255 registers instead of
90-154, so the deferred store cannot overlap anything. Usage (repo root, TRITON_INTERPRET unset):

    python tools/probe_deferred_store.py
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

os.environ.pop("TRITON_INTERPRET", None)


@triton.jit
def _tile_setup(tile, start_ptr, count_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(expert, M-block, N-block, expert's first row, its row count) of an expert-major tile index."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    rest = tile % (num_m * num_n)
    e = tile // (num_m * num_n)
    return e, rest // num_n, rest % num_n, tl.load(start_ptr + e), tl.load(count_ptr + e)


@triton.jit
def _tile_acc(a_desc, b_desc, start, count, pid_m, pid_n, P, ks, acc, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.where(ks * BLOCK_K < count, start + ks * BLOCK_K, P)  # past the rows: a box of zeros
    a = a_desc.load([row, pid_m * BLOCK_M])
    b = b_desc.load([row, pid_n * BLOCK_N])
    return tl.dot(tl.trans(a), b, acc)


@triton.jit
def flat_now(a_desc, b_desc, c_desc, start_ptr, count_ptr, E, M, N, P, steps,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """As shipped: each tile stored right after its last K step."""
    num_tiles = E * tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
        e, pid_m, pid_n, start, count = _tile_setup(tile, start_ptr, count_ptr, M, N, BLOCK_M, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(0, steps):
            acc = _tile_acc(a_desc, b_desc, start, count, pid_m, pid_n, P, ks, acc, BLOCK_M, BLOCK_N, BLOCK_K)
        c_desc.store([e, pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(tl.bfloat16).reshape(1, BLOCK_M, BLOCK_N))


@triton.jit
def flat_defer(a_desc, b_desc, c_desc, start_ptr, count_ptr, E, M, N, P, steps,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The previous tile stored after this tile's first MMA (two accumulators live)."""
    num_tiles = E * tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    prev = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    pe = -1
    pm = 0
    pn = 0
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
        e, pid_m, pid_n, start, count = _tile_setup(tile, start_ptr, count_ptr, M, N, BLOCK_M, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(0, steps):
            acc = _tile_acc(a_desc, b_desc, start, count, pid_m, pid_n, P, ks, acc, BLOCK_M, BLOCK_N, BLOCK_K)
            if (ks == 0) & (pe >= 0):
                c_desc.store([pe, pm * BLOCK_M, pn * BLOCK_N], prev.to(tl.bfloat16).reshape(1, BLOCK_M, BLOCK_N))
        prev = acc
        pe = e
        pm = pid_m
        pn = pid_n
    if pe >= 0:
        c_desc.store([pe, pm * BLOCK_M, pn * BLOCK_N], prev.to(tl.bfloat16).reshape(1, BLOCK_M, BLOCK_N))


def probe(fn, bm: int, bn: int, bk: int, warps: int, stages: int) -> None:
    sig = {"a_desc": f"tensordesc<bf16[{bk}, {bm}]>", "b_desc": f"tensordesc<bf16[{bk}, {bn}]>",
           "c_desc": f"tensordesc<bf16[1, {bm}, {bn}]>", "start_ptr": "*i32", "count_ptr": "*i32",
           **{n: "i32" for n in ("E", "M", "N", "P", "steps")},
           **{n: "constexpr" for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}}
    src = ASTSource(fn, sig, {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, {})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptx = k.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "k.ptx").write_text(ptx)
        report = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                                capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", report)
    spills = sum(int(v) for v in re.findall(r"(\d+) bytes spill", report))
    waits = sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)))
    print(f"{fn.__name__} {bm}x{bn}x{bk} warps={warps} stages={stages}: smem={k.metadata.shared} "
          f"regs={regs.group(1) if regs else '?'} spill_bytes={spills} wgmma.wait_group {'/'.join(waits)}",
          flush=True)


if __name__ == "__main__":
    for kernel in (flat_now, flat_defer):
        for tile in ((128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4)):
            probe(kernel, *tile)
