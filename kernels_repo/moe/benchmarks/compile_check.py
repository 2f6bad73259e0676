"""Compile every fused_experts kernel for sm90 and sm80 without a GPU (Triton AOT to cubin).

Catches GPU-only compile errors (layouts, TMA, shared memory) on a machine with no GPU: it builds
each kernel with the constexprs `_experts_launch.py` passes for every bucket of `configs/sm*.json` and runs
the whole pipeline up to ptxas. Usage (repo root, TRITON_INTERPRET unset):
    PYTHONPATH=src python kernels_repo/moe/benchmarks/compile_check.py
    PAIR=1 ...: also the block_m=128 buckets' GEMM tiles as block_m=64 with "pair_m" (128-row tiles)
    PTX_DIR=DIR ...: also write each kernel's PTX there
    ... 90: only the capabilities named (default 90 80; the tests run one process per capability)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "src"))
os.environ.pop("TRITON_INTERPRET", None)
from kernelhub._loader import load_kernel_from_dir  # noqa: E402

moe = load_kernel_from_dir(ROOT / "kernels_repo" / "moe")
kern = sys.modules[moe.__name__ + "._experts_kernels"]
rt = sys.modules[moe.__name__ + "._experts_routing"]
cfgs = sys.modules[moe.__name__ + "._experts_configs"]
dec = sys.modules[moe.__name__ + "._experts_decode"]

I32 = "i32"
UNIT_STRIDES = {
    "_grouped_gemm_kernel": {False: ("stride_ak", "stride_bk", "stride_cn"),
                             True: ("stride_ak", "stride_bn", "stride_cn")},
    "_grouped_wgrad_kernel": {False: ("stride_ak", "stride_bk", "stride_cn")},
    "_combine_kernel": {False: ()},
    "_decode_gate_up_kernel": {False: ("stride_xh", "stride_ik", "stride_wk")},
    "_decode_down_kernel": {False: ("stride_ik", "stride_wk", "stride_wtk")},
}
# decode tiles compiled whether or not a shipped bucket has them (tune_moe.py's candidates; the down
# kernel holds the K experts' tiles and an accumulator per expert, so BLOCK_N * BLOCK_K stays
# <= 256 * num_warps: past it ptxas spills)
DECODE_TILES = {stage: [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": 2} for n, k, w in tiles]
                for stage, tiles in (("gate_up", ((4, 512, 4), (8, 256, 4), (16, 256, 4), (16, 512, 8))),
                                     ("down", ((4, 256, 4), (4, 512, 8), (8, 128, 4), (8, 256, 8))))}
# the K loop pipelined through shared memory (LOAD_STAGES): its loads must become cp.async
DECODE_TILES["gate_up"].append({"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "LOAD_STAGES": 3})
DECODE_TILES["down"].append({"BLOCK_N": 4, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2, "LOAD_STAGES": 3})


def cp_async_count(ptx: str) -> int:
    """Global-to-shared `cp.async` copies in the PTX: loads Triton software-pipelined."""
    return len(re.findall(r"cp\.async\.c[ag]\.", ptx))


def ptxas_report(ptx: str, cap: int) -> str:
    """Registers per thread and spill bytes as ptxas reports them (the GPU is not needed)."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    arch = "sm_90a" if cap == 90 else f"sm_{cap}"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        Path(path).write_text(ptx)
        out = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = sum(int(v) for v in re.findall(r"(\d+) bytes spill", out))
    return f"regs={regs.group(1) if regs else '?'} spill_bytes={spills}"


def compile_one(fn, signature, constexprs, cap, num_warps, num_stages, label):
    # As the JIT specializes at run time: unit strides become constexpr 1, and pointers and other
    # int arguments are assumed 16-divisible (true for the shapes that matter, e.g. H=2048, I=768).
    for name in fn.arg_names:
        if name.startswith("stride_") and constexprs.get(name) is None and signature.get(name) == I32:
            if name in UNIT_STRIDES.get(fn.__name__, {}).get(constexprs.get("B_NCONTIG", False), ()):
                signature[name] = "constexpr"
                constexprs[name] = 1
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if signature.get(n, "").startswith("*") or signature.get(n) == I32}
    src = ASTSource(fn, signature, constexprs, attrs)
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    try:
        k = triton.compile(src, target=GPUTarget("cuda", cap, 32), options=opts)
        smem = k.metadata.shared
        if os.environ.get("PTX_DIR"):  # to diff the code of two trees (e.g. a refactor that should not change it)
            name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"sm{cap}_{label}")[:200]
            Path(os.environ["PTX_DIR"], name + ".ptx").write_text(k.asm["ptx"])
        ptx = k.asm["ptx"]
        print(f"ok   sm{cap} {label} smem={smem} {ptxas_report(ptx, cap)} cp_async={cp_async_count(ptx)}", flush=True)
        return smem
    except Exception as e:  # noqa: BLE001
        print(f"FAIL sm{cap} {label}: {type(e).__name__}: {str(e)[:400]}", flush=True)
        return None


def gemm(cap, cfg, bm, epilogue, tma, ncontig, dtype="bf16", pair=False):
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    # as _experts_launch.gemm: A by TMA only where it is not gathered (epilogue 0; gate_up under "ROWS")
    gather = epilogue == 2 or (epilogue == 1 and not cfg.get("ROWS", False))
    a_tma = bool(tma and cfg.get("A_TMA", False) and not gather)
    sig = {
        "a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "c_ptr": f"*{dtype}", "aux_ptr": f"*{dtype}",
        "rows_ptr": "*i32", "row_expert_ptr": "*i32", "scale_ptr": f"*{dtype}", "dscale_ptr": "*fp32",
        "h_ptr": f"*{dtype}", "expert_start_ptr": "*i32", "expert_count_ptr": "*i32", "pair_tiles_ptr": "*i32",
    }
    for name in ("P", "N", "K", "B_N_TOTAL", "E", "stride_am", "stride_ak", "stride_be", "stride_bn", "stride_bk",
                 "stride_cm", "stride_cn", "stride_xm", "stride_hm"):
        sig[name] = I32
    const = {}
    if tma:
        block = [1, bk, bn] if ncontig else [1, bn, bk]
        sig["b_desc"] = f"tensordesc<{dtype}[{', '.join(map(str, block))}]>"
    else:
        const["b_desc"] = None
    if a_tma:
        sig["a_desc"] = f"tensordesc<{dtype}[{bm}, {bk}]>"
    else:
        const["a_desc"] = None
    if a_tma and pair:
        sig["a_desc_tall"] = f"tensordesc<{dtype}[{2 * bm}, {bk}]>"
    else:
        const["a_desc_tall"] = None
    persistent = bool(cfg.get("PERSISTENT", 0))
    const.update(
        EPILOGUE=epilogue, SAVE_AUX=epilogue == 1, SAVE_H=epilogue == 2,
        GATHER_A=gather, TOPK=8, B_TMA=tma,
        B_NCONTIG=ncontig, UPCAST=False, PRECISION="ieee" if dtype == "fp32" else None, PAIR=pair, A_TMA=a_tma,
        PERSISTENT=persistent, EPI_HALVES=bool(cfg.get("EPI_HALVES", False)),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
    )
    # ASTSource wants every argument in the signature; constexprs are marked "constexpr".
    order = kern._grouped_gemm_kernel.arg_names
    full = {n: sig.get(n, "constexpr") for n in order}
    rows = (" rows" if epilogue == 1 and not gather else "") + (" halves" if cfg.get("EPI_HALVES") else "")
    label = (f"gemm epi={epilogue} tma={tma} ncontig={ncontig} bm={bm}{' pair' if pair else ''}{rows}"
             f"{' a_tma' if a_tma else ''}{' persistent' if persistent else ''} {cfg} {dtype}")
    return compile_one(kern._grouped_gemm_kernel, full, const, cap, cfg["num_warps"], cfg["num_stages"], label)


def wgrad(cap, cfg, gather_a, tma=False, rows=False):
    """rows: both operands row-ordered copies (wgrad key "ROWS"), so neither is gathered."""
    sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "rows_ptr": "*i32",
           "expert_start_ptr": "*i32", "expert_count_ptr": "*i32"}
    for name in ("E", "M", "N", "P", "stride_am", "stride_ak", "stride_bm", "stride_bk", "stride_ce", "stride_cm",
                 "stride_cn"):
        sig[name] = I32
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    ga, gb = (False, False) if rows else (gather_a, not gather_a)
    const = dict(GATHER_A=ga, GATHER_B=gb, TOPK=8, UPCAST=False, PRECISION=None,
                 A_TMA=tma and not ga, B_TMA=tma and not gb, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                 GROUP_M=cfg.get("GROUP_M", 1))
    for name, on, cols in (("a_desc", const["A_TMA"], bm), ("b_desc", const["B_TMA"], bn)):
        if on:
            sig[name] = f"tensordesc<bf16[{bk}, {cols}]>"
        else:
            const[name] = None
    const["C_TMA"] = tma and bool(cfg.get("TMA_STORE", False))
    const["PERSISTENT"] = bool(cfg.get("PERSISTENT", 0))
    # as _experts_launch.wgrad: the flattened loop only with persistent programs and both operands by TMA
    flat = const["PERSISTENT"] and const["A_TMA"] and const["B_TMA"]
    const["FLAT_STEPS"] = int(cfg.get("FLAT_STEPS", 0)) if flat else 0
    const["BLOCK_E"] = 256 if const["FLAT_STEPS"] else 1
    if const["C_TMA"]:
        sig["c_desc"] = f"tensordesc<bf16[1, {bm}, {bn}]>"
    else:
        const["c_desc"] = None
    full = {n: sig.get(n, "constexpr") for n in kern._grouped_wgrad_kernel.arg_names}
    return compile_one(kern._grouped_wgrad_kernel, full, const, cap, cfg["num_warps"], cfg["num_stages"],
                       f"wgrad gather_a={ga} gather_b={gb} tma={tma} {cfg}")


def decode(cap, stage: str, c: dict, dtype: str = "bf16") -> int | None:
    """One token-major decode kernel (a bucket's "decode" key) with stage tile `c`."""
    if stage == "gate_up":
        fn = dec._decode_gate_up_kernel
        sig = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "idx_ptr": "*i64", "h_ptr": f"*{dtype}"}
    else:
        fn = dec._decode_down_kernel
        sig = {"h_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "idx_ptr": "*i64", "wts_ptr": "*fp32",
               "out_ptr": f"*{dtype}"}
    const = dict(TOPK=8, UPCAST=False, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
                 LOAD_STAGES=c.get("LOAD_STAGES", 1))
    if stage == "down":
        const["TOPK_P"] = 8
    full = {n: sig.get(n, "constexpr" if n in const else I32) for n in fn.arg_names}
    return compile_one(fn, full, const, cap, c["num_warps"], c["num_stages"], f"decode {stage} {c} {dtype}")


def others(cap) -> int:
    """The small kernels; returns the number that failed."""
    fails = 0
    sig = {"y_ptr": "*bf16", "pos_ptr": "*i32", "w_ptr": "*bf16", "out_ptr": "*bf16", "H": I32,
           "stride_ym": I32, "stride_wt": I32, "stride_wk": I32, "stride_om": I32}
    full = {n: sig.get(n, "constexpr") for n in kern._combine_kernel.arg_names}
    fails += compile_one(kern._combine_kernel, full, dict(TOPK=8, HAS_W=True, RNE=False, BLOCK_H=1024), cap, 4,
                         3, "combine") is None
    sig = {"src_ptr": "*bf16", "rows_ptr": "*i32", "row_expert_ptr": "*i32", "out_ptr": "*bf16", "P": I32,
           "H": I32, "stride_s": I32, "stride_o": I32}
    full = {n: sig.get(n, "constexpr") for n in kern._gather_rows_kernel.arg_names}
    fails += compile_one(kern._gather_rows_kernel, full, dict(stride_sh=1, TOPK=8, ALIGN=128, BLOCK_R=16,
                                                             BLOCK_H=512), cap, 4, 3, "gather_rows") is None
    sig = {"start_ptr": "*i32", "count_ptr": "*i32", "tiles_ptr": "*i32", "E": I32, "P": I32}
    full = {n: sig.get(n, "constexpr") for n in kern._pair_tiles_kernel.arg_names}
    fails += compile_one(kern._pair_tiles_kernel, full, dict(BLOCK_M=64, BLOCK_E=128), cap, 4, 3,
                         "pair_tiles") is None
    sig = {"idx_ptr": "*i64", "rows_ptr": "*i32", "row_expert_ptr": "*i32", "start_ptr": "*i32",
           "count_ptr": "*i32", "pos_ptr": "*i32", "n": I32, "E": I32, "P": I32}
    full = {n: sig.get(n, "constexpr") for n in rt._align_small_kernel.arg_names}
    fails += compile_one(rt._align_small_kernel, full, dict(BLOCK_M=16, BLOCK_N=512, BLOCK_E=256, BLOCK_J=32,
                                                            BLOCK_P=256), cap, 8, 3, "align_small") is None
    for stage, tiles in DECODE_TILES.items():
        for c in tiles:
            fails += decode(cap, stage, c) is None
    fails += decode(cap, "gate_up", DECODE_TILES["gate_up"][1], "fp32") is None
    return fails


PAIR_TOO = os.environ.get("PAIR") == "1"  # also compile the block_m=128 buckets' tiles as pair_m at 64


def main() -> None:
    failures = 0
    for cap in [int(c) for c in sys.argv[1:]] or (90, 80):
        failures += others(cap)
        data = cfgs._load(cap)
        buckets = list(data["buckets"])
        for shape_buckets in data.get("shapes", {}).values():
            buckets += shape_buckets
        # (once each: a shape entry may repeat the defaults, and "GLUON" does not change the Triton tile)
        unique = {json.dumps({k: ({kk: vv for kk, vv in v.items() if kk != "GLUON"} if isinstance(v, dict) else v)
                              for k, v in b.items() if k != "max_rows_per_expert"}, sort_keys=True): b
                  for b in buckets}
        buckets = list(unique.values())
        for b in buckets:
            tma = cap == 90 and b.get("tma", True)
            for stage, epi, ncontig in (("gate_up", 1, False), ("down", 0, False), ("dgrad", 2, True),
                                        ("down", 0, True)):
                failures += gemm(cap, b[stage], b["block_m"], epi, tma, ncontig, pair=b.get("pair_m", False)) is None
                if PAIR_TOO and b["block_m"] == 128:  # the same tiles as 64-row blocks paired (pair_m)
                    failures += gemm(cap, b[stage], 64, epi, tma, ncontig, pair=True) is None
                if tma and stage in ("down", "gate_up") and b["block_m"] >= 64:
                    # the down tile as tune_moe.py may write it (h by TMA from persistent programs),
                    # and gate_up on a row copy of x the same way (sweep_persistent.py's candidate)
                    keys = {"A_TMA": True, "PERSISTENT": 1, **({"ROWS": True} if stage == "gate_up" else {})}
                    if {**b[stage], **keys} != b[stage]:
                        failures += gemm(cap, {**b[stage], **keys}, b["block_m"], epi, tma, ncontig,
                                         pair=b.get("pair_m", False)) is None
                if stage == "gate_up" and not b[stage].get("EPI_HALVES"):  # the training epilogue in halves
                    failures += gemm(cap, {**b[stage], "EPI_HALVES": True}, b["block_m"], epi, tma, ncontig,
                                     pair=b.get("pair_m", False)) is None
            for gather_a in (True, False):
                failures += wgrad(cap, b["wgrad"], gather_a) is None
                if tma:  # the optional TMA operand (wgrad stage key "TMA")
                    failures += wgrad(cap, b["wgrad"], gather_a, tma=True) is None
            for stage in ("gate_up", "down") if "decode" in b else ():
                failures += decode(cap, stage, b["decode"][stage]) is None
            if b["wgrad"].get("ROWS"):
                failures += wgrad(cap, b["wgrad"], False, tma=tma and b["wgrad"].get("TMA", False), rows=True) is None
        failures += gemm(cap, buckets[0]["gate_up"], 16, 1, False, False, dtype="fp32") is None
    print("failures:", failures)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
