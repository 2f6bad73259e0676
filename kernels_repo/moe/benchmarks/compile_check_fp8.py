"""Compile the fp8-experts kernels for sm90, sm89 and sm80 without a GPU (Triton AOT to cubin).

Each bucket of configs/fp8_<variant>.json with the constexprs `_fp8_experts._gemm` passes for it:
"sm90" (fp8 tl.dot; x by the quantize pass or quantized in the load; weights, and down's h where
"A_TMA", by TMA descriptors; h quantized in the SwiGLU epilogue; "w8a16" buckets: the W8A16 math)
for sm90 and sm89 (no TMA there, stages fitted to its shared memory), "sm80" (W8A16: fp8 weights
as uint8 bits converted in registers) for sm80/sm86, plus the quantize pass and the backward's
GEMMs. The interpreter never runs the GPU code path (EMULATE=False), so this is where its fp8
casts, dots and descriptors are checked. Usage (repo root, TRITON_INTERPRET unset):
    PYTHONPATH=src python kernels_repo/moe/benchmarks/compile_check_fp8.py [CAP ...]
CAP (90, 89, 80, 86): only those capabilities (default all; the tests run two processes).
Each line: ok/FAIL, capability, label, shared memory bytes, registers and spill bytes (ptxas).
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compile_check as cc  # noqa: E402  (pops TRITON_INTERPRET and loads the kernel package)

fp8k = importlib.import_module(cc.moe.__name__ + "._fp8_experts")  # (imported on the first fp8 call)
kern = importlib.import_module(cc.moe.__name__ + "._fp8_kernels")
fp8c = importlib.import_module(cc.moe.__name__ + "._fp8_configs")
dec = importlib.import_module(cc.moe.__name__ + "._fp8_decode")
# decode tiles compiled whether or not a shipped bucket has them (a "decode" key's, tune_moe.py's)
DECODE_TILES = {"gate_up": [{"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2},
                            {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2}],
                "down": [{"BLOCK_N": 4, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2},
                         {"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2}]}
# the K loop pipelined through shared memory (LOAD_STAGES): its loads must become cp.async
for _stage, _tile in (("gate_up", {"BLOCK_N": 4, "BLOCK_K": 128}), ("down", {"BLOCK_N": 8, "BLOCK_K": 64})):
    DECODE_TILES[_stage].append({**_tile, "num_warps": 4, "num_stages": 2, "LOAD_STAGES": 3})
# the down kernel as a programmatic dependent launch of gate/up (PDL; TRIGGER is what the launcher
# then passes gate/up; sm90 only)
DECODE_TILES["gate_up"].append({"BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 8, "num_stages": 2, "TRIGGER": True})
DECODE_TILES["down"].append({"BLOCK_N": 4, "BLOCK_K": 128, "num_warps": 8, "num_stages": 2, "PDL": True})
# the Gluon decode kernels (stage key "GLUON", sm90): one thread a row's run down to one warp a row
GLUON_DECODE_TILES = {"gate_up": [{"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8, "num_stages": 2},
                                  {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 2, "num_stages": 2},
                                  {"BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 1, "num_stages": 2, "TRIGGER": True}],
                      "down": [{"BLOCK_N": 4, "BLOCK_K": 128, "num_warps": 8, "num_stages": 2, "PDL": True},
                               {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 8, "num_stages": 2},
                               {"BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 2, "num_stages": 2}]}
SM89_SMEM = 101376  # shared memory per block (opt-in) of sm86/sm89
_UNIT = ("stride_ak", "stride_bk", "stride_cn")  # unit strides the JIT specializes to constexpr 1


def compile_report(fn, sig: dict, const: dict, cap: int, num_warps: int, num_stages: int, maxnreg=None) -> dict:
    """{"smem", "regs", "spills"} of one AOT compile (raises on a compile error)."""
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig.get(n, "").startswith("*") or sig.get(n) == cc.I32}
    opts = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", cap, 32), options=opts)
    rep = cc.ptxas_report(k.asm["ptx"], cap)
    regs = re.search(r"regs=(\S+)", rep).group(1)
    return {"smem": k.metadata.shared, "regs": int(regs) if regs.isdigit() else -1,
            "spills": int(re.search(r"spill_bytes=(\d+)", rep).group(1)),
            "cp_async": cc.cp_async_count(k.asm["ptx"]), "gdc": k.asm["ptx"].count("griddepcontrol.")}


def gemm_signature(cap: int, variant: str, bucket: dict, stage: str, dtype: str = "bf16",
                   backward: str | None = None) -> tuple[dict, dict, dict]:
    """(signature, constexprs, stage tiles) of one `_fp8_experts._gemm` launch: the forward's
    gate_up / down of `bucket`, or (backward="gather" / "rows") a backward GEMM (W8A16, fp32 out)."""
    c = bucket[stage]
    fp8_dot = variant == "sm90" and not bucket.get("w8a16", False) and backward is None
    gate_up = stage == "gate_up" and backward is None
    tma = variant == "sm90" and cap >= 90 and bucket.get("tma", True) and backward is None
    if backward is not None:
        a_dtype, c_dtype = ("bf16" if backward == "gather" else "fp32"), "fp32"
    elif gate_up:
        a_dtype = "fp8e4nv" if fp8_dot and bucket.get("quant_x", True) else dtype
        c_dtype = "fp8e4nv" if fp8_dot else dtype
    else:
        a_dtype, c_dtype = ("fp8e4nv" if fp8_dot else dtype), dtype
    w_dtype = "fp8e4nv" if fp8_dot else "u8"  # (W8A16: bits)
    a_tma = tma and c.get("A_TMA", False)  # (gate/up: x quantized in row order, read by TMA)
    sig = {"a_ptr": f"*{a_dtype}", "as_ptr": "*fp32", "b_ptr": f"*{w_dtype}", "bs_ptr": "*fp32",
           "c_ptr": f"*{c_dtype}", "cs_ptr": "*fp32", "rows_ptr": "*i32", "row_expert_ptr": "*i32",
           "start_ptr": "*i32", "count_ptr": "*i32"}
    const = {}
    bm, bn = c.get("BLOCK_M", bucket["block_m"]), c["BLOCK_N"]
    quant_a = fp8_dot and gate_up and a_dtype != "fp8e4nv"
    bk = 128 if quant_a else c.get("BLOCK_K", 128)
    fused = tma and gate_up and bool(c.get("FUSED", False)) and 128 % bn == 0
    if fused:  # (gate and up rows in one box of the weight seen as [E, 2, I, H])
        sig["b_desc"] = f"tensordesc<{w_dtype}[1, 2, {bn}, {bk}]>"
    elif tma:
        sig["b_desc"] = f"tensordesc<{w_dtype}[1, {bn}, {bk}]>"
    else:
        const["b_desc"] = None
    if a_tma:
        sig["a_desc"] = f"tensordesc<{a_dtype}[{bm}, {bk}]>"
    else:
        const["a_desc"] = None
    gather = (gate_up and not a_tma) or backward == "gather"
    const.update(EPILOGUE=1 if gate_up else 0, GATHER_A=gather, TOPK=8, FP8_DOT=fp8_dot,
                 QUANT_A=quant_a, QUANT_C=fp8_dot and gate_up, EMULATE=False,
                 PRECISION="ieee" if a_dtype == "fp32" else None, SCALE_N=128, SCALE_K=128, B_TMA=tma, A_TMA=a_tma,
                 RESCALE=fp8_dot and bool(c.get("RESCALE", False)),
                 # (one scale per K step where the tile fits a scale block: the checkpoints' I and H
                 # are multiples of 128)
                 ONE_SCALE=128 % bn == 0, FUSED=fused,
                 PERSISTENT=bool(c.get("PERSISTENT", 0)) and bm == bucket["block_m"],
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    for name in _UNIT if not (backward and stage == "down") else ("stride_ak", "stride_cn"):  # (transposed W)
        const[name] = 1
    full = {n: sig.get(n, "constexpr" if n in const else cc.I32) for n in kern._fp8_gemm_kernel.arg_names}
    return full, const, c


def check_gemm(cap: int, variant: str, bucket: dict, stage: str, dtype: str = "bf16", backward: str | None = None,
               label: str = "") -> dict | None:
    """Compile one launch and print its line; the report, or None on a compile error."""
    if cap < 90 and variant == "sm90":  # sm89: stages fitted to its shared memory, as the launcher does
        bucket = fp8c.fit_fp8_shared_memory(bucket, SM89_SMEM, 1 if not bucket.get("w8a16", False) else 2)
    sig, const, c = gemm_signature(cap, variant, bucket, stage, dtype, backward)
    flags = [k for k in ("B_TMA", "A_TMA", "QUANT_A", "FP8_DOT", "RESCALE") if const[k]]
    text = (f"fp8 {variant} {backward + ' backward' if backward else stage} x={dtype} block_m={bucket['block_m']} "
            f"{json.dumps(c, sort_keys=True)} {' '.join(flags)} {label}").rstrip()
    try:
        rep = compile_report(kern._fp8_gemm_kernel, sig, const, cap, c["num_warps"], c["num_stages"],
                             c.get("maxnreg"))
    except Exception as e:  # noqa: BLE001
        print(f"FAIL sm{cap} {text}: {type(e).__name__}: {str(e)[:400]}", flush=True)
        return None
    print(f"ok   sm{cap} {text} smem={rep['smem']} regs={rep['regs']} spill_bytes={rep['spills']} "
          f"cp_async={rep['cp_async']}", flush=True)
    return rep


def check_quantize(cap: int, dtype: str = "bf16") -> dict | None:
    fn = kern._quantize_x_kernel
    sig = {"x_ptr": f"*{dtype}", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "rows_ptr": "*i32"}
    const = {"EMULATE": False, "ROWS": True, "TOPK": 8, "BLOCK_T": fp8k._QUANT_ROWS, "GROUP": 128}
    full = {n: sig.get(n, "constexpr" if n in const else cc.I32) for n in fn.arg_names}
    try:
        rep = compile_report(fn, full, const, cap, 4, None)
    except Exception as e:  # noqa: BLE001
        print(f"FAIL sm{cap} fp8 quantize x={dtype}: {type(e).__name__}: {str(e)[:400]}", flush=True)
        return None
    print(f"ok   sm{cap} fp8 quantize x={dtype} smem={rep['smem']} regs={rep['regs']} spill_bytes={rep['spills']}",
          flush=True)
    return rep


def check_decode(cap: int, stage: str, c: dict, dtype: str = "bf16", label: str = "") -> dict | None:
    """One token-major decode kernel (`_fp8_decode`): fp8 weight pointers from sm89, bits below."""
    w_bits = cap < 89
    fn = dec._fp8_decode_gate_up_kernel if stage == "gate_up" else dec._fp8_decode_down_kernel
    w = "*u8" if w_bits else "*fp8e4nv"
    sig = ({"x_ptr": f"*{dtype}", "w_ptr": w, "ws_ptr": "*fp32", "idx_ptr": "*i64", "h_ptr": f"*{dtype}"}
           if stage == "gate_up" else
           {"h_ptr": f"*{dtype}", "w_ptr": w, "ws_ptr": "*fp32", "idx_ptr": "*i64", "wts_ptr": "*fp32",
            "out_ptr": f"*{dtype}"})
    const = dict(TOPK=8, W_BITS=w_bits, UPCAST=False, SCALE_N=128, SCALE_K=128, BLOCK_N=c["BLOCK_N"],
                 BLOCK_K=c["BLOCK_K"], PREFETCH=c.get("PREFETCH", False), LOAD_STAGES=c.get("LOAD_STAGES", 1),
                 stride_ik=1)
    if stage == "down":
        const.update(TOPK_P=8, stride_wtk=1, PDL=c.get("PDL", False))
    else:
        const.update(TRIGGER=c.get("TRIGGER", False))
    full = {n: sig.get(n, "constexpr" if n in const else cc.I32) for n in fn.arg_names}
    text = f"fp8 decode {stage} x={dtype} {json.dumps(c, sort_keys=True)}{' W_BITS' if w_bits else ''} {label}".rstrip()
    try:
        rep = compile_report(fn, full, const, cap, c["num_warps"], c["num_stages"])
    except Exception as e:  # noqa: BLE001
        print(f"FAIL sm{cap} {text}: {type(e).__name__}: {str(e)[:400]}", flush=True)
        return None
    print(f"ok   sm{cap} {text} smem={rep['smem']} regs={rep['regs']} spill_bytes={rep['spills']} "
          f"gdc={rep['gdc']} cp_async={rep['cp_async']}", flush=True)
    return rep


def check_decode_gluon(stage: str, c: dict, dtype: str = "bf16", label: str = "") -> dict | None:
    """A Gluon decode kernel (`_fp8_decode_gluon`) for sm90 with a stage's tile."""
    from triton.experimental.gluon._runtime import GluonASTSource

    mod = importlib.import_module(cc.moe.__name__ + "._fp8_decode_gluon")
    const = dict(TOPK=8, SCALE_N=128, SCALE_K=128, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], stride_ik=1)
    if stage == "gate_up":
        fn = mod._fp8_decode_gate_up_gluon_kernel
        sig = {"x_ptr": f"*{dtype}", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "idx_ptr": "*i64", "h_ptr": f"*{dtype}"}
        const.update(TRIGGER=c.get("TRIGGER", False))
    else:
        fn = mod._fp8_decode_down_gluon_kernel
        sig = {"h_ptr": f"*{dtype}", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "idx_ptr": "*i64", "wts_ptr": "*fp32",
               "out_ptr": f"*{dtype}"}
        const.update(TOPK_P=8, stride_wtk=1, PDL=c.get("PDL", False))
    full = {n: sig.get(n, "constexpr" if n in const else cc.I32) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if full[n] != "constexpr"}
    text = f"gluon decode {stage} x={dtype} {json.dumps(c, sort_keys=True)} {label}".rstrip()
    try:
        k = triton.compile(GluonASTSource(fn, full, const, attrs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": c["num_warps"]})
        rep = cc.ptxas_report(k.asm["ptx"], 90)
    except Exception as e:  # noqa: BLE001
        print(f"FAIL sm90 {text}: {type(e).__name__}: {str(e)[:400]}", flush=True)
        return None
    spills = int(re.search(r"spill_bytes=(\d+)", rep).group(1))
    gdc = k.asm["ptx"].count("griddepcontrol.")
    print(f"{'ok  ' if not spills else 'FAIL'} sm90 {text} smem={k.metadata.shared} {rep} gdc={gdc}", flush=True)
    return None if spills else {"smem": k.metadata.shared, "spills": spills, "gdc": gdc,
                                "regs": int(re.search(r"regs=(\d+)", rep).group(1))}


def shipped(variant: str) -> list[dict]:
    data = json.loads((fp8c._DIR / f"fp8_{variant}.json").read_text())
    return data["buckets"] + [b for bs in data.get("shapes", {}).values() for b in bs]


def check_gluon(cap: int, gated: bool, operand: str = "fp8") -> dict | None:
    """The Gluon warp-specialized GEMM of `_gluon_gemm` (bucket stage key "GLUON") on fp8 or 16-bit
    (`operand` "bf16") operands, its stages as `gemm` fits them to an H100's shared memory; None
    (and a FAIL line) on an error or a spill, else the shared memory and the PTX."""
    import torch
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.experimental.gluon._runtime import GluonASTSource
    gl8 = importlib.import_module(cc.moe.__name__ + "._gluon_gemm")
    label = f"gluon {operand} {'gate_up' if gated else 'down'}"
    dtype = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}[operand]
    out = torch.empty(256, 256, dtype=torch.float8_e4m3fn if gated and operand == "fp8" else torch.bfloat16)
    ab = torch.empty(256, 256, dtype=dtype)
    bk = 128 // ab.element_size()
    descs = {"a_desc": gl8._descriptor(ab, [128, bk]), "b_desc": gl8._descriptor(ab, [128, bk]),
             "c_desc": gl8._descriptor(out, [64, 128])}
    fn = gl8._gluon_grouped_gemm_kernel
    sig = {n: native_specialize_impl(BaseBackend, d, False, True, True)[0] for n, d in descs.items()}
    sig.update({n: "*fp32" for n in ("as_ptr", "bs_ptr", "cs_ptr")})
    sig.update({n: "*i32" for n in ("row_expert_ptr", "start_ptr", "count_ptr")})
    sig.update({n: "i32" for n in fn.arg_names if n not in sig})
    stages = gl8.stages_that_fit(gated, out.element_size(), 4)
    const = {"GATED": gated, "STAGES": stages}
    sig.update({n: "constexpr" for n in const})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
    try:
        k = triton.compile(GluonASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", cap, 32),
                           options={"num_warps": 4, "maxnreg": gl8.MAXNREG})
        rep = cc.ptxas_report(k.asm["ptx"], cap)
    except Exception as e:  # noqa: BLE001 - report, count as a failure
        print(f"FAIL sm{cap} {label}: {type(e).__name__}: {str(e)[-400:]}", flush=True)
        return None
    spills = int(re.search(r"spill_bytes=(\d+)", rep).group(1))
    ok = spills == 0 and k.metadata.shared <= gl8.SMEM
    print(f"{'ok  ' if ok else 'FAIL'} sm{cap} {label} stages={stages} smem={k.metadata.shared} {rep}", flush=True)
    return {"smem": k.metadata.shared, "ptx": k.asm["ptx"]} if ok else None


def main() -> None:
    fails = 0
    caps = {int(c) for c in sys.argv[1:]} or {90, 89, 80, 86}
    for cap, variant, dtypes in ((90, "sm90", ("bf16", "fp16")), (89, "sm90", ("bf16",)),
                                 (80, "sm80", ("bf16", "fp16", "fp32")), (86, "sm80", ("bf16",))):
        if cap not in caps:
            continue
        for b in shipped(variant):
            for dtype in dtypes:
                for stage in ("gate_up", "down"):
                    fails += check_gemm(cap, variant, b, stage, dtype) is None
        if variant == "sm90":  # the in-load quantization (a bucket's "quant_x": false)
            b = shipped(variant)[-1]
            fails += check_gemm(cap, variant, {**b, "quant_x": False}, "gate_up") is None
            fails += check_quantize(cap) is None  # (sm90 variant only: fp8e4nv stores need sm89+)
            if cap == 90 and importlib.import_module(cc.moe.__name__ + "._gluon_gemm").available():
                fails += sum(check_gluon(cap, gated, operand) is None
                             for gated in (True, False) for operand in ("fp8", "bf16"))
    if 90 in caps and importlib.import_module(cc.moe.__name__ + "._fp8_decode_gluon").gluon is not None:
        fails += sum(check_decode_gluon(stage, c) is None for stage, tiles in GLUON_DECODE_TILES.items() for c in tiles)
        fails += sum(check_decode_gluon(stage, b["decode"][stage], label="shipped") is None for b in shipped("sm90")
                     for stage in ("gate_up", "down") if b.get("decode", {}).get(stage, {}).get("GLUON", False))
    for cap in [c for c in (90, 80) if c in caps]:
        for stage, tiles in DECODE_TILES.items():
            for c in tiles:
                if cap >= 90 or not (c.get("PDL") or c.get("TRIGGER")):  # griddepcontrol: sm90+
                    fails += check_decode(cap, stage, c) is None
        for b in shipped("sm80"):
            for stage, mode in (("gate_up", "gather"), ("down", "gather"), ("down", "rows")):
                fails += check_gemm(cap, "sm80", b, stage, "bf16", backward=mode) is None
            if cap == 80 and "decode" in b:  # the sm80 variant's own decode tiles (W_BITS; no PDL there)
                fails += sum(check_decode(cap, stage, b["decode"][stage], label="shipped sm80") is None
                             for stage in ("gate_up", "down"))
    print(f"failures: {fails}")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
