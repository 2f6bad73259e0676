"""Compile the GPU kernels for sm80 and sm90 without a GPU; print what the hardware would run.

Run in a process without TRITON_INTERPRET (the test does). For each (variant, pass, shape) it
prints one JSON line: the launch config, the global load/store instructions in the PTX (16-byte
vectors are `.v4.b32`), ptxas's register and spill report, and whether the SASS issues all of a
tile's loads before computing on any of them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

REPO = Path(__file__).resolve().parents[1] / "kernels_repo" / "swiglu"
CONSTEXPRS = ("BLOCK_M", "BLOCK_N", "EVEN_N", "PACKED")
UNIT_STRIDES = ("stride_gn", "stride_un", "stride_dyn")


def probe(mod, backward: bool, capability: int, M: int, N: int, packed: bool, dtype: str) -> dict:
    kernel = mod.bwd_kernel if backward else mod.fwd_kernel
    elem = {"bf16": 2, "fp16": 2, "fp32": 4}[dtype]
    block_m, block_n, num_warps, grid = mod.config(M, N, elem, 132, backward)
    values = {"BLOCK_M": block_m, "BLOCK_N": block_n, "EVEN_N": N % block_n == 0, "PACKED": packed}
    n_ptr = 5 if backward else 3
    signature, constexprs, attrs = {}, {}, {}
    # the specialization of a contiguous launch: aligned pointers, unit column strides, other
    # ints divisible by 16 except M
    for i, name in enumerate(kernel.arg_names):
        if i < n_ptr:
            signature[name] = "*" + dtype
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in CONSTEXPRS or name in UNIT_STRIDES:
            signature[name] = "constexpr"
            constexprs[(i,)] = values.get(name, 1)
        else:
            signature[name] = "i32"
            if name != "M":
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                              target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": num_warps, **mod.OPTIONS})
    ptx = compiled.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        Path(src).write_text(ptx)
        arch = "sm_90a" if capability == 90 else f"sm_{capability}"
        report = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", src, "-o", os.path.join(tmp, "k.cubin")],
                                capture_output=True, text=True, check=True).stderr
        tool = os.path.join(os.path.dirname(ptxas), "cuobjdump")
        sass = subprocess.run([tool, "-sass", os.path.join(tmp, "k.cubin")], capture_output=True, text=True,
                              check=True).stdout
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    # memory-level parallelism: no transcendental (sigmoid's MUFU) between a tile's first and last load
    ops = re.findall(r"\b(LDG|MUFU)\b", sass)
    loads = [i for i, op in enumerate(ops) if op == "LDG"]
    loads_up_front = "MUFU" not in ops[loads[0]:loads[-1]]
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill", report)]
    return {
        "variant": mod.__name__.rsplit(".", 1)[-1], "backward": backward, "M": M, "N": N, "packed": packed,
        "dtype": dtype, "config": [block_m, block_n, num_warps, grid], "maxnreg": mod.OPTIONS.get("maxnreg"),
        "loads": dict(Counter(re.findall(r"ld\.global[.\w]*", ptx))),
        "stores": dict(Counter(re.findall(r"st\.global[.\w]*", ptx))),
        "registers": regs, "spill_bytes": sum(spills), "loads_up_front": loads_up_front,
    }


def main() -> None:
    sys.path.insert(0, str(REPO.parents[1] / "src"))
    from kernelhub.hub import get_local_kernel

    kernel = get_local_kernel(REPO)
    variants = {80: sys.modules[kernel.__name__ + "._sm80"], 90: sys.modules[kernel.__name__ + "._sm90"]}
    for capability, mod in variants.items():
        for backward in (False, True):
            for M, N, packed, dtype in [(8192, 14336, False, "bf16"), (4096, 6144, True, "bf16"),
                                        (32768, 4096, False, "fp32")]:
                print(json.dumps(probe(mod, backward, capability, M, N, packed, dtype)), flush=True)


if __name__ == "__main__":
    main()
