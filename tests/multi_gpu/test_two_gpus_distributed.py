"""kernelhub.distributed on two GPUs: CUDA symmetric memory and EP MoE over NCCL.

Run on a machine with >= 2 GPUs:
    KERNELHUB_TEST_GPU=1 TRITON_INTERPRET=0 PYTHONPATH=src pytest -q -m multigpu tests/multi_gpu
NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared harness lives in tests/

from _distributed_harness import run_ranks  # noqa: E402
from _distributed_scenarios import LAYOUT, assert_matches_single_process, moe_case, pattern  # noqa: E402

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 CUDA GPUs"),
]
_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def test_cuda_peer_writes_and_reads_land_in_the_same_allocation():
    results = run_ranks("peer_reads_and_writes", 2, backend="nccl", env=_ENV, device="cuda", timeout=180)
    for rank, res in enumerate(results):
        for (peer, i), got in res["reads"].items():
            assert torch.equal(got, pattern(peer, i, *LAYOUT[i])), (rank, peer, i)
        assert res["same_ptr"]
        src = (rank - 1) % 2
        want = [pattern(rank, i, *LAYOUT[i]) for i in range(len(LAYOUT))]
        want[0][src % 3] = -(src + 1)
        for i, got in enumerate(res["after_write"]):
            assert torch.equal(got, want[i]), (rank, i)


def test_cuda_divergent_allocation_is_caught_on_both_ranks():
    results = run_ranks(
        "divergent_allocation",
        2,
        backend="nccl",
        env={**_ENV, "KERNELHUB_CHECK_ALLOC_SYMMETRY": "1"},
        at=0,
        timeout=180,
    )
    for res in results:
        kind, msg = res["error"]
        assert kind == "AllocationSymmetryError"
        assert "allocation #0 (0-based)" in msg and "rank 1: offset=0 nbytes=64" in msg


def test_cuda_count_divergence_is_caught_by_barrier():
    results = run_ranks("divergent_allocation", 2, backend="nccl", env=_ENV, at=1, via="barrier", timeout=180)
    for res in results:
        kind, msg = res["error"]
        assert kind == "AllocationSymmetryError"
        assert "rank 0: 3 allocations" in msg and "rank 1: 4 allocations" in msg


def test_ep_moe_over_nccl_equals_the_single_process_moe():
    results = run_ranks("ep_forward_backward", 2, backend="nccl", env=_ENV, device="cuda", timeout=240)
    assert all(got["backend"] == "nccl" for got in results)
    # fp32 on the GPU: TF32 is off by default for matmuls, so fp32 tolerances hold.
    assert_matches_single_process(results, moe_case(2), 2, rtol=1e-5, atol=1e-5)
