"""kernelhub.distributed on 2 and 4 CPU ranks (gloo, shared memory); world size 1 on a GPU.

Every multi-rank test runs its ranks in fresh processes, bounded in time (see
_distributed_harness.py); the per-rank bodies live in _distributed_scenarios.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from _distributed_harness import run_ranks
from _distributed_scenarios import LAYOUT, assert_matches_single_process, moe_case, pattern, single_process_moe

from kernelhub.distributed import SymmetricHeap, ep_dispatch, reference_experts

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")


# -- SymmetricHeap --------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 4])
def test_peer_reads_and_writes_land_in_the_same_allocation_on_the_peer(world):
    results = run_ranks("peer_reads_and_writes", world)
    for rank, res in enumerate(results):
        for (peer, i), got in res["reads"].items():
            shape, dtype = LAYOUT[i]
            assert torch.equal(got, pattern(peer, i, shape, dtype)), (rank, peer, i)
        for peer, got in res["strided"].items():
            assert torch.equal(got, pattern(peer, 0, *LAYOUT[0])[1:, ::2])
        assert res["same_ptr"]
        assert all(off % 256 == 0 for off in res["offsets"])
        assert res["closed"] and not res["holds_group"]
        # Rank (rank - 1) wrote row (rank - 1) % 3 of allocation 0 here; nothing else changed.
        src = (rank - 1) % world
        want = [pattern(rank, i, *LAYOUT[i]) for i in range(len(LAYOUT))]
        want[0][src % 3] = -(src + 1)
        for i, got in enumerate(res["after_write"]):
            assert torch.equal(got, want[i]), (rank, i)


@pytest.mark.parametrize("world,at", [(2, 0), (4, 1)])
def test_out_of_order_allocation_raises_on_every_rank_with_the_check_on(world, at):
    results = run_ranks("divergent_allocation", world, env={"KERNELHUB_CHECK_ALLOC_SYMMETRY": "1"}, at=at)
    bad = world - 1
    for res in results:
        assert res["check"]
        kind, msg = res["error"]
        assert kind == "AllocationSymmetryError"
        assert f"allocation #{at} (0-based)" in msg
        assert f"rank(s) {bad}" in msg
        # Both sides' values: rank 0's float32 block and the last rank's scratch bytes.
        assert f"rank 0: offset={at * 1024} nbytes=1024 dtype=torch.float32 shape=(8, 32) tag='a{at}'" in msg
        assert f"rank {bad}: offset={at * 1024} nbytes=64 dtype=torch.uint8 shape=(64,) tag='scratch'" in msg
        assert res["allocations"] == at  # nothing was recorded past the divergence


@pytest.mark.parametrize("world,via", [(2, "barrier"), (4, "close")])
def test_count_divergence_is_caught_by_barrier_and_close_without_the_check(world, via):
    results = run_ranks("divergent_allocation", world, at=1, via=via)
    for res in results:
        assert not res["check"]
        kind, msg = res["error"]
        assert kind == "AllocationSymmetryError"
        assert f"SymmetricHeap.{via}" in msg
        assert "rank 0: 3 allocations, 3072 bytes" in msg
        assert f"rank {world - 1}: 4 allocations, 3328 bytes" in msg
        assert "KERNELHUB_CHECK_ALLOC_SYMMETRY=1" in msg


def test_without_any_check_a_divergent_heap_passes_silently_until_barrier():
    # The failure mode the check exists for: allocation succeeds on every rank.
    results = run_ranks("divergent_allocation", 2, at=0, via="none")
    assert [r["error"] for r in results] == [("no error", ""), ("no error", "")]
    assert [r["allocations"] for r in results] == [3, 4]


def test_allocations_are_aligned_and_out_of_space_names_the_sizes():
    res = run_ranks("alignment_and_full", 2)
    for r in res:
        assert r["offsets_128"] == [0, 128, 256]
        kind, msg = r["full"]
        assert kind == "SymmetricHeapFullError"
        for part in (
            "700 bytes",
            "tag 'big'",
            "offset 384",
            "capacity 1000",
            "288 bytes used by 3 allocations",
            "616 free",
        ):
            assert part in msg, (part, msg)
        assert r["count_after_full"] == 3
        assert (r["last_offset"], r["last_numel"]) == (384, 616)
        assert r["after_exact_fill"][0] == "SymmetricHeapFullError"
        assert r["offsets_1"] == [0, 8, 16]


def test_ranks_created_with_different_sizes_raise_on_every_rank():
    for kind, msg in run_ranks("mismatched_settings", 2):
        assert kind == "ValueError"
        assert "rank 0: nbytes=1024" in msg and "rank 1: nbytes=1280" in msg


@pytest.mark.parametrize(
    "kwargs,exc,fragment",
    [
        ({"nbytes": 0}, ValueError, "`nbytes` must be > 0"),
        ({"nbytes": 1.5}, TypeError, "`nbytes` must be an int"),
        ({"nbytes": 64, "alignment": 3}, ValueError, "`alignment` must be a power of two"),
    ],
)
def test_bad_heap_arguments_raise_before_any_collective(kwargs, exc, fragment):
    nbytes = kwargs.pop("nbytes")
    with pytest.raises(exc, match=fragment):
        SymmetricHeap(nbytes, **kwargs)


def test_heap_needs_an_initialised_process_group():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        SymmetricHeap(64)


# -- expert parallelism ---------------------------------------------------------------------------
@pytest.mark.parametrize("world,dtype", [(1, "float32"), (2, "float32"), (4, "float32"), (2, "bfloat16")])
def test_ep_moe_forward_and_backward_equal_the_single_process_moe(world, dtype):
    results = run_ranks("ep_forward_backward", world, dtype=dtype)
    case = moe_case(world, dtype=getattr(torch, dtype))
    # bf16: each rank rounds its partial sum once before the fp32 sum over ranks (~1 ulp more).
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == "float32" else {"rtol": 1.6e-2, "atol": 1.6e-2}
    assert_matches_single_process(results, case, world, **tol)
    if world == 4:  # the case routes nothing to rank 3's experts: their gradient is exactly zero
        assert torch.count_nonzero(results[3]["grad_gate_up"]) == 0
        assert results[1]["out"].shape[0] == 0


def test_invalid_routing_on_one_rank_raises_on_every_rank():
    for kind, msg in run_ranks("invalid_routing", 2):
        assert kind == "ValueError"
        assert "outside [-1, 8) on rank(s) [1]" in msg


def test_reference_experts_skips_minus_one_and_matches_a_dense_loop():
    case = moe_case(2)
    r = case["ranks"][0]
    gu, dn = case["gate_up_proj"], case["down_proj"]
    got = reference_experts(r["x"], gu, dn, r["topk_idx"], r["topk_weights"])
    want = torch.zeros_like(r["x"])
    for t in range(r["x"].shape[0]):
        for k in range(r["topk_idx"].shape[1]):
            e = int(r["topk_idx"][t, k])
            if e < 0:
                continue
            gate, up = (gu[e] @ r["x"][t]).chunk(2)
            want[t] += r["topk_weights"][t, k] * (dn[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "change,exc,fragment",
    [
        ({"topk_idx": lambda r: r["topk_idx"].int()}, TypeError, "ep_dispatch: `topk_idx` must be int64"),
        ({"x": lambda r: r["x"][0]}, ValueError, "ep_dispatch: `x` must be a floating"),
        ({"topk_weights": lambda r: r["topk_weights"][:, :2]}, ValueError, "must both be"),
        ({"num_experts": lambda r: 0}, ValueError, "ep_dispatch: `num_experts` must be an int > 0"),
    ],
)
def test_ep_dispatch_rejects_bad_arguments_before_any_collective(change, exc, fragment):
    r = moe_case(2)["ranks"][0]
    args = {"x": r["x"], "topk_idx": r["topk_idx"], "topk_weights": r["topk_weights"], "num_experts": 8}
    args.update({k: f(r) for k, f in change.items()})
    with pytest.raises(exc, match=fragment):
        ep_dispatch(**args)


def test_reference_experts_rejects_int32_routing_and_weights_on_another_device():
    case = moe_case(2)
    r = case["ranks"][0]
    with pytest.raises(TypeError, match="reference_experts: `topk_idx` must be int64"):
        reference_experts(
            r["x"], case["gate_up_proj"], case["down_proj"], r["topk_idx"].int(), r["topk_weights"]
        )
    with pytest.raises(ValueError, match="reference_experts: `down_proj` must be on cpu like `x`, got meta"):
        reference_experts(
            r["x"], case["gate_up_proj"], case["down_proj"].to("meta"), r["topk_idx"], r["topk_weights"]
        )


# -- one GPU, world size 1
# Run: KERNELHUB_TEST_GPU=1 TRITON_INTERPRET=0 pytest -m gpu tests/test_distributed.py
_GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


@pytest.mark.gpu
def test_gpu_symmetric_heap_world_size_one():
    (res,) = run_ranks("peer_reads_and_writes", 1, backend="nccl", env=_GPU_ENV, device="cuda", timeout=120)
    assert res["same_ptr"]
    for (peer, i), got in res["reads"].items():
        assert torch.equal(got, pattern(peer, i, *LAYOUT[i]))
    want = pattern(0, 0, *LAYOUT[0])
    want[0] = -1
    assert torch.equal(res["after_write"][0], want)


@pytest.mark.gpu
@pytest.mark.parametrize("experts", ["reference", "fused"])
def test_gpu_ep_moe_world_size_one_equals_single_process(experts):
    repo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels_repo", "moe")
    if experts == "fused" and not os.path.isdir(repo):
        pytest.skip("kernels_repo/moe is not in this checkout")
    (got,) = run_ranks(
        "ep_forward_backward", 1, backend="nccl", env=_GPU_ENV, device="cuda", experts=experts, timeout=180
    )
    (want,) = single_process_moe(moe_case(1))
    tol = {"rtol": 1e-4, "atol": 1e-4} if experts == "fused" else {"rtol": 1e-5, "atol": 1e-5}
    for key in ("out", "grad_x", "grad_w", "grad_gate_up", "grad_down"):
        torch.testing.assert_close(got[key], want[key], **tol, msg=lambda m, k=key: f"{k}: {m}")


# -- edges found by fuzzing -----------------------------------------------------------------------
def test_zero_size_peers_and_a_tensor_used_after_close():
    results = run_ranks("heap_edges", 2)
    for rank, res in enumerate(results):
        assert res["empty_peer"] == (0, 4) and res["empty_view_peer"] == (0,)
        assert torch.equal(res["peer_values"], torch.full((8,), float((rank + 1) % 2 + 1)))
        assert res["after_close"] == 8.0 * (rank + 1)  # the process did not crash (it used to)


@pytest.mark.parametrize(
    ("case_name", "kind", "words"),
    [
        ("down_inner", "ValueError", "ep_moe: `down_proj` must be [4, 16, 12], got (4, 16, 13)"),
        ("weights_dtype", "TypeError", "ep_moe: `gate_up_proj_local` must have x's dtype"),
        ("float_num_experts", "ValueError", "ep_moe: `num_experts` must be an int > 0"),
    ],
)
def test_bad_ep_moe_inputs_raise_on_every_rank_even_where_no_rows_arrive(case_name, kind, words):
    """Checked before the dispatch on every rank: a rank that receives no rows does not call
    experts_fn, so an error from there alone left the other ranks waiting in a collective."""
    results = run_ranks("ep_errors", 2, case_name=case_name, timeout=60)
    for err in results:
        assert err[0] == kind and words in err[1], err


def test_an_experts_fn_of_another_dtype_comes_back_in_xs_dtype():
    for res in run_ranks("ep_output_dtype", 2):
        assert res["dtype"] == "torch.bfloat16"


@pytest.mark.parametrize(("what", "words"), [("num_experts", "ranks disagree on `num_experts` (rank 0: 8, rank 1: 16)"),
                                             ("dtype", "ranks disagree on dtypes")])
def test_ranks_that_disagree_on_experts_or_dtypes_raise_on_every_rank(what, words):
    for err in run_ranks("ep_disagreement", 2, what=what):
        assert err[0] == "ValueError" and words in err[1], err


# -- one rank fails: every rank raises, within seconds (issue 30) ---------------------------------
# The ranks' collectives time out after _OP_TIMEOUT s: a rank left waiting for the failing one
# ends in a gloo timeout error, not in the expected message, and the test fails in seconds.
_OP_TIMEOUT = 5.0


@pytest.fixture(scope="module")
def ep_failures():
    return run_ranks("one_rank_fails_in_ep", 2, op_timeout=_OP_TIMEOUT, timeout=120)


@pytest.mark.parametrize(
    ("case_name", "on_rank_1", "on_rank_0"),
    [
        # between the dispatch and the combine: exchanged before the combine
        ("experts_raise", ("RuntimeError", "boom in experts_fn"),
         ("RuntimeError", "ep_moe failed on rank(s) [1], so every rank raises (this is rank 0): "
                          "rank 1: RuntimeError: boom in experts_fn")),
        ("experts_shape", ("ValueError", "ep_moe: `experts_fn` must return a floating ["),
         ("ValueError", "ep_moe failed on rank(s) [1]")),
        ("combine_rows", ("ValueError", "ep_combine: `expert_out` must be ["),
         ("ValueError", "ep_combine failed on rank(s) [1]")),
        # before the first collective: carried by the dispatch's metadata exchange
        ("weight_shape", ("ValueError", "ep_moe: `down_proj` must be [4, 16, 12], got (4, 16, 11)"),
         ("ValueError", "ep_moe failed on rank(s) [1]")),
        ("meta", ("ValueError", "ep_dispatch: `x` is on the meta device"),
         ("ValueError", "ep_dispatch failed on rank(s) [1]")),
        ("int32_idx", ("TypeError", "ep_dispatch: `topk_idx` must be int64"),
         ("TypeError", "rank 1: TypeError: ep_dispatch: `topk_idx` must be int64")),
        ("indivisible_experts", ("ValueError", "ep_dispatch: `num_experts` (7) must be divisible"),
         ("ValueError", "ep_dispatch failed on rank(s) [1]")),
    ],
)
def test_an_ep_error_on_one_rank_raises_on_every_rank(ep_failures, case_name, on_rank_1, on_rank_0):
    rank0, rank1 = (r[case_name] for r in ep_failures)
    assert rank1[0] == on_rank_1[0] and on_rank_1[1] in rank1[1], rank1
    assert rank0[0] == on_rank_0[0] and on_rank_0[1] in rank0[1], rank0
    assert on_rank_1[1] in rank0[1], rank0  # the peers see the failing rank's own message


def test_ranks_that_combine_rows_of_different_widths_raise_on_every_rank(ep_failures):
    for kind, msg in (r["combine_width"] for r in ep_failures):
        assert kind == "ValueError" and "ranks disagree on `expert_out`'s width or dtype" in msg, msg
        assert "rank 0: H=16 float32, rank 1: H=15 float32" in msg, msg


def test_the_group_still_works_after_ep_errors_on_one_rank(ep_failures):
    assert [r["after"] for r in ep_failures] == [("shape", "(5, 16)"), ("shape", "(8, 16)")]


@pytest.fixture(scope="module")
def heap_failures():
    return run_ranks("one_rank_fails_in_heap", 2, op_timeout=_OP_TIMEOUT, timeout=120)


@pytest.mark.parametrize(
    ("case_name", "on_rank_1", "on_rank_0"),
    [
        ("alignment", ("ValueError", "SymmetricHeap: `alignment` must be a power of two, got 3"),
         ("ValueError", "SymmetricHeap failed on rank(s) [1]")),
        ("nbytes_type", ("TypeError", "SymmetricHeap: `nbytes` must be an int, got float"),
         ("TypeError", "SymmetricHeap failed on rank(s) [1]")),
        ("device", ("ValueError", "`device` is cuda:0, but CUDA is not available"),
         ("ValueError", "SymmetricHeap failed on rank(s) [1]")),
        ("env", ("ValueError", "KERNELHUB_CHECK_ALLOC_SYMMETRY='enabled' is not a boolean"),
         ("ValueError", "SymmetricHeap failed on rank(s) [1]")),
        ("allocate_checked", ("ValueError", "SymmetricHeap.allocate: `shape` must hold ints >= 0, got (-1,)"),
         ("ValueError", "SymmetricHeap.allocate failed on rank(s) [1]")),
    ],
)
def test_heap_arguments_wrong_on_one_rank_raise_on_every_rank(heap_failures, case_name, on_rank_1, on_rank_0):
    if case_name == "device" and torch.cuda.is_available():
        pytest.skip("the case needs a machine without CUDA")
    rank0, rank1 = (r[case_name] for r in heap_failures)
    assert rank1[0] == on_rank_1[0] and on_rank_1[1] in rank1[1], rank1
    assert rank0[0] == on_rank_0[0] and on_rank_0[1] in rank0[1] and on_rank_1[1] in rank0[1], rank0
    if case_name == "allocate_checked":  # nothing was recorded on either rank: close() agreed
        assert [r["allocations_checked"] for r in heap_failures] == [("count", "0")] * 2


@pytest.mark.parametrize(("case_name", "size"), [("huge", 1 << 50), ("larger_than_shm", 1 << 40)])
def test_a_heap_larger_than_shared_memory_names_its_size(heap_failures, case_name, size):
    for kind, msg in (r[case_name] for r in heap_failures):
        assert kind == "MemoryError", msg
        assert f"SymmetricHeap: {size} bytes per rank x 2 ranks do not fit in" in msg
    assert [r["after"] for r in heap_failures] == [("allocated", "(4,)")] * 2
