"""`Benchmark`: the base class of a kernel's benchmark script, as Hugging Face `kernels` defines it.

A subclass sets up tensors in `setup()`, times `benchmark_<name>()` methods and checks each against
`verify_<name>()` (a reference tensor compared with `self.out`). The runner that `kernels benchmark
<repo_id>` provides sets `kernel` and `device`; kernelhub has no such runner (its benchmarks/
compare against peers), so this class is here for scripts written for `kernels` to import.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Benchmark"]


class Benchmark:
    """Base class for kernel benchmarks (`kernels.Benchmark`): `seed`, `device`, `kernel`, `out`, `setup()`."""

    seed: int | None = None  # for reproducibility, where set
    device: str = "cpu"  # set by the runner

    def __init__(self) -> None:
        self.kernel: Any = None  # the kernel under test, set by the runner
        self.out: Any = None  # the output tensor, set by setup methods

    def setup(self) -> None:
        """Override to create the inputs (and `self.out`) as attributes."""
