"""The grouped GEMMs' tile variants (paired rows, persistent programs, TMA operands and stores,
row-ordered copies, flattened weight-gradient loops) against the plain one-tile path.

CPU: the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by the root conftest).
"""

from __future__ import annotations

import copy
import importlib
from pathlib import Path

import pytest
import torch
from _experts_helpers import (
    NAMES,
    TRITON_VARIANTS,
    assert_close_rel,
    assert_only_staged_decode_tiles_pipelined,
    cfgs,
    count_row_descriptors,
    kern,
    launch,
    loop_reference,
    make_inputs,
    moe,
    run_compile_checks,
    run_with_grads,
    with_wgrad_tma,
)


def _routing_with_block_counts(E_counts: list[int], K: int, drop: int = 0) -> torch.Tensor:
    """topk_idx [T, K] in which expert e gets E_counts[e] pairs (minus `drop` set to -1), no token
    naming an expert twice: the pairs sorted by expert, token t taking entries t, t + T, ..."""
    seq = [e for e, c in enumerate(E_counts) for _ in range(c)]
    T = len(seq) // K
    assert T * K == len(seq)
    idx = torch.tensor([[seq[t + j * T] for j in range(K)] for t in range(T)])
    assert all(len(set(row.tolist())) == K for row in idx)
    for j in range(drop):
        idx[j, K - 1] = -1
    return idx


@pytest.mark.parametrize("one_program_alignment", [True, False])
@pytest.mark.parametrize("variant", TRITON_VARIANTS)
def test_paired_row_blocks_match_the_float64_loop(variant, one_program_alignment, monkeypatch):
    """Bucket key "pair_m": blocks 0+1, 2+3, ... of an expert run as one tile twice block_m tall and
    an odd last block alone. Experts of 0 to 4 blocks (block_m=16 here), a dropped pair, every
    gradient against the float64 loop; both tile heights must have run. Both alignment paths (the
    one-program kernel of small batches and the mapping kernels) give the expert starts it reads."""
    if not one_program_alignment:
        monkeypatch.setattr(importlib.import_module(moe.__name__ + "._experts_routing"), "SMALL_PAIRS", 0)
    heights = []
    real = kern._gemm_tile
    monkeypatch.setattr(kern, "_gemm_tile", lambda *a: heights.append(int(a[-3])) or real(*a))
    cfg = copy.deepcopy(cfgs.INTERPRETER_CONFIG)
    assert cfg["block_m"] == 16
    cfg["pair_m"] = True
    idx = _routing_with_block_counts([0, 10, 20, 40, 64], K=2, drop=1)  # 0, 1, 2, 3, 4 blocks
    T, K, E, H, I = idx.shape[0], 2, 5, 24, 20
    x, gu, dn, _, w = make_inputs(T, H, I, E, K, seed=61)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(62))
    out, grads = run_with_grads(lambda *a: moe.fused_experts(*a, variant=variant, config=cfg), x, gu, dn, idx, w,
                                dy, torch.float32)
    assert set(heights) == {16, 32}, heights
    ref, ref_grads = run_with_grads(loop_reference, x, gu, dn, idx, w, dy, torch.float64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    for name, got, want in zip(NAMES, grads, ref_grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("pair", [False, True])
@pytest.mark.parametrize("one_program_alignment", [True, False])
def test_persistent_and_tma_a_gemms_match_one_program_per_tile(monkeypatch, one_program_alignment, pair):
    """GEMM stage keys "PERSISTENT" (programs loop over the tiles of the used rows, counted on the
    device from the last expert's start and count; under "pair_m" over the tall-tile and lone-block
    lists of `_pair_tiles_kernel`) and "A_TMA" (down's h and dL/dx's d[gate|up] by TMA; under pair_m
    a second descriptor for tall tiles): output and every gradient equal the one-program-per-tile
    pointer path's bits. Experts of 0 to 4 blocks with the last one empty (the used-row count must
    not stop short or run past), a dropped pair; both alignment paths, whose expert starts and
    counts the kernel reads; under pair_m both tile heights must run."""
    if not one_program_alignment:
        monkeypatch.setattr(importlib.import_module(moe.__name__ + "._experts_routing"), "SMALL_PAIRS", 0)
    descriptors = count_row_descriptors(monkeypatch)
    grids, heights = [], []
    real, real_tile = launch.gemm_launch, kern._gemm_tile
    monkeypatch.setattr(kern, "_gemm_tile", lambda *a: heights.append(int(a[-3])) or real_tile(*a))

    class Recording:  # the GEMM launcher, noting (grid, PERSISTENT) of each launch
        kernel = real.kernel

        def split(self, grid, index, tensors, ints, constexprs, **kw):
            grids.append((grid[0], constexprs[11]))
            return real.split(grid, index, tensors, ints, constexprs, **kw)

    monkeypatch.setattr(launch, "gemm_launch", Recording())
    idx = _routing_with_block_counts([36, 50, 0, 40, 0], K=2, drop=1)  # 3, 4, 0, 3, 0 blocks of 16
    T, K, E, H, I = idx.shape[0], 2, 5, 24, 20
    x, gu, dn, _, w = make_inputs(T, H, I, E, K, seed=71)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(72))
    results = {}
    both = {"PERSISTENT": 1, "A_TMA": True}
    for name, extra, gate_up_rows in (("plain", {}, False), ("persistent", {"PERSISTENT": 1}, False),
                                      ("a_tma", {"A_TMA": True}, False), ("both", both, False),
                                      ("both_rows", both, True), ("halves", {}, False)):
        cfg = copy.deepcopy(cfgs.INTERPRETER_CONFIG)
        assert cfg["block_m"] == 16
        if pair:
            cfg["pair_m"] = True
        for stage in ("gate_up", "down", "dgrad"):
            cfg[stage].update(extra)
        if gate_up_rows:  # gate_up reads a row-ordered copy of x: A by TMA there too
            cfg["gate_up"]["ROWS"] = True
        if name == "halves":  # gate_up's training epilogue (it saves [g | u]) in two column halves
            cfg["gate_up"]["EPI_HALVES"] = True
        grids.clear()
        descriptors.clear()
        heights.clear()
        results[name] = run_with_grads(lambda *a, cfg=cfg: moe.fused_experts(*a, variant="sm90", config=cfg), x,
                                       gu, dn, idx, w, dy, torch.float32)
        persistent = [p for _, p in grids]
        assert len(grids) == 4 and all(p == ("PERSISTENT" in extra) for p in persistent), (name, grids)
        if "PERSISTENT" in extra:  # 3 "SMs" in the interpreter: fewer programs than tiles
            assert all(g == 3 for g, _ in grids), grids
        # A by TMA: forward down and dL/dx, plus gate_up on its row copy (the gathering GEMMs keep
        # pointer loads); pair: two descriptors each
        a_tma = (3 if gate_up_rows else 2) if "A_TMA" in extra else 0
        assert len(descriptors) == (2 if pair else 1) * a_tma, (name, descriptors)
        assert set(heights) == ({16, 32} if pair else {16}), (name, set(heights))
    out0, grads0 = results["plain"]
    for name in ("persistent", "a_tma", "both", "both_rows", "halves"):
        out, grads = results[name]
        torch.testing.assert_close(out, out0, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
        for g, b, what in zip(grads, grads0, NAMES, strict=True):
            torch.testing.assert_close(g, b, rtol=0, atol=0, msg=lambda m, n=name, w=what: f"{n} {w}: {m}")
    ref, _ = run_with_grads(loop_reference, x, gu, dn, idx, w, dy, torch.float64)
    torch.testing.assert_close(out0.double(), ref, rtol=1e-4, atol=1e-5)


def test_pair_tiles_list_every_tall_tile_and_lone_block():
    """`_pair_tiles_kernel` (one program): counts, then the first rows of the tall tiles expert by
    expert, then (after the room for P // (2 block_m) tall tiles) those of the lone last blocks."""
    rt = importlib.import_module(moe.__name__ + "._experts_routing")
    counts = [36, 50, 0, 40, 0, 16, 34]  # 3, 4, 0, 3, 0, 1, 3 blocks of 16
    idx = _routing_with_block_counts(counts, K=2)
    r = rt.align_rows(idx, len(counts), 16)
    tiles = launch.pair_tiles(r).tolist()
    start = r.expert_start.tolist()
    tall = [start[e] + 32 * j for e, c in enumerate(counts) for j in range(-(-c // 16) // 2)]
    lone = [start[e] + 16 * (-(-c // 16) - 1) for e, c in enumerate(counts) if -(-c // 16) % 2]
    cap = r.num_rows // 32
    assert tiles[:2] == [len(tall), len(lone)] == [5, 4]
    assert tiles[2:2 + len(tall)] == tall and tiles[2 + cap:2 + cap + len(lone)] == lone


def test_a_register_cap_gets_its_own_cached_launcher():
    """Stage key "maxnreg": one launcher per (kernel, cap), built once; no key, the shared one."""
    capped = launch.launcher(launch.gemm_launch, {"maxnreg": 128})
    assert capped is not launch.gemm_launch and capped.kernel is launch.gemm_launch.kernel
    assert launch.launcher(launch.gemm_launch, {"maxnreg": 128}) is capped
    assert launch.launcher(launch.wgrad_launch, {"maxnreg": 128}) not in (capped, launch.wgrad_launch)
    assert launch.launcher(launch.gemm_launch, {"BLOCK_N": 64}) is launch.gemm_launch


def test_pinned_tile_config_gives_the_same_result():
    pinned = {k: (dict(v) if isinstance(v, dict) else v) for k, v in cfgs.INTERPRETER_CONFIG.items()}
    pinned["block_m"] = 32
    pinned["gate_up"]["BLOCK_N"] = 32
    pinned["gate_up"]["GROUP_M"] = 1
    x, gu, dn, idx, w = make_inputs(9, 32, 40, 3, 2, seed=9)
    out = moe.fused_experts(x, gu, dn, idx, w, variant="sm90", config=pinned)
    torch.testing.assert_close(out.double(), loop_reference(x, gu, dn, idx, w), rtol=1e-4, atol=1e-5)


def _assert_same_bits_and_close_to_reference(got, base, x, gu, dn, idx, w, dy) -> None:
    """Gradients `got` equal `base` bit for bit and the float64 loop within 1e-5."""
    _, ref = run_with_grads(lambda *a: loop_reference(*a), x, gu, dn, idx, w, dy, torch.float64)
    for g, b, want, name in zip(got, base, ref, NAMES, strict=True):
        torch.testing.assert_close(g, b, rtol=0, atol=0)
        assert_close_rel(g, want, 1e-5, name)


def test_weight_gradients_with_tma_operands_match_the_pointer_path(monkeypatch):
    """wgrad "TMA": the non-gathered operand by 2-D descriptor, padding rows included in the box."""
    x, gu, dn, idx, w = make_inputs(11, 40, 24, 5, 2, seed=41, drop=3)  # padded experts, -1 ids
    dy = torch.randn(11, 40, generator=torch.Generator().manual_seed(42))
    calls = count_row_descriptors(monkeypatch)
    _, plain = run_with_grads(lambda *a: moe.fused_experts(
        *a, variant="sm90", config=with_wgrad_tma(cfgs.INTERPRETER_CONFIG, False)), x, gu, dn, idx, w, dy,
        torch.float32)
    assert calls == []
    _, tma = run_with_grads(lambda *a: moe.fused_experts(
        *a, variant="sm90", config=with_wgrad_tma(cfgs.INTERPRETER_CONFIG, True)), x, gu, dn, idx, w, dy,
        torch.float32)
    assert len(calls) == 2  # dW_down's h * w rows and dW_gate_up's d[gate|up] rows
    _assert_same_bits_and_close_to_reference(tma, plain, x, gu, dn, idx, w, dy)


@pytest.mark.parametrize("tma", [False, True])
def test_weight_gradients_from_row_ordered_copies_match_the_gathering_path(monkeypatch, tma):
    """wgrad "ROWS": dY and x copied into the aligned row order first; same bits as gathering them."""
    T, H = 11, 40
    x, gu, dn, idx, w = make_inputs(T, H, 24, 5, 2, seed=45, drop=3)  # padded experts, -1 ids
    wide = torch.randn(T, 2 * H)
    wide[:, 1::2] = x
    x_strided = wide[:, 1::2]  # the copy must follow x's strides
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(46))
    gathered = []
    real = launch.gather_rows
    monkeypatch.setattr(launch, "gather_rows", lambda *a, **kw: gathered.append(a[0].shape) or real(*a, **kw))
    descriptors = count_row_descriptors(monkeypatch)
    _, base = run_with_grads(lambda *a: moe.fused_experts(
        *a, variant="sm90", config=with_wgrad_tma(cfgs.INTERPRETER_CONFIG, False)), x_strided, gu, dn, idx,
        w, dy, torch.float32)
    assert gathered == []
    _, rows = run_with_grads(lambda *a: moe.fused_experts(
        *a, variant="sm90", config=with_wgrad_tma(cfgs.INTERPRETER_CONFIG, tma, rows=True)), x_strided, gu,
        dn, idx, w, dy, torch.float32)
    # dY for dW_down, then x for dW_gate_up, each in column chunks that tile [0, H) (ragged last one)
    widths = [shape[1] for shape in gathered]
    assert all(shape[0] == T for shape in gathered) and len(widths) > 2
    split = next(i for i in range(1, len(widths) + 1) if sum(widths[:i]) == H)
    assert sum(widths[split:]) == H and len(set(widths)) > 1
    assert len(descriptors) == (2 * len(widths) if tma else 0)  # with TMA: both operands of every launch
    _assert_same_bits_and_close_to_reference(rows, base, x, gu, dn, idx, w, dy)


def test_one_rows_part_copies_each_operand_once(monkeypatch):
    """wgrad "ROWS_PARTS": 1 (the shipped <= 256-rows buckets): one whole-width copy per operand and
    one launch per weight gradient; same bits as the gathering path."""
    T, H = 11, 40
    x, gu, dn, idx, w = make_inputs(T, H, 24, 5, 2, seed=47, drop=3)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(52))
    gathered = []
    real = launch.gather_rows
    monkeypatch.setattr(launch, "gather_rows", lambda *a, **kw: gathered.append(a[0].shape) or real(*a, **kw))
    _, base = run_with_grads(lambda *a: moe.fused_experts(
        *a, variant="sm90", config=with_wgrad_tma(cfgs.INTERPRETER_CONFIG, False)), x, gu, dn, idx, w, dy,
        torch.float32)
    cfg = with_wgrad_tma(cfgs.INTERPRETER_CONFIG, True, rows=True)
    cfg["wgrad"]["ROWS_PARTS"] = 1
    _, one = run_with_grads(lambda *a: moe.fused_experts(*a, variant="sm90", config=cfg), x, gu, dn, idx, w, dy,
                            torch.float32)
    assert gathered == [torch.Size([T, H]), torch.Size([T, H])]  # dY, then x: whole width, once each
    _assert_same_bits_and_close_to_reference(one, base, x, gu, dn, idx, w, dy)


@pytest.mark.parametrize("rows", [False, True])
def test_weight_gradients_stored_by_tma_match_the_pointer_stores(monkeypatch, rows):
    """wgrad "TMA_STORE": each dW tile by one TMA store (clipped at M and N); same bits."""
    sm90 = importlib.import_module(moe.__name__ + "._experts_sm90")
    E, H, I = 5, 40, 24  # neither a multiple of the tiles: the boxes overhang
    x, gu, dn, idx, w = make_inputs(11, H, I, E, 2, seed=48, drop=3)
    dy = torch.randn(11, H, generator=torch.Generator().manual_seed(49))
    calls = []
    real = sm90.weight_descriptor
    monkeypatch.setattr(sm90, "weight_descriptor", lambda *a: calls.append(a[0].shape) or real(*a))
    results = []
    for store in (False, True):
        cfg = with_wgrad_tma(cfgs.INTERPRETER_CONFIG, True, rows)
        cfg["wgrad"]["TMA_STORE"] = store
        _, grads = run_with_grads(lambda *a, cfg=cfg: moe.fused_experts(*a, variant="sm90", config=cfg), x, gu, dn,
                                  idx, w, dy, torch.float32)
        results.append((len(calls), grads))
        calls.clear()
    (n_plain, base), (n_store, got) = results
    # One more 3-D descriptor per wgrad launch: two launches, or one per column chunk under ROWS.
    assert n_store - n_plain == 2 if not rows else n_store - n_plain > 2
    _assert_same_bits_and_close_to_reference(got, base, x, gu, dn, idx, w, dy)


@pytest.mark.parametrize("extra", [{}, {"ROWS": True}, {"TMA": True, "ROWS": True, "TMA_STORE": True}])
def test_persistent_weight_gradients_match_one_program_per_tile(monkeypatch, extra):
    """wgrad "PERSISTENT": fewer programs than tiles, each looping over tiles; same bits."""
    x, gu, dn, idx, w = make_inputs(11, 40, 24, 5, 2, seed=50, drop=3)
    dy = torch.randn(11, 40, generator=torch.Generator().manual_seed(51))
    grids = []
    real = launch.wgrad_launch

    class Recording:  # the wgrad launcher, noting each grid
        def split(self, grid, *a, **kw):
            grids.append(grid[0])
            return real.split(grid, *a, **kw)

    monkeypatch.setattr(launch, "wgrad_launch", Recording())
    results = []
    for per_sm in (0, 1):
        cfg = copy.deepcopy(cfgs.INTERPRETER_CONFIG)
        cfg["wgrad"].update(extra, PERSISTENT=per_sm)
        _, grads = run_with_grads(lambda *a, cfg=cfg: moe.fused_experts(*a, variant="sm90", config=cfg), x, gu, dn,
                                  idx, w, dy, torch.float32)
        results.append((list(grids), grads))
        grids.clear()
    (tiles, base), (programs, got) = results
    assert len(tiles) == len(programs) >= 2
    assert all(p == min(t, 3) for p, t in zip(programs, tiles, strict=True))  # 3 "SMs" in the interpreter
    assert any(t > p for p, t in zip(programs, tiles, strict=True))  # some programs looped over tiles
    _assert_same_bits_and_close_to_reference(got, base, x, gu, dn, idx, w, dy)


@pytest.mark.parametrize(("counts", "flat_steps"), [
    ([40, 48, 64, 64, 50], {4: [4], 3: []}),  # steps 3, 3, 4, 4, 4: flat up to the cap
    ([0, 10, 20, 40, 64], {4: [], 8: []}),  # steps 0-4: 4 * 5 experts > 1.5 * 10 steps, the plain loop
])
def test_flattened_weight_gradients_match_one_program_per_tile(monkeypatch, counts, flat_steps):
    """wgrad "FLAT_STEPS": persistent programs run every tile for the largest expert's K steps (boxes
    past an expert's rows read zeros) in one flattened loop, while no expert has more steps than
    the cap and the zero steps are at most half the real ones; else the plain persistent loop.
    Experts of 0 to 64 rows (0 to 4 steps of 16 rows), a dropped pair: every path gives the
    one-program-per-tile bits, and the flattened one ran exactly where expected."""
    flat_calls = []
    real = kern._wgrad_flat_tiles
    monkeypatch.setattr(kern, "_wgrad_flat_tiles", lambda *a: flat_calls.append(int(a[10])) or real(*a))
    idx = _routing_with_block_counts(counts, K=2, drop=1)
    T, K, E, H, I = idx.shape[0], 2, len(counts), 24, 20
    x, gu, dn, _, w = make_inputs(T, H, I, E, K, seed=63)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(64))
    results = {}
    for cap in (0, *flat_steps):
        cfg = copy.deepcopy(cfgs.INTERPRETER_CONFIG)
        assert cfg["wgrad"]["BLOCK_K"] == 16 and cfg["block_m"] % 16 == 0
        extra = {"PERSISTENT": 1, "FLAT_STEPS": cap} if cap else {"PERSISTENT": 0}
        cfg["wgrad"].update(extra, TMA=True, ROWS=True, TMA_STORE=True)
        flat_calls.clear()
        _, grads = run_with_grads(lambda *a, cfg=cfg: moe.fused_experts(*a, variant="sm90", config=cfg), x, gu, dn,
                                  idx, w, dy, torch.float32)
        results[cap] = (sorted(set(flat_calls)), grads)
    assert results[0][0] == []  # one program per tile
    for cap, want in flat_steps.items():
        got_flat, grads = results[cap]
        assert got_flat == want, (cap, got_flat)  # flattened programs ran the largest expert's steps
        _assert_same_bits_and_close_to_reference(grads, results[0][1], x, gu, dn, idx, w, dy)


@pytest.mark.skipif(tuple(int(v) for v in __import__("triton").__version__.split(".")[:2]) < (3, 7),
                    reason="compile_check.py builds ASTSource signatures in Triton 3.7's format")
def test_every_shipped_bucket_compiles_for_sm90_and_sm80_without_a_gpu(tmp_path):
    """The GPU compiler sees code the interpreter never does (a runtime `if` is traced on both
    sides; layouts, TMA, shared memory): every kernel of every shipped bucket, sm90 and sm80,
    through ptxas. Caught a flattened-loop branch that broke every non-TMA weight gradient."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_check.py"
    sm90, sm80 = run_compile_checks(script, tmp_path, [["90"], ["80"]])
    assert "failures: 0" in sm90 and "failures: 0" in sm80, (sm90[-2000:], sm80[-2000:])
    assert sm90.count("ok   sm90 wgrad") >= 10 and sm80.count("ok   sm80 ") >= 10, (sm90[-2000:], sm80[-2000:])
    # decode kernels: LOAD_STAGES > 1 pipelines the K loop's loads (cp.async), plain loads do not
    for out in (sm90, sm80):
        assert_only_staged_decode_tiles_pipelined(
            [line for line in out.splitlines() if line.startswith("ok ") and " decode " in line], "'LOAD_STAGES': 3")


def test_gather_rows_copies_real_rows_and_zeroes_padding():
    routing = importlib.import_module(moe.__name__ + "._experts_routing")
    T, K, E, H = 9, 2, 4, 40
    _, _, _, idx, _ = make_inputs(T, 8, 8, E, K, seed=47, drop=2)
    r = routing.align_rows(idx, E, 16)
    src = torch.randn(T, H, dtype=torch.bfloat16)
    out = launch.gather_rows(src, r, K)
    assert out.shape == (r.num_rows, H) and out.dtype == src.dtype
    starts = r.expert_start.tolist()
    used_end = max(s + -(-c // 16) * 16 for s, c in zip(starts, r.expert_count.tolist(), strict=True))
    for p in range(used_end):  # rows past the last expert's block are never read: not checked
        flat = int(r.rows[p])
        want = src[flat // K] if flat >= 0 else torch.zeros(H, dtype=src.dtype)
        assert torch.equal(out[p], want), f"row {p} (pair {flat})"


def test_wgrad_tma_is_skipped_when_a_box_could_leave_its_expert(monkeypatch):
    cfg = with_wgrad_tma(cfgs.INTERPRETER_CONFIG, True)
    cfg["wgrad"]["BLOCK_K"] = 2 * cfg["block_m"]  # a box would span two experts' rows
    x, gu, dn, idx, w = make_inputs(7, 40, 24, 5, 2, seed=43)
    dy = torch.randn(7, 40, generator=torch.Generator().manual_seed(44))
    calls = count_row_descriptors(monkeypatch)
    _, got = run_with_grads(lambda *a: moe.fused_experts(*a, variant="sm90", config=cfg), x, gu, dn, idx, w,
                            dy, torch.float32)
    assert calls == []
    _, ref = run_with_grads(lambda *a: loop_reference(*a), x, gu, dn, idx, w, dy, torch.float64)
    for got_g, want, name in zip(got, ref, NAMES, strict=True):
        assert_close_rel(got_g, want, 1e-5, name)

