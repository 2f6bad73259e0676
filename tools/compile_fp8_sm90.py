"""Compile the fp8-experts tiles for sm90 without a GPU and hold them to the register and shared
memory budget: no spills, shared memory <= 227 KB per block (an H100's opt-in maximum).

Why: a tile that spills or does not fit is slow or does not launch, and on the CPU the
interpreter cannot tell. This compiles (Triton AOT for sm_90a, then ptxas -v) each bucket of
configs/fp8_sm90.json (or of DIR/fp8_sm90.json) with the constexprs `_fp8_experts._gemm` passes:
gate/up (x by the quantize pass, and quantized in the load: "quant_x": false) and down, for bf16
and fp16 activations, plus the quantize pass and any "decode" key's token-major kernels;
--candidates also every tile `tune_moe.py --fp8` may time (so the sweep spends no GPU time on
tiles that spill).
Usage (repo root, TRITON_INTERPRET unset):
    PYTHONPATH=src python tools/compile_fp8_sm90.py [--dir DIR] [--candidates]
Prints one line per kernel (registers, spill bytes, shared memory) and exits 1 if any fails,
spills or exceeds the shared memory.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "kernels_repo" / "moe" / "benchmarks"
sys.path.insert(0, str(BENCH))
import compile_check_fp8 as cc8  # noqa: E402  (pops TRITON_INTERPRET, loads the kernel package)

SMEM_LIMIT = 232448  # 227 KB


def buckets(directory: Path | None) -> list[tuple[str, dict]]:
    path = (directory or cc8.fp8c._DIR) / "fp8_sm90.json"
    data = json.loads(path.read_text())
    out = [(f"buckets[{i}]", b) for i, b in enumerate(data["buckets"])]
    for key, bs in data.get("shapes", {}).items():
        out += [(f"shapes[{key}][{i}]", b) for i, b in enumerate(bs)]
    return out


def tune_module():
    spec = importlib.util.spec_from_file_location("tune_moe_for_compile", BENCH / "tune_moe.py")
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    return tune


def candidates() -> list[tuple[str, dict]]:
    """Every (block_m, stage tile) `tune_moe.py --fp8` may time on sm90, as one-stage buckets."""
    tune = tune_module()
    out, seen = [], set()
    base = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 1}
    for rpe, block_ms in ((1, (16, 32)), (16, (32, 64)), (256, (64, 128))):
        for bm in block_ms:
            for w8a16 in ((False, True) if rpe <= 4 else (False,)):
                for stage in ("gate_up", "down"):
                    for c in tune.fp8_stage_space(stage, bm, rpe, w8a16):
                        b = {"block_m": bm, "gate_up": base, "down": base, stage: c, "w8a16": w8a16}
                        key = json.dumps([stage, c.get("BLOCK_M", bm), w8a16, c], sort_keys=True)
                        if key not in seen:
                            seen.add(key)
                            out.append((f"candidate {stage}", b))
    return out


def check(label: str, rep: dict | None) -> int:
    if rep is None:
        return 1
    bad = []
    if rep["spills"]:
        bad.append(f"spills {rep['spills']} bytes")
    if rep["smem"] > SMEM_LIMIT:
        bad.append(f"shared memory {rep['smem']} > {SMEM_LIMIT}")
    if bad:
        print(f"OVER {label}: {', '.join(bad)}", flush=True)
    return int(bool(bad))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=None, help="a config directory (tune_moe.py --fp8 --out)")
    ap.add_argument("--candidates", action="store_true", help="also every tile tune_moe.py --fp8 may time")
    args = ap.parse_args()
    fails = 0
    for where, b in buckets(args.dir):
        dtypes = ("bf16", "fp16")
        for dtype in dtypes:
            for stage in ("gate_up", "down"):
                fails += check(f"{where} {stage} {dtype}", cc8.check_gemm(90, "sm90", b, stage, dtype, label=where))
        # the in-load quantization of a default bucket, for A/B runs (a swept shape entry's was timed
        # against the quantize pass by the sweep, which keeps the quantize pass where in-load does not fit)
        if not b.get("w8a16", False) and b.get("quant_x", True) and not where.startswith("shapes["):
            fails += check(f"{where} gate_up in-load", cc8.check_gemm(90, "sm90", {**b, "quant_x": False}, "gate_up",
                                                                      label=f"{where} quant_x=false"))
    fails += check("quantize", cc8.check_quantize(90))
    for where, b in buckets(args.dir):
        for entry, d in (("decode", b.get("decode")), ("fallback", (b.get("decode") or {}).get("fallback"))):
            for stage in ("gate_up", "down") if d else ():
                c = d[stage]
                fails += check(f"{where} {entry} {stage}", cc8.check_decode(90, stage, c, label=where))
                if c.get("GLUON", False):
                    fails += check(f"{where} {entry} gluon {stage}", cc8.check_decode_gluon(stage, c, label=where))
    if args.candidates:
        for stage in ("gate_up", "down"):
            for c in tune_module().fp8_decode_space(stage):
                fails += check(f"candidate decode {stage} {c}", cc8.check_decode(90, stage, c, label="candidate"))
                if c.get("GLUON", False):
                    fails += check(f"candidate decode gluon {stage} {c}",
                                   cc8.check_decode_gluon(stage, c, label="candidate"))
        for where, b in candidates():
            stage = where.split()[-1]
            fails += check(f"{where} {b[stage]}", cc8.check_gemm(90, "sm90", b, stage, label=where))
    print(f"over budget or failed: {fails}")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
