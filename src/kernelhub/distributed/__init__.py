"""Distributed pieces: a symmetric workspace allocator and expert-parallel MoE dispatch/combine."""

from kernelhub.distributed.expert_parallel import (
    EPDispatch,
    EPHandle,
    ExpertParallelMoE,
    ep_combine,
    ep_dispatch,
    ep_moe,
    local_expert_range,
    reference_experts,
)
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
    "EPDispatch",
    "EPHandle",
    "ExpertParallelMoE",
    "ep_combine",
    "ep_dispatch",
    "ep_moe",
    "local_expert_range",
    "reference_experts",
    "AllocationSymmetryError",
    "SymmetricHeap",
    "SymmetricHeapFullError",
]
