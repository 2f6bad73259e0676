"""Per-rank bodies of the distributed tests (run by `_distributed_harness.run_ranks`).

Each returns plain data (CPU tensors, strings) so the parent test asserts on it; expected errors
are caught here and returned as (type name, message), unexpected ones fail the run.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from kernelhub.distributed import (
    ExpertParallelMoE,
    SymmetricHeap,
    ep_combine,
    ep_dispatch,
    ep_moe,
    local_expert_range,
    reference_experts,
)

# (shape, dtype) of the allocations the peer tests make: mixed sizes so alignment matters.
LAYOUT = [((3, 5), torch.float32), ((7,), torch.int64), ((4, 4), torch.bfloat16), ((3,), torch.uint8)]


def pattern(rank: int, index: int, shape, dtype) -> torch.Tensor:
    """What `rank` writes into its allocation number `index`: distinct per rank and allocation."""
    n = 1
    for d in shape:
        n *= d
    values = torch.arange(n, dtype=torch.float64) % 50 + 1000 * rank + 100 * index
    if dtype == torch.uint8:
        values = (torch.arange(n) + 40 * rank + 7 * index) % 256
    return values.reshape(shape).to(dtype)


def _caught(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test asserts on the type name
        return type(e).__name__, str(e)
    return "no error", ""


def peer_reads_and_writes(rank: int, world: int, device: str = "cpu") -> dict[str, Any]:
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    out: dict[str, Any] = {}
    with SymmetricHeap(1 << 14, device=dev) as heap:
        ts = [heap.allocate(shape, dtype, tag=f"t{i}") for i, (shape, dtype) in enumerate(LAYOUT)]
        for i, t in enumerate(ts):
            t.copy_(pattern(rank, i, t.shape, t.dtype))
        heap.barrier()
        # Reads: every peer's allocation i, through peer() of the local one.
        out["reads"] = {(r, i): heap.peer(t, r).cpu().clone() for r in range(world) for i, t in enumerate(ts)}
        out["strided"] = {r: heap.peer(ts[0][1:, ::2], r).cpu().clone() for r in range(world)}
        out["same_ptr"] = heap.peer(ts[0], rank).data_ptr() == ts[0].data_ptr()
        out["offsets"] = [a.offset for a in heap.allocations]
        heap.barrier()
        # Writes: rank r writes -(r+1) into row r of allocation 0 on rank (r+1) % world.
        dst = (rank + 1) % world
        heap.peer(ts[0], dst)[rank % 3].fill_(-(rank + 1))
        heap.barrier()
        out["after_write"] = [t.cpu().clone() for t in ts]
    out["closed"] = heap.closed
    out["holds_group"] = heap._group is not None  # it must not outlive destroy_process_group
    return out


def divergent_allocation(rank: int, world: int, at: int, via: str = "allocate") -> dict[str, Any]:
    """The last rank allocates a private scratch buffer before allocation number `at`."""
    heap = SymmetricHeap(1 << 14)
    outcome = {"check": heap.check_symmetry}

    def body():
        for i in range(3):
            if i == at and rank == world - 1:
                heap.allocate(64, torch.uint8, tag="scratch")
            heap.allocate((8, 32), torch.float32, tag=f"a{i}")
        if via == "barrier":
            heap.barrier()
        elif via == "close":
            heap.close()

    outcome["error"] = _caught(body)
    outcome["allocations"] = len(heap.allocations)
    heap._release()  # the heap is broken; release locally, without collectives
    return outcome


def alignment_and_full(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with SymmetricHeap(1000, alignment=128) as heap:
        heap.allocate(3, torch.uint8)
        heap.allocate(5, torch.float32)
        heap.allocate((2, 2), torch.float64)
        out["offsets_128"] = [a.offset for a in heap.allocations]
        out["full"] = _caught(lambda: heap.allocate(700, torch.uint8, tag="big"))
        out["count_after_full"] = len(heap.allocations)
        last = heap.allocate(1000 - 384, torch.uint8)  # exactly fills the heap
        out["last_offset"] = heap.allocations[-1].offset
        out["last_numel"] = last.numel()
        out["after_exact_fill"] = _caught(lambda: heap.allocate(1, torch.uint8))
    with SymmetricHeap(64, alignment=1) as heap:
        heap.allocate(3, torch.uint8)
        heap.allocate(1, torch.float64)  # dtype alignment still applies
        heap.allocate(1, torch.int16)
        out["offsets_1"] = [a.offset for a in heap.allocations]
    return out


def mismatched_settings(rank: int, world: int) -> tuple[str, str]:
    return _caught(lambda: SymmetricHeap(1024 + 256 * (rank == 1)))


def moe_case(world: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Weights and per-rank routed tokens; identical in the parent and every rank (seeded).

    One rank has no tokens; with 4 ranks nothing is routed to the last rank's experts (it receives
    no rows); a few slots are -1 ("no expert").
    """
    g = torch.Generator().manual_seed(seed)
    E, H, I, K = 8, 16, 12, 3
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=g) * I**-0.5).to(dtype)
    allowed = torch.arange(E) if world < 4 else torch.arange(E - E // world)
    ranks = []
    for r in range(world):
        T = 0 if (world > 2 and r == 1) else 5 + 3 * r
        rows = [allowed[torch.randperm(len(allowed), generator=g)[:K]] for _ in range(T)]
        idx = torch.stack(rows) if rows else torch.empty(0, K, dtype=torch.int64)
        if T:
            idx[0, 1] = -1
            idx[T // 2, 0] = -1
        ranks.append(
            {
                "x": torch.randn(T, H, generator=g).to(dtype),
                "topk_idx": idx,
                "topk_weights": torch.rand(T, K, generator=g),
                "grad_out": torch.randn(T, H, generator=g).to(dtype),
            }
        )
    return {"gate_up_proj": gate_up, "down_proj": down, "num_experts": E, "ranks": ranks}


def ep_forward_backward(
    rank: int, world: int, device: str = "cpu", experts: str = "reference", dtype: str = "float32"
) -> dict:
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    case = moe_case(world, dtype=getattr(torch, dtype))
    mine = {k: v.to(dev) for k, v in case["ranks"][rank].items()}
    E = case["num_experts"]
    start, end = local_expert_range(rank, E, world)
    experts_fn = None
    if experts == "fused":
        from pathlib import Path

        from kernelhub.hub import get_local_kernel

        experts_fn = get_local_kernel(
            Path(__file__).resolve().parents[1] / "kernels_repo" / "moe"
        ).fused_experts
    x = mine["x"].clone().requires_grad_()
    w = mine["topk_weights"].clone().requires_grad_()
    gate_up = case["gate_up_proj"][start:end].to(dev).requires_grad_()
    down = case["down_proj"][start:end].to(dev).requires_grad_()
    out = ep_moe(x, mine["topk_idx"], w, gate_up, down, E, experts_fn=experts_fn)
    (out * mine["grad_out"]).sum().backward()
    module = ExpertParallelMoE.from_full(case["gate_up_proj"].to(dev), case["down_proj"].to(dev))
    with torch.no_grad():
        module_out = module(mine["x"], mine["topk_idx"], mine["topk_weights"])
    return {
        "out": out.detach().cpu(),
        "module_out": module_out.cpu(),
        "grad_x": x.grad.cpu(),
        "grad_w": w.grad.cpu(),
        "grad_gate_up": gate_up.grad.cpu(),
        "grad_down": down.grad.cpu(),
        "backend": dist.get_backend(),
    }


def single_process_moe(case: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    """The oracle: every rank's tokens through all E experts in one process, with grads."""
    gate_up = case["gate_up_proj"].clone().requires_grad_()
    down = case["down_proj"].clone().requires_grad_()
    xs, ws, outs, loss = [], [], [], 0
    for r in case["ranks"]:
        x = r["x"].clone().requires_grad_()
        w = r["topk_weights"].clone().requires_grad_()
        out = reference_experts(x, gate_up, down, r["topk_idx"], w)
        loss = loss + (out * r["grad_out"]).sum()
        xs.append(x)
        ws.append(w)
        outs.append(out.detach())
    loss.backward()
    zeros = torch.zeros_like
    return [
        {
            "out": outs[i],
            "grad_x": xs[i].grad if xs[i].grad is not None else zeros(xs[i]),
            "grad_w": ws[i].grad if ws[i].grad is not None else zeros(ws[i]),
            "grad_gate_up": gate_up.grad,
            "grad_down": down.grad,
        }
        for i in range(len(xs))
    ]


def assert_matches_single_process(
    results: list[dict[str, Any]], case: dict[str, Any], world: int, **tol: float
) -> None:
    """Each rank's EP output and gradients equal the single-process MoE (its experts' slice)."""
    oracle = single_process_moe(case)
    for rank, (got, want) in enumerate(zip(results, oracle, strict=True)):
        start, end = local_expert_range(rank, case["num_experts"], world)
        torch.testing.assert_close(got["out"], want["out"], **tol)
        torch.testing.assert_close(got["module_out"], want["out"], **tol)
        torch.testing.assert_close(got["grad_x"], want["grad_x"], **tol)
        torch.testing.assert_close(got["grad_w"], want["grad_w"], **tol)
        torch.testing.assert_close(got["grad_gate_up"], want["grad_gate_up"][start:end], **tol)
        torch.testing.assert_close(got["grad_down"], want["grad_down"][start:end], **tol)


def invalid_routing(rank: int, world: int) -> tuple[str, str]:
    case = moe_case(world)
    mine = case["ranks"][rank]
    idx = mine["topk_idx"].clone()
    if rank == 1:
        idx[0, 0] = case["num_experts"]  # out of range on rank 1 only
    per = case["num_experts"] // world
    return _caught(
        lambda: ep_moe(
            mine["x"],
            idx,
            mine["topk_weights"],
            case["gate_up_proj"][:per],
            case["down_proj"][:per],
            case["num_experts"],
        )
    )


def heap_edges(rank: int, world: int) -> dict[str, Any]:
    """Zero-size allocations through `peer`, and a heap tensor used after close()."""
    out: dict[str, Any] = {}
    other = (rank + 1) % world
    with SymmetricHeap(1 << 16) as heap:
        empty = heap.allocate((0, 4), torch.float32)
        full = heap.allocate(8, torch.float32)
        full.fill_(rank + 1)
        heap.barrier()
        out["empty_peer"] = tuple(heap.peer(empty, other).shape)
        out["empty_view_peer"] = tuple(heap.peer(full[3:3], other).shape)
        out["peer_values"] = heap.peer(full, other).clone()
        heap.barrier()
    # after close(): the mapping lives as long as a tensor views it (it used to be unmapped under it)
    out["after_close"] = float(full.sum())
    return out


def ep_errors(rank: int, world: int, case_name: str) -> tuple[str, str]:
    """Bad ep_moe inputs that every rank shares raise on every rank, before any collective."""
    case = moe_case(world)
    mine = case["ranks"][rank]
    E = case["num_experts"]
    per = E // world
    idx = mine["topk_idx"].clone()
    idx[idx >= 0] = 0  # every token to rank 0's first expert: the other ranks receive no rows
    gate_up, down = case["gate_up_proj"][:per], case["down_proj"][:per]
    if case_name == "down_inner":
        down = torch.randn(per, down.shape[1], down.shape[2] + 1)
    elif case_name == "weights_dtype":
        gate_up, down = gate_up.double(), down.double()
    elif case_name == "float_num_experts":
        E = float(E)
    return _caught(lambda: ep_moe(mine["x"], idx, mine["topk_weights"], gate_up, down, E))


def ep_output_dtype(rank: int, world: int) -> dict[str, Any]:
    """An experts_fn returning another dtype, while some rank receives no rows: x's dtype back."""
    case = moe_case(world, dtype=torch.bfloat16)
    mine = case["ranks"][rank]
    idx = mine["topk_idx"].clone()
    idx[idx >= 0] = 0
    per = case["num_experts"] // world
    out = ep_moe(mine["x"], idx, mine["topk_weights"], case["gate_up_proj"][:per], case["down_proj"][:per],
                 case["num_experts"], experts_fn=lambda *a: reference_experts(*a).float())
    return {"dtype": str(out.dtype), "shape": tuple(out.shape)}


def ep_disagreement(rank: int, world: int, what: str) -> tuple[str, str]:
    """Ranks that disagree on E or on dtypes: a ValueError on every rank (was: silently wrong ids,
    or gloo aborting a process on mismatched transfer sizes)."""
    case = moe_case(world)
    mine = case["ranks"][rank]
    E = case["num_experts"]
    x, w = mine["x"], mine["topk_weights"]
    if what == "num_experts" and rank == 1:
        E = 2 * E
    if what == "dtype" and rank == 1:
        w = w.double()
    return _caught(lambda: ep_dispatch(x, mine["topk_idx"], w, E))


def one_rank_fails_in_ep(rank: int, world: int, group) -> dict[str, tuple[str, str]]:
    """Rank 1 alone does something wrong, case after case, on one group with a short timeout.

    Every case must raise on every rank before any rank waits in a collective the failing rank
    skips; a case that left rank 0 waiting would end in a gloo timeout instead (and break the
    cases after it), which the test reports.
    """
    case = moe_case(world)
    mine = case["ranks"][rank]
    E = case["num_experts"]
    start, end = local_expert_range(rank, E, world)
    x, idx, w = mine["x"], mine["topk_idx"], mine["topk_weights"]
    gate_up, down = case["gate_up_proj"][start:end], case["down_proj"][start:end]
    bad = rank == 1

    def experts_raise(*args):
        if bad:
            raise RuntimeError("boom in experts_fn")
        return reference_experts(*args)

    def experts_short(*args):
        y = reference_experts(*args)
        return y[:-1] if bad else y

    def by_hand(rows_off: int = 0, cols_off: int = 0):
        d = ep_dispatch(x, idx, w, E, group=group)
        y = reference_experts(d.hidden_states, gate_up, down, d.topk_idx, d.topk_weights)
        return ep_combine(y[: y.shape[0] - rows_off, : y.shape[1] - cols_off] if bad else y, d.handle)

    cases = {
        "experts_raise": lambda: ep_moe(x, idx, w, gate_up, down, E, group=group, experts_fn=experts_raise),
        "experts_shape": lambda: ep_moe(x, idx, w, gate_up, down, E, group=group, experts_fn=experts_short),
        "weight_shape": lambda: ep_moe(
            x, idx, w, gate_up, down[:, :, :-1] if bad else down, E, group=group
        ),
        "combine_rows": lambda: by_hand(rows_off=1),
        "combine_width": lambda: by_hand(cols_off=1),  # rows of different sizes: gloo aborted
        "meta": lambda: ep_dispatch(
            x.to("meta") if bad else x, idx.to("meta") if bad else idx, w.to("meta") if bad else w, E, group=group
        ),
        "int32_idx": lambda: ep_dispatch(x, idx.int() if bad else idx, w, E, group=group),
        "indivisible_experts": lambda: ep_dispatch(x, idx, w, E - 1 if bad else E, group=group),
    }
    out = {name: _caught(fn) for name, fn in cases.items()}
    # the group still works after all of that: a correct call on every rank
    out["after"] = ("shape", str(tuple(ep_moe(x, idx, w, gate_up, down, E, group=group).shape)))
    return out


def one_rank_fails_in_heap(rank: int, world: int, group) -> dict[str, tuple[str, str]]:
    """SymmetricHeap arguments wrong on rank 1 alone, or too large for any rank."""
    import os

    bad = rank == 1

    def env_on_rank_1():
        if bad:
            os.environ["KERNELHUB_CHECK_ALLOC_SYMMETRY"] = "enabled"
        try:
            SymmetricHeap(1024, group=group).close()
        finally:
            os.environ.pop("KERNELHUB_CHECK_ALLOC_SYMMETRY", None)

    cases = {
        "alignment": lambda: SymmetricHeap(1024, alignment=3 if bad else 256, group=group).close(),
        "nbytes_type": lambda: SymmetricHeap(1024.0 if bad else 1024, group=group).close(),
        "device": lambda: SymmetricHeap(1024, device="cuda:0" if bad else "cpu", group=group).close(),
        "env": env_on_rank_1,
        "huge": lambda: SymmetricHeap(1 << 50, group=group).close(),
        # sparse files: this used to succeed and kill the process with SIGBUS on first touch
        "larger_than_shm": lambda: SymmetricHeap(1 << 40, group=group).close(),
    }
    out = {name: _caught(fn) for name, fn in cases.items()}
    with SymmetricHeap(1024, group=group, check_symmetry=True) as heap:
        # with the check on, the peers wait in this allocation's comparison
        out["allocate_checked"] = _caught(lambda: heap.allocate((-1,) if bad else (4,), torch.float32))
        out["allocations_checked"] = ("count", str(len(heap.allocations)))
    with SymmetricHeap(1024, group=group) as heap:  # the group still works
        out["after"] = ("allocated", str(tuple(heap.allocate(4, torch.float32).shape)))
    return out
