"""Distributed pieces: a symmetric workspace allocator and expert-parallel MoE dispatch/combine."""

from kernelhub.distributed.symmetric_heap import (
    CHECK_ENV,
    Allocation,
    AllocationSymmetryError,
    SymmetricHeap,
    SymmetricHeapFullError,
)

__all__ = [
    "CHECK_ENV",
    "Allocation",
    "AllocationSymmetryError",
    "SymmetricHeap",
    "SymmetricHeapFullError",
]
