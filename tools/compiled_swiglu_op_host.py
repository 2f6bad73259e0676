"""Host time of one compiled call of the SwiGLU op on CPU: the custom op with autograd (what a
compiled training graph calls) against the inference op (a plain `torch.library.Library` op, what
a compiled no_grad graph calls). On CPU the op body is the torch reference, the same in both, so
the difference is the op's own layers. Three rounds, alternating; us per call of
`torch.compile(fullgraph=True)` of a function calling the op on [1, 128] fp32 tensors.

Usage (repo root): PYTHONPATH=src python tools/compiled_swiglu_op_host.py
"""

from __future__ import annotations

import importlib
import time

import torch

from kernelhub.default_mapping import bundled_kernels_dir
from kernelhub.hub import get_local_kernel


def main() -> None:
    swiglu = get_local_kernel(bundled_kernels_dir() / "swiglu", "swiglu")
    ops = importlib.import_module(swiglu.__name__ + "._custom_ops")
    g, u = torch.randn(1, 128), torch.randn(1, 128)
    times: dict[str, list[float]] = {}
    for _ in range(3):
        for name, op in (("custom_op (autograd)", ops._swiglu_op), ("inference op", ops._swiglu_infer_op)):
            torch._dynamo.reset()
            f = torch.compile(lambda g, u, op=op: op(g, u, "auto"), fullgraph=True)
            with torch.no_grad():
                for _ in range(100):
                    f(g, u)
                n = 20000
                t0 = time.perf_counter()
                for _ in range(n):
                    f(g, u)
                times.setdefault(name, []).append((time.perf_counter() - t0) / n * 1e6)
    for name, ts in times.items():
        print(f"{name:22s} " + " ".join(f"{t:6.1f}" for t in ts) + "  us per compiled call")


if __name__ == "__main__":
    main()
