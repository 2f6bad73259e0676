"""Compile the fp8-experts grouped GEMM for sm90, sm89 and sm80 without a GPU (Triton AOT to cubin).

The kernel `_fp8_experts.py` launches, with the constexprs it passes per variant: "sm90" (fp8
tl.dot, activations quantized in the load and in the SwiGLU epilogue) for sm90 and sm89, "sm80"
(W8A16: fp8 weights converted in registers) for sm80, for each activation dtype. The interpreter
never runs the GPU code path (EMULATE=False), so this is where its fp8 casts and dots are checked.
Usage (repo root, TRITON_INTERPRET unset):
    PYTHONPATH=src python kernels_repo/moe/benchmarks/compile_check_fp8.py
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compile_check as cc  # noqa: E402  (pops TRITON_INTERPRET and loads the kernel package)

fp8k = importlib.import_module(cc.moe.__name__ + "._fp8_experts")  # (imported on the first fp8 call)
kern = importlib.import_module(cc.moe.__name__ + "._fp8_kernels")

def fp8_gemm(cap: int, variant: str, epilogue: int, dtype: str) -> int | None:
    """One launch shape of `_fp8_experts._gemm`: gate/up (epilogue 1, gathers x) or down (epilogue 0)."""
    tiles = fp8k._TILES[variant]
    fp8_dot = variant == "sm90"
    gate_up = epilogue == 1
    a_dtype = dtype if (gate_up or not fp8_dot) else "fp8e4nv"  # sm90's down GEMM reads the fp8 h
    c_dtype = ("fp8e4nv" if fp8_dot else dtype) if gate_up else dtype
    sig = {"a_ptr": f"*{a_dtype}", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv" if fp8_dot else "*u8",  # (W8A16: bits)
           "bs_ptr": "*fp32", "c_ptr": f"*{c_dtype}", "cs_ptr": "*fp32", "rows_ptr": "*i32", "row_expert_ptr": "*i32"}
    const = dict(EPILOGUE=epilogue, GATHER_A=gate_up, TOPK=8, FP8_DOT=fp8_dot, QUANT_A=fp8_dot and gate_up,
                 QUANT_C=fp8_dot and gate_up, EMULATE=False, PRECISION="ieee" if dtype == "fp32" else None,
                 SCALE_N=128, BLOCK_M=tiles["block_m"], BLOCK_N=tiles["BLOCK_N"], BLOCK_K=128)
    full = {n: sig.get(n, "constexpr" if n in const else cc.I32) for n in kern._fp8_gemm_kernel.arg_names}
    label = f"fp8 {variant} {'gate_up' if gate_up else 'down'} x={dtype} {tiles}"
    return cc.compile_one(kern._fp8_gemm_kernel, full, const, cap, tiles["num_warps"], tiles["num_stages"], label)


def backward_gemm(cap: int, gather: bool) -> int | None:
    """A launch of `_fp8_experts.backward` (W8A16 on every card): gathered 16-bit rows (x, dY) or the
    fp32 d[gate | up] rows, fp32 out."""
    tiles = fp8k._TILES["sm80"]
    a_dtype = "bf16" if gather else "fp32"
    sig = {"a_ptr": f"*{a_dtype}", "as_ptr": "*fp32", "b_ptr": "*u8", "bs_ptr": "*fp32", "c_ptr": "*fp32",
           "cs_ptr": "*fp32", "rows_ptr": "*i32", "row_expert_ptr": "*i32"}
    const = dict(EPILOGUE=0, GATHER_A=gather, TOPK=8, FP8_DOT=False, QUANT_A=False, QUANT_C=False, EMULATE=False,
                 PRECISION="ieee" if a_dtype == "fp32" else None, SCALE_N=128, BLOCK_M=tiles["block_m"],
                 BLOCK_N=tiles["BLOCK_N"], BLOCK_K=128)
    full = {n: sig.get(n, "constexpr" if n in const else cc.I32) for n in kern._fp8_gemm_kernel.arg_names}
    return cc.compile_one(kern._fp8_gemm_kernel, full, const, cap, tiles["num_warps"], tiles["num_stages"],
                          f"fp8 backward gather={gather} a={a_dtype}")


def main() -> None:
    fails = 0
    # every activation dtype of each variant on its main target; bf16 on the cards sharing it
    for cap, variant, dtypes in ((90, "sm90", ("bf16", "fp16")), (89, "sm90", ("bf16",)),
                                 (80, "sm80", ("bf16", "fp16", "fp32")), (86, "sm80", ("bf16",))):
        for dtype in dtypes:
            for epilogue in (1, 0):
                fails += fp8_gemm(cap, variant, epilogue, dtype) is None
    for cap in (90, 80):
        for gather in (True, False):
            fails += backward_gemm(cap, gather) is None
    print(f"failures: {fails}")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
