"""fused_experts and the MoEExperts layers against transformers' eager experts and a float64 loop.

CPU: the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by the root conftest), so
both the sm80 (pointer) and sm90 (TMA descriptor) paths are exercised on tiny shapes.
GPU (`-m gpu`): real shapes in bf16, and CUDA-graph capture of the inference path.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import json
import os
import subprocess
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernelhub.device import device_properties
from kernelhub.hub import get_local_kernel

moe = get_local_kernel(Path(__file__).resolve().parents[1])
TRITON_VARIANTS = ["sm80", "sm90"]
NAMES = ("x", "gate_up_proj", "down_proj", "topk_weights")


def loop_reference(x, gate_up_proj, down_proj, topk_idx, topk_weights):
    """Per-(token, k) loop in float64: the plainest statement of the math."""
    T, K = topk_idx.shape
    inter = gate_up_proj.shape[1] // 2
    rows = []
    for t in range(T):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for k in range(K):
            e = int(topk_idx[t, k])
            if e < 0:
                continue
            gu = gate_up_proj[e].double() @ x[t].double()
            h = F.silu(gu[:inter]) * gu[inter:]
            acc = acc + topk_weights[t, k].double() * (down_proj[e].double() @ h)
        rows.append(acc)
    return torch.stack(rows)


def make_inputs(T, H, I, E, K, dtype=torch.float32, seed=0, drop=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=g) * I**-0.5).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    for j in range(drop):
        idx[j % T, j % K] = -1
    w = torch.rand(T, K, generator=g).to(dtype)
    return x, gate_up, down, idx, w


def run_with_grads(fn, x, gate_up, down, idx, w, dy, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, gate_up, down, w)]
    out = fn(leaves[0], leaves[1], leaves[2], idx, leaves[3])
    out.backward(dy.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def assert_close_rel(actual, expected, tol, what):
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual - expected).norm() / expected.norm().clamp_min(1e-30)
    assert err < tol, f"{what}: relative error {err:.3g} >= {tol}"


# ------------------------------------------------------------------ fused_experts vs float64 loop


@pytest.mark.parametrize("variant", TRITON_VARIANTS + ["reference"])
@pytest.mark.parametrize(
    "T,H,I,E,K,drop",
    [
        (6, 40, 24, 5, 2, 2),  # H and I not multiples of the blocks, two dropped (-1) pairs
        (1, 32, 20, 4, 3, 0),  # a single token (decode)
    ],
)
def test_fused_experts_matches_float64_loop_with_grads(variant, T, H, I, E, K, drop):
    x, gu, dn, idx, w = make_inputs(T, H, I, E, K, seed=T + H, drop=drop)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    out, grads = run_with_grads(lambda *a: moe.fused_experts(*a, variant=variant), x, gu, dn, idx, w, dy,
                                torch.float32)
    ref, ref_grads = run_with_grads(loop_reference, x, gu, dn, idx, w, dy, torch.float64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    for name, got, want in zip(NAMES, grads, ref_grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("variant", TRITON_VARIANTS)
def test_experts_without_tokens_get_zero_weight_grads(variant):
    T, H, I, E, K = 4, 32, 16, 6, 2
    x, gu, dn, _, w = make_inputs(T, H, I, E, K, seed=3)
    idx = torch.tensor([[0, 2], [2, 0], [0, -1], [2, 0]])  # experts 1, 3, 4, 5 get nothing
    dy = torch.randn(T, H)
    out, grads = run_with_grads(lambda *a: moe.fused_experts(*a, variant=variant), x, gu, dn, idx, w, dy,
                                torch.float32)
    ref, ref_grads = run_with_grads(loop_reference, x, gu, dn, idx, w, dy, torch.float64)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    for e in (1, 3, 4, 5):
        assert torch.equal(grads[1][e], torch.zeros_like(grads[1][e])), f"gate_up grad of idle expert {e}"
        assert torch.equal(grads[2][e], torch.zeros_like(grads[2][e])), f"down grad of idle expert {e}"
    assert grads[3][2, 1] == 0, "a dropped pair must get a zero weight gradient"
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_replay_keys_seen_once_make_room_before_recordings(monkeypatch):
    """The replay table's bound: a key is recorded on its second call; when the table is full, the
    keys seen once (prefill lengths that never repeat) go before the recordings (decode shapes)."""
    rp = importlib.import_module(moe.__name__ + "._experts_replay")
    monkeypatch.setattr(rp, "_MAX_REPLAYS", 4)
    rp._REPLAYS.clear()
    recording = rp._Replay([], 1, (1, 1))
    try:
        assert rp.should_record(("decode",)) is False  # first call: seen
        assert rp.should_record(("decode",)) is True  # second call: record
        rp._REPLAYS[("decode",)] = recording
        assert rp.recorded(("decode",)) is recording and rp.recorded(("other",)) is None
        for n in range(10):  # prefill lengths that never repeat
            assert rp.should_record(("prefill", n)) is False
        assert rp.recorded(("decode",)) is recording and len(rp._REPLAYS) <= 4
        rp._REPLAYS[("broken",)] = None  # a recording that could not be replayed: never again
        assert rp.should_record(("broken",)) is False
    finally:
        rp._REPLAYS.clear()


def test_a_replay_rebuilds_descriptors_over_weights_and_internal_buffers(monkeypatch):
    """A recorded launch whose extras are TMA descriptors over a weight (an external) and over an
    internal buffer (the down GEMM's h with "A_TMA"): the replay passes a fresh descriptor over
    the new weight and one over the workspace region whose address the same launch gets for h,
    with the recorded dtype, shape, strides and box; a descriptor over the output is refused."""
    TensorDescriptor = pytest.importorskip("triton.tools.tensor_descriptor").TensorDescriptor
    rp = importlib.import_module(moe.__name__ + "._experts_replay")
    tl_mod = importlib.import_module("kernelhub.triton_launch")

    class Launcher:
        @staticmethod
        def split_hit(call):
            return "hit"

    def externals():
        return make_inputs(6, 32, 16, 4, 2, dtype=torch.bfloat16, seed=81)

    ext = externals()
    out = torch.empty(6, 32, dtype=torch.bfloat16)
    scratch = torch.empty(4096, dtype=torch.uint8)  # an internal allocation of the call
    h = scratch[512:].view(torch.bfloat16)[: 48 * 16].view(48, 16)
    dn = ext[2]
    call = tl_mod.SplitLaunch(Launcher, (3,), -1, (h, dn, out),
                              (TensorDescriptor(dn, list(dn.shape), list(dn.stride()), [1, 16, 16]),
                               TensorDescriptor(h, list(h.shape), list(h.stride()), [16, 16])),
                              (48, 7), (True,), 4, 3)
    plan = rp._plan([call], ext, out)
    assert plan is not None
    launched = []
    monkeypatch.setattr(tl_mod.CachedLaunch, "run_hit", staticmethod(lambda *a: launched.append(a)))
    new = externals()
    got = rp.replay(plan, new)
    (hit, grid, index, args), = launched
    assert (hit, grid, index) == ("hit", (3,), -1) and args[-3:] == (48, 7, True)
    h_ptr, dn_ptr, out_ptr, dn_desc, h_desc = args[:5]
    assert dn_ptr == new[2].data_ptr() and out_ptr == got.data_ptr()
    assert dn_desc.base is new[2] and dn_desc.block_shape == [1, 16, 16]
    assert h_desc.base.data_ptr() == h_ptr and h_ptr not in (t.data_ptr() for t in (*new, got))
    assert (h_desc.base.dtype, h_desc.base.shape, h_desc.base.stride()) == (h.dtype, h.shape, h.stride())
    assert (h_desc.shape, h_desc.strides, h_desc.block_shape) == ([48, 16], [16, 1], [16, 16])
    over_out = call._replace(extras=(None, TensorDescriptor(out, [6, 32], [32, 1], [16, 16])))
    assert rp._plan([over_out], ext, out) is None


@pytest.mark.parametrize("T,K,E", [(3, 3, 5), (200, 3, 5)])  # one-program alignment; the mapping kernels
def test_routing_buffers_start_16_byte_aligned(T, K, E):
    """Every routing view fused_experts launches with starts 16-byte aligned (odd E, odd T*K): a
    misaligned pointer would send the launch down CachedLaunch's slower path and refuse its replay."""
    rt = importlib.import_module(moe.__name__ + "._experts_routing")
    idx = torch.randint(0, E, (T, K))
    r = rt.align_rows(idx, E, 16)
    for name in ("rows", "row_expert", "expert_start", "expert_count", "token_topk_to_pos"):
        t = getattr(r, name)
        assert (t.data_ptr() - t.untyped_storage().data_ptr()) % 16 == 0, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", TRITON_VARIANTS)
def test_16bit_and_strided_inputs(variant, dtype):
    T, H, I, E, K = 5, 48, 24, 4, 2
    x, gu, dn, idx, w = make_inputs(T, H, I, E, K, dtype=dtype, seed=5)
    wide = torch.randn(T, 2 * H, dtype=dtype)
    wide[:, ::2] = x
    x_strided = wide[:, ::2]  # non-contiguous rows and columns
    out = moe.fused_experts(x_strided, gu, dn, idx.to(torch.int32), w, variant=variant)
    assert out.dtype == dtype and out.shape == (T, H)
    # Two bf16 roundings (h, y) then one of the fp32 sum: ~3e-3 here; eager transformers is ~5e-3.
    assert_close_rel(out, loop_reference(x, gu, dn, idx, w), 6e-3, f"{dtype} output")


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
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    kern = importlib.import_module(moe.__name__ + "._experts_kernels")
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
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    ex = importlib.import_module(moe.__name__ + ".experts")
    kern = importlib.import_module(moe.__name__ + "._experts_kernels")
    if not one_program_alignment:
        monkeypatch.setattr(importlib.import_module(moe.__name__ + "._experts_routing"), "SMALL_PAIRS", 0)
    descriptors = _count_row_descriptors(monkeypatch)
    grids, heights = [], []
    real, real_tile = ex._gemm_launch, kern._gemm_tile
    monkeypatch.setattr(kern, "_gemm_tile", lambda *a: heights.append(int(a[-3])) or real_tile(*a))

    class Recording:  # the GEMM launcher, noting (grid, PERSISTENT) of each launch
        kernel = real.kernel

        def split(self, grid, index, tensors, ints, constexprs, **kw):
            grids.append((grid[0], constexprs[11]))
            return real.split(grid, index, tensors, ints, constexprs, **kw)

    monkeypatch.setattr(ex, "_gemm_launch", Recording())
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
    ex = importlib.import_module(moe.__name__ + ".experts")
    rt = importlib.import_module(moe.__name__ + "._experts_routing")
    counts = [36, 50, 0, 40, 0, 16, 34]  # 3, 4, 0, 3, 0, 1, 3 blocks of 16
    idx = _routing_with_block_counts(counts, K=2)
    r = rt.align_rows(idx, len(counts), 16)
    tiles = ex._pair_tiles(r).tolist()
    start = r.expert_start.tolist()
    tall = [start[e] + 32 * j for e, c in enumerate(counts) for j in range(-(-c // 16) // 2)]
    lone = [start[e] + 16 * (-(-c // 16) - 1) for e, c in enumerate(counts) if -(-c // 16) % 2]
    cap = r.num_rows // 32
    assert tiles[:2] == [len(tall), len(lone)] == [5, 4]
    assert tiles[2:2 + len(tall)] == tall and tiles[2 + cap:2 + cap + len(lone)] == lone


def test_a_register_cap_gets_its_own_cached_launcher():
    """Stage key "maxnreg": one launcher per (kernel, cap), built once; no key, the shared one."""
    ex = importlib.import_module(moe.__name__ + ".experts")
    capped = ex._launcher(ex._gemm_launch, {"maxnreg": 128})
    assert capped is not ex._gemm_launch and capped.kernel is ex._gemm_launch.kernel
    assert ex._launcher(ex._gemm_launch, {"maxnreg": 128}) is capped
    assert ex._launcher(ex._wgrad_launch, {"maxnreg": 128}) not in (capped, ex._wgrad_launch)
    assert ex._launcher(ex._gemm_launch, {"BLOCK_N": 64}) is ex._gemm_launch


def test_pinned_tile_config_gives_the_same_result():
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    pinned = {k: (dict(v) if isinstance(v, dict) else v) for k, v in cfgs.INTERPRETER_CONFIG.items()}
    pinned["block_m"] = 32
    pinned["gate_up"]["BLOCK_N"] = 32
    pinned["gate_up"]["GROUP_M"] = 1
    x, gu, dn, idx, w = make_inputs(9, 32, 40, 3, 2, seed=9)
    out = moe.fused_experts(x, gu, dn, idx, w, variant="sm90", config=pinned)
    torch.testing.assert_close(out.double(), loop_reference(x, gu, dn, idx, w), rtol=1e-4, atol=1e-5)


def _with_wgrad_tma(cfg: dict, on: bool, rows: bool = False, store: bool = False) -> dict:
    pinned = copy.deepcopy(cfg)
    pinned["wgrad"].update(TMA=on, ROWS=rows, TMA_STORE=store)
    pinned["wgrad"].pop("PERSISTENT", None)
    pinned["wgrad"].pop("FLAT_STEPS", None)
    return pinned


def _count_row_descriptors(monkeypatch) -> list:
    """Calls of the sm90 2-D descriptor factory (the real one runs): proof the TMA branch ran."""
    sm90 = importlib.import_module(moe.__name__ + "._experts_sm90")
    calls = []
    real = sm90.rows_descriptor

    def spy(t, block_rows, block_cols):
        calls.append(tuple(t.shape))
        return real(t, block_rows, block_cols)

    monkeypatch.setattr(sm90, "rows_descriptor", spy)
    return calls


def _assert_same_bits_and_close_to_reference(got, base, x, gu, dn, idx, w, dy) -> None:
    """Gradients `got` equal `base` bit for bit and the float64 loop within 1e-5."""
    _, ref = run_with_grads(lambda *a: loop_reference(*a), x, gu, dn, idx, w, dy, torch.float64)
    for g, b, want, name in zip(got, base, ref, NAMES, strict=True):
        torch.testing.assert_close(g, b, rtol=0, atol=0)
        assert_close_rel(g, want, 1e-5, name)


def test_weight_gradients_with_tma_operands_match_the_pointer_path(monkeypatch):
    """wgrad "TMA": the non-gathered operand by 2-D descriptor, padding rows included in the box."""
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    x, gu, dn, idx, w = make_inputs(11, 40, 24, 5, 2, seed=41, drop=3)  # padded experts, -1 ids
    dy = torch.randn(11, 40, generator=torch.Generator().manual_seed(42))
    calls = _count_row_descriptors(monkeypatch)
    _, plain = run_with_grads(lambda *a: moe.fused_experts(
        *a, variant="sm90", config=_with_wgrad_tma(cfgs.INTERPRETER_CONFIG, False)), x, gu, dn, idx, w, dy,
        torch.float32)
    assert calls == []
    _, tma = run_with_grads(lambda *a: moe.fused_experts(
        *a, variant="sm90", config=_with_wgrad_tma(cfgs.INTERPRETER_CONFIG, True)), x, gu, dn, idx, w, dy,
        torch.float32)
    assert len(calls) == 2  # dW_down's h * w rows and dW_gate_up's d[gate|up] rows
    _assert_same_bits_and_close_to_reference(tma, plain, x, gu, dn, idx, w, dy)


@pytest.mark.parametrize("tma", [False, True])
def test_weight_gradients_from_row_ordered_copies_match_the_gathering_path(monkeypatch, tma):
    """wgrad "ROWS": dY and x copied into the aligned row order first; same bits as gathering them."""
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    ex = importlib.import_module(moe.__name__ + ".experts")
    T, H = 11, 40
    x, gu, dn, idx, w = make_inputs(T, H, 24, 5, 2, seed=45, drop=3)  # padded experts, -1 ids
    wide = torch.randn(T, 2 * H)
    wide[:, 1::2] = x
    x_strided = wide[:, 1::2]  # the copy must follow x's strides
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(46))
    gathered = []
    real = ex._gather_rows
    monkeypatch.setattr(ex, "_gather_rows", lambda *a, **kw: gathered.append(a[0].shape) or real(*a, **kw))
    descriptors = _count_row_descriptors(monkeypatch)
    _, base = run_with_grads(lambda *a: moe.fused_experts(
        *a, variant="sm90", config=_with_wgrad_tma(cfgs.INTERPRETER_CONFIG, False)), x_strided, gu, dn, idx,
        w, dy, torch.float32)
    assert gathered == []
    _, rows = run_with_grads(lambda *a: moe.fused_experts(
        *a, variant="sm90", config=_with_wgrad_tma(cfgs.INTERPRETER_CONFIG, tma, rows=True)), x_strided, gu,
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
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    ex = importlib.import_module(moe.__name__ + ".experts")
    T, H = 11, 40
    x, gu, dn, idx, w = make_inputs(T, H, 24, 5, 2, seed=47, drop=3)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(52))
    gathered = []
    real = ex._gather_rows
    monkeypatch.setattr(ex, "_gather_rows", lambda *a, **kw: gathered.append(a[0].shape) or real(*a, **kw))
    _, base = run_with_grads(lambda *a: moe.fused_experts(
        *a, variant="sm90", config=_with_wgrad_tma(cfgs.INTERPRETER_CONFIG, False)), x, gu, dn, idx, w, dy,
        torch.float32)
    cfg = _with_wgrad_tma(cfgs.INTERPRETER_CONFIG, True, rows=True)
    cfg["wgrad"]["ROWS_PARTS"] = 1
    _, one = run_with_grads(lambda *a: moe.fused_experts(*a, variant="sm90", config=cfg), x, gu, dn, idx, w, dy,
                            torch.float32)
    assert gathered == [torch.Size([T, H]), torch.Size([T, H])]  # dY, then x: whole width, once each
    _assert_same_bits_and_close_to_reference(one, base, x, gu, dn, idx, w, dy)


@pytest.mark.parametrize("rows", [False, True])
def test_weight_gradients_stored_by_tma_match_the_pointer_stores(monkeypatch, rows):
    """wgrad "TMA_STORE": each dW tile by one TMA store (clipped at M and N); same bits."""
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    sm90 = importlib.import_module(moe.__name__ + "._experts_sm90")
    E, H, I = 5, 40, 24  # neither a multiple of the tiles: the boxes overhang
    x, gu, dn, idx, w = make_inputs(11, H, I, E, 2, seed=48, drop=3)
    dy = torch.randn(11, H, generator=torch.Generator().manual_seed(49))
    calls = []
    real = sm90.weight_descriptor
    monkeypatch.setattr(sm90, "weight_descriptor", lambda *a: calls.append(a[0].shape) or real(*a))
    results = []
    for store in (False, True):
        cfg = _with_wgrad_tma(cfgs.INTERPRETER_CONFIG, True, rows)
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
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    ex = importlib.import_module(moe.__name__ + ".experts")
    x, gu, dn, idx, w = make_inputs(11, 40, 24, 5, 2, seed=50, drop=3)
    dy = torch.randn(11, 40, generator=torch.Generator().manual_seed(51))
    grids = []
    real = ex._wgrad_launch

    class Recording:  # the wgrad launcher, noting each grid
        def split(self, grid, *a, **kw):
            grids.append(grid[0])
            return real.split(grid, *a, **kw)

    monkeypatch.setattr(ex, "_wgrad_launch", Recording())
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
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    kern = importlib.import_module(moe.__name__ + "._experts_kernels")
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
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    assert "failures: 0" in res.stdout and res.stdout.count("ok   sm90 wgrad") >= 10, res.stdout[-2000:]


def test_gather_rows_copies_real_rows_and_zeroes_padding():
    ex = importlib.import_module(moe.__name__ + ".experts")
    routing = importlib.import_module(moe.__name__ + "._experts_routing")
    T, K, E, H = 9, 2, 4, 40
    _, _, _, idx, _ = make_inputs(T, 8, 8, E, K, seed=47, drop=2)
    r = routing.align_rows(idx, E, 16)
    src = torch.randn(T, H, dtype=torch.bfloat16)
    out = ex._gather_rows(src, r, K)
    assert out.shape == (r.num_rows, H) and out.dtype == src.dtype
    starts = r.expert_start.tolist()
    used_end = max(s + -(-c // 16) * 16 for s, c in zip(starts, r.expert_count.tolist(), strict=True))
    for p in range(used_end):  # rows past the last expert's block are never read: not checked
        flat = int(r.rows[p])
        want = src[flat // K] if flat >= 0 else torch.zeros(H, dtype=src.dtype)
        assert torch.equal(out[p], want), f"row {p} (pair {flat})"


def test_wgrad_tma_is_skipped_when_a_box_could_leave_its_expert(monkeypatch):
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    cfg = _with_wgrad_tma(cfgs.INTERPRETER_CONFIG, True)
    cfg["wgrad"]["BLOCK_K"] = 2 * cfg["block_m"]  # a box would span two experts' rows
    x, gu, dn, idx, w = make_inputs(7, 40, 24, 5, 2, seed=43)
    dy = torch.randn(7, 40, generator=torch.Generator().manual_seed(44))
    calls = _count_row_descriptors(monkeypatch)
    _, got = run_with_grads(lambda *a: moe.fused_experts(*a, variant="sm90", config=cfg), x, gu, dn, idx, w,
                            dy, torch.float32)
    assert calls == []
    _, ref = run_with_grads(lambda *a: loop_reference(*a), x, gu, dn, idx, w, dy, torch.float64)
    for got_g, want, name in zip(got, ref, NAMES, strict=True):
        assert_close_rel(got_g, want, 1e-5, name)


def test_many_pairs_take_the_fused_mapping_path_and_stay_correct():
    routing = importlib.import_module(moe.__name__ + "._experts_routing")
    T, K = 300, 2
    assert T * K > routing.SMALL_PAIRS
    x, gu, dn, idx, w = make_inputs(T, 32, 16, 4, K, seed=12, drop=3)
    with torch.no_grad():
        out = moe.fused_experts(x, gu, dn, idx, w, variant="sm80")
    torch.testing.assert_close(out.double(), loop_reference(x, gu, dn, idx, w), rtol=1e-4, atol=1e-5)


def test_gradients_of_a_subset_equal_those_of_the_full_backward():
    """Frozen expert weights (or a frozen router) skip their gradient GEMMs, not correctness."""
    x, gu, dn, idx, w = make_inputs(5, 32, 16, 4, 2, seed=21, drop=1)
    dy = torch.randn(5, 32, generator=torch.Generator().manual_seed(22))
    _, full = run_with_grads(lambda *a: moe.fused_experts(*a, variant="sm80"), x, gu, dn, idx, w, dy,
                             torch.float32)
    for wanted in ((0,), (1,), (2, 3), (0, 3)):
        leaves = [t.detach().clone().requires_grad_(i in wanted) for i, t in enumerate((x, gu, dn, w))]
        moe.fused_experts(leaves[0], leaves[1], leaves[2], idx, leaves[3], variant="sm80").backward(dy)
        for i, leaf in enumerate(leaves):
            if i in wanted:
                torch.testing.assert_close(leaf.grad, full[i], rtol=0, atol=0)
            else:
                assert leaf.grad is None


def test_large_batch_gradients_match_the_float64_loop():
    """T*K above the one-program alignment: the mapping kernels' rows feed the backward too."""
    routing = importlib.import_module(moe.__name__ + "._experts_routing")
    T, K = 300, 2
    assert T * K > routing.SMALL_PAIRS
    x, gu, dn, idx, w = make_inputs(T, 32, 16, 4, K, seed=23, drop=3)
    dy = torch.randn(T, 32, generator=torch.Generator().manual_seed(24))
    out, grads = run_with_grads(lambda *a: moe.fused_experts(*a, variant="sm80"), x, gu, dn, idx, w, dy,
                                torch.float32)
    _, ref = run_with_grads(lambda *a: loop_reference(*a), x, gu, dn, idx, w, dy, torch.float64)
    for got, want, name in zip(grads, ref, ("x", "gate_up_proj", "down_proj", "topk_weights"), strict=True):
        assert_close_rel(got, want, 1e-5, name)


class _GraphRecorder:
    """A torch.compile backend that keeps the FX graphs it is given and runs them as aot_eager."""

    def __init__(self):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.ops: list[str] = []

        def keep(gm, example_inputs):
            self.ops += [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm.forward)

        self.backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)


@pytest.mark.parametrize(("T", "ids", "variant"), [(0, None, "sm80"), (3, -1, "reference"), (3, -1, "sm80")])
def test_torch_compile_training_with_nothing_routed_gives_zero_gradients(T, ids, variant):
    """No (token, k) pair routed: the backward op's reference gradients were expanded views of one
    scalar, which a custom op may not return (they alias), so the compiled backward failed."""
    torch._dynamo.reset()
    x, gu, dn, idx, w = make_inputs(max(T, 1), 32, 16, 4, 2)
    x, idx, w = x[:T], idx[:T], w[:T]
    if ids is not None:
        idx = torch.full_like(idx, ids)
    leaves = [t.clone().requires_grad_() for t in (x, gu, dn, w)]
    fn = torch.compile(lambda *a: moe.fused_experts(a[0], a[1], a[2], idx, a[3], variant=variant),
                       backend="aot_eager", fullgraph=True)
    fn(*leaves).sum().backward()
    assert all(t.grad is not None and not t.grad.any() for t in leaves)


def test_torch_compile_of_a_torch_func_transform_runs_the_reference():
    """compile(grad(f)): under the transform the eager path (default variant: the reference) runs,
    not the custom op, whose Function has no setup_context for functorch."""
    torch._dynamo.reset()
    x, gu, dn, idx, w = make_inputs(6, 32, 16, 4, 2)
    grad = torch.func.grad(lambda xx: moe.fused_experts(xx, gu, dn, idx, w).sum())
    # (not fullgraph: the reference's routing is data-dependent)
    torch.testing.assert_close(torch.compile(grad, backend="aot_eager")(x), grad(x))


@pytest.mark.parametrize("variant", [*TRITON_VARIANTS, "reference"])
def test_torch_compile_fullgraph_gives_the_eager_bits(variant):
    """Under torch.compile fused_experts is one custom op forward and one backward: no graph break
    (fullgraph), the eager path's output and gradients bit for bit."""
    x, gu, dn, idx, w = make_inputs(5, 32, 16, 4, 2, drop=1)
    rec = _GraphRecorder()

    def f(x, gu, dn, idx, w):
        return moe.fused_experts(x, gu, dn, idx, w, variant=variant)

    compiled = torch.compile(f, backend=rec.backend, fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x, gu, dn, idx, w), f(x, gu, dn, idx, w))
    assert any(op.endswith("fused_experts.default") for op in rec.ops), rec.ops
    dy = torch.randn(5, 32)
    got, got_grads = run_with_grads(compiled, x, gu, dn, idx, w, dy, torch.float32)
    want, want_grads = run_with_grads(f, x, gu, dn, idx, w, dy, torch.float32)
    assert any(op.endswith("fused_experts_train.default") for op in rec.ops), rec.ops
    assert any(op.endswith("fused_experts_backward.default") for op in rec.ops), rec.ops
    assert torch.equal(got, want)
    for name, a, b in zip(NAMES, got_grads, want_grads, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("variant", TRITON_VARIANTS)
def test_torch_compile_computes_only_the_gradients_asked_for(variant, monkeypatch):
    ex = importlib.import_module(moe.__name__ + ".experts")
    asked = []
    backward = ex._backward
    monkeypatch.setattr(ex, "_backward", lambda *a: asked.append(a[-1]) or backward(*a))
    x, gu, dn, idx, w = make_inputs(4, 32, 16, 4, 2)
    xg = x.clone().requires_grad_()
    compiled = torch.compile(lambda *a: moe.fused_experts(*a, variant=variant), backend="aot_eager", fullgraph=True)
    compiled(xg, gu, dn, idx, w).sum().backward()
    assert asked == [(True, False, False, False)]  # no weight gradient computed for frozen weights
    xe = x.clone().requires_grad_()
    moe.fused_experts(xe, gu, dn, idx, w, variant=variant).sum().backward()
    assert torch.equal(xg.grad, xe.grad)


def test_torch_compile_with_dynamic_token_counts():
    compiled = torch.compile(lambda *a: moe.fused_experts(*a, variant="sm80"), backend="aot_eager", dynamic=True,
                             fullgraph=True)
    for T in (3, 6, 1):
        x, gu, dn, idx, w = make_inputs(T, 32, 16, 4, 2, seed=T)
        with torch.no_grad():
            assert torch.equal(compiled(x, gu, dn, idx, w), moe.fused_experts(x, gu, dn, idx, w, variant="sm80"))
        got, got_grads = run_with_grads(compiled, x, gu, dn, idx, w, torch.ones(T, 32), torch.float32)
        want, want_grads = run_with_grads(lambda *a: moe.fused_experts(*a, variant="sm80"), x, gu, dn, idx, w,
                                          torch.ones(T, 32), torch.float32)
        assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))


def test_torch_compile_with_a_pinned_config_has_no_graph_break():
    cfg = _with_decode()
    x, gu, dn, idx, w = make_inputs(2, 32, 16, 4, 2)
    f = lambda *a: moe.fused_experts(*a, variant="sm80", config=cfg)  # noqa: E731
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(x, gu, dn, idx, w), f(x, gu, dn, idx, w))


def test_torch_compile_keeps_the_eager_checks():
    x, gu, dn, idx, w = (t.double() if t.is_floating_point() else t for t in make_inputs(3, 32, 16, 4, 2))
    compiled = torch.compile(lambda *a: moe.fused_experts(*a, variant="sm80"), backend="aot_eager")
    for grad in (False, True):
        with pytest.raises(TypeError, match="variant 'sm80' supports float16/bfloat16/float32 `x`"):
            compiled(x.clone().requires_grad_(grad), gu, dn, idx, w)


def test_a_symbolic_pair_count_picks_the_bucket_without_a_cache_key():
    # torch.compile with dynamic shapes hands the training op's fake a SymInt token count
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    env = ShapeEnv()
    pairs = env.create_symintnode(env.create_symbol(40, source=ConstantSource("pairs"),
                                                    dynamic_dim=DimDynamic.DYNAMIC), hint=40)
    got = cfgs.picked_config(90, 8, 64, 32, pairs, 0, 2, lambda: 232448)
    assert got == cfgs.picked_config(90, 8, 64, 32, 40, 0, 2, lambda: 232448)


@pytest.mark.parametrize("variant", TRITON_VARIANTS)
def test_double_backward_is_an_error_not_a_silent_zero(variant):
    x, gu, dn, idx, w = make_inputs(3, 32, 16, 4, 2)
    gu = gu.requires_grad_()
    out = moe.fused_experts(x.requires_grad_(), gu, dn, idx, w, variant=variant)
    (gx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gx.square().sum().backward()


@pytest.mark.parametrize("variant", TRITON_VARIANTS)
def test_torch_func_transforms_are_refused_by_the_triton_variants(variant):
    x, gu, dn, idx, w = make_inputs(3, 32, 16, 4, 2)
    with pytest.raises(ValueError, match=r"torch.func transforms .* use variant='reference'"):
        torch.func.vmap(lambda xx: moe.fused_experts(xx, gu, dn, idx, w, variant=variant), in_dims=0)(x[None])
    ref = torch.func.grad(lambda xx: moe.fused_experts(xx, gu, dn, idx, w, variant="reference").sum())(x)
    xr = x.clone().requires_grad_()
    moe.fused_experts_reference(xr, gu, dn, idx, w).sum().backward()
    torch.testing.assert_close(ref, xr.grad)
    # the default variant and the layers (whose classes force a variant) run the reference there
    default = torch.func.grad(lambda xx: moe.fused_experts(xx, gu, dn, idx, w).sum())(x)
    torch.testing.assert_close(default, xr.grad)
    module = build_experts("qwen3_moe")
    E = module.gate_up_proj.shape[0]
    hidden = torch.randn(2, 3, 32)
    k_idx = torch.stack([torch.randperm(E)[:2] for _ in range(3)])
    k_w = torch.rand(3, 2)
    layer = getattr(moe.layers, "MoEExpertsSm80" if variant == "sm80" else "MoEExpertsSm90")
    batched = torch.func.vmap(lambda h: layer.forward(module, h, k_idx, k_w))(hidden)
    for b in range(2):
        torch.testing.assert_close(batched[b], module.forward(hidden[b], k_idx, k_w), rtol=1e-4, atol=1e-5)


def test_reference_with_nothing_routed_still_gives_zero_gradients():
    x, gu, dn, idx, w = make_inputs(3, 32, 16, 4, 2)
    leaves = [t.requires_grad_() for t in (x, gu, dn, w)]
    moe.fused_experts_reference(leaves[0], leaves[1], leaves[2], torch.full_like(idx, -1), leaves[3]).sum().backward()
    assert all(t.grad is not None and not t.grad.any() for t in leaves)


@pytest.mark.parametrize("T", [3, 300])  # one-program alignment (<= 512 pairs); the mapping kernels
def test_int64_ids_past_the_int32_range_are_dropped(T):
    x, gu, dn, idx, w = make_inputs(T, 32, 16, 4, 2, seed=T)
    bad = idx.clone()
    bad[0, 0], bad[T - 1, 1] = 2**32, -(2**40)
    keep = bad.masked_fill((bad < 0) | (bad >= 4), -1)
    out = moe.fused_experts(x, gu, dn, bad, w, variant="sm80", check_indices=False)
    assert_close_rel(out, loop_reference(x, gu, dn, keep, w), 1e-6, "output")


def test_inference_path_matches_autograd_path():
    x, gu, dn, idx, w = make_inputs(7, 32, 16, 4, 2, seed=7)
    with torch.no_grad():
        a = moe.fused_experts(x, gu, dn, idx, w, variant="sm80")
    b = moe.fused_experts(x.requires_grad_(), gu, dn, idx, w, variant="sm80")
    torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


def test_empty_batch_gives_empty_output_and_zero_grads():
    x, gu, dn, idx, w = make_inputs(1, 32, 16, 4, 2)
    gu.requires_grad_()
    out = moe.fused_experts(x[:0], gu, dn, idx[:0], w[:0], variant="sm80")
    assert out.shape == (0, 32)
    out.sum().backward()
    assert torch.equal(gu.grad, torch.zeros_like(gu))


@pytest.mark.parametrize("layer", ["MoEExpertsSm80", "MoEExpertsSm90", "MoEExpertsReference", "MoEExperts"])
def test_layers_take_an_empty_batch(layer):
    """No tokens ([0, H] or [B, 0, H] hidden states): an empty output, as transformers' eager gives
    (a `reshape(T, -1)` of the routing cannot infer K from zero elements)."""
    module = build_experts("qwen3_moe")
    K = 2
    for shape in ((0, 32), (2, 0, 32)):
        hidden = torch.randn(*shape)
        idx = torch.zeros(*shape[:-1], K, dtype=torch.long)
        weights = torch.zeros(*shape[:-1], K)
        out = getattr(moe.layers, layer).forward(module, hidden, idx, weights)
        assert out.shape == hidden.shape == module.forward(hidden.reshape(-1, 32), idx.reshape(-1, K),
                                                           weights.reshape(-1, K)).reshape(shape).shape
    assert moe.experts_forward(module, torch.randn(0, 32), torch.zeros(0, K, dtype=torch.long),
                               torch.zeros(0, K)).shape == (0, 32)


def test_expanded_weights_take_the_pointer_path_and_stay_correct():
    """A stride-0 view (one expert's weights expanded over E) is no TMA tensor map: tma_ok refuses it,
    and the sm90 variant reads it with pointer loads, giving the float64 loop's result."""
    sm90 = importlib.import_module(moe.__name__ + "._experts_sm90")
    x, gu, dn, idx, w = make_inputs(6, 32, 16, 4, 2)
    gu_e, dn_e = gu[:1].expand_as(gu), dn[:1].expand_as(dn)
    assert sm90.tma_ok(gu) and not sm90.tma_ok(gu_e) and not sm90.tma_ok(dn_e)
    out = moe.fused_experts(x, gu_e, dn_e, idx, w, variant="sm90")
    want = moe.fused_experts_reference(x.double(), gu_e.double(), dn_e.double(), idx, w.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", TRITON_VARIANTS)
def test_inner_offsets_past_int32_run_on_contiguous_copies(variant, monkeypatch):
    """Offsets within a row of x or an expert of a weight are 32-bit in the kernels: a view whose
    inner strides reach past 2**31 elements (here the limit is lowered to reach it with small
    tensors) runs on contiguous copies, and its gradients reach the caller's tensors."""
    ex = importlib.import_module(moe.__name__ + ".experts")
    monkeypatch.setattr(ex, "_INNER_OFFSET_MAX", 1000)
    seen = []
    gemm = ex._gemm
    monkeypatch.setattr(ex, "_gemm", lambda a, weight, *args, **kw: (seen.append((a.stride(), weight.stride())),
                                                                       gemm(a, weight, *args, **kw))[1])
    x0, gu, dn, idx, w = make_inputs(40, 32, 16, 4, 2)
    x = x0.t().contiguous().t().requires_grad_()  # column stride 40: 31 * 40 > 1000
    gu_t = gu.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # inner offset > 1000 too
    out = moe.fused_experts(x, gu_t, dn, idx, w, variant=variant)
    dy = torch.randn_like(out)
    out.backward(dy)
    xr, gur = x0.double().requires_grad_(), gu.double().requires_grad_()
    want = moe.fused_experts_reference(xr, gur, dn.double(), idx, w.double())
    want.backward(dy.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gu_t.grad.double(), gur.grad, rtol=1e-4, atol=1e-5)
    assert seen and all(a[-1] == 1 and wt[-1] == 1 for a, wt in seen)  # only copies reached a GEMM


@pytest.mark.parametrize("variant", TRITON_VARIANTS)
def test_zero_hidden_size_launches_no_empty_grid(variant):
    """H = 0: the GEMMs and weight gradients have no tiles, so nothing is launched (the weight-gradient
    kernel's tile arithmetic divided by its zero tile count; numpy's errors raise here to catch it)."""
    import numpy as np

    x, gu, dn = torch.randn(4, 0), torch.randn(3, 16, 0), torch.randn(3, 0, 8)
    idx, w = torch.tensor([[0, 1], [2, 0], [1, -1], [2, 1]]), torch.rand(4, 2)
    for t in (x, gu, dn, w):
        t.requires_grad_()
    with np.errstate(all="raise"):
        out = moe.fused_experts(x, gu, dn, idx, w, variant=variant)
        out.sum().backward()
    assert out.shape == (4, 0) and gu.grad.shape == gu.shape and dn.grad.shape == dn.shape
    assert x.grad.shape == x.shape and torch.equal(w.grad, torch.zeros_like(w))


# ------------------------------------------------------------------ routing alignment


@pytest.mark.parametrize("small", [True, False], ids=["one_triton_program", "mapping_kernels"])
def test_alignment_groups_pairs_by_expert_in_token_order(small, monkeypatch):
    routing = importlib.import_module(moe.__name__ + "._experts_routing")
    if not small:
        monkeypatch.setattr(routing, "SMALL_PAIRS", 0)
    idx = torch.tensor([[2, 0], [0, -1], [2, 5], [7, 0]])
    r = routing.align_rows(idx, num_experts=6, block_m=4)  # 7 is out of range: dropped
    assert r.num_rows % 4 == 0 and r.num_rows >= 4
    rows = r.rows.tolist()
    for t in range(4):
        for k in range(2):
            p = int(r.token_topk_to_pos[t, k])
            e = int(idx[t, k])
            if 0 <= e < 6:
                assert rows[p] == t * 2 + k
                assert int(r.row_expert[p]) == e
                assert int(r.expert_start[e]) <= p < int(r.expert_start[e]) + int(r.expert_count[e])
            else:
                assert p == -1
    assert r.expert_count.tolist() == [3, 0, 2, 0, 0, 1]
    assert rows[int(r.expert_start[0]):int(r.expert_start[0]) + 3] == [1, 2, 7]  # token order kept
    assert sum(1 for v in rows if v >= 0) == 6


def test_small_alignment_kernel_equals_torch_alignment(monkeypatch):
    routing = importlib.import_module(moe.__name__ + "._experts_routing")
    g = torch.Generator().manual_seed(4)
    for T, K, E, block_m in [(1, 8, 128, 16), (9, 3, 7, 32), (20, 2, 40, 16)]:
        idx = torch.randint(-1, E + 1, (T, K), generator=g)
        small = routing._align_small(idx, E, block_m)
        monkeypatch.setattr(routing, "SMALL_PAIRS", 0)
        full = routing.align_rows(idx, E, block_m)
        monkeypatch.undo()
        for field in ("rows", "row_expert", "expert_start", "expert_count", "token_topk_to_pos"):
            assert torch.equal(getattr(small, field), getattr(full, field)), field
        assert small.num_rows == full.num_rows


# ------------------------------------------------------------------ errors


def test_bad_inputs_raise_naming_the_argument():
    x, gu, dn, idx, w = make_inputs(3, 32, 16, 4, 2)
    cases = [
        ((x.double(), gu, dn, idx, w), TypeError, "gate_up_proj"),
        ((x, gu.half(), dn, idx, w), TypeError, "gate_up_proj"),
        ((x, gu, dn, idx.float(), w), TypeError, "topk_idx"),
        ((x, gu, dn, idx, idx), TypeError, "topk_weights"),
        ((x, gu, dn, idx, "w"), TypeError, "topk_weights"),
        ((x[0], gu, dn, idx, w), ValueError, "`x`"),
        ((x, gu[:, :31], dn, idx, w), ValueError, "gate_up_proj"),
        ((x, gu, dn[:, :, :8], idx, w), ValueError, "down_proj"),
        ((x, gu, dn, idx[:2], w), ValueError, "topk_idx"),
        ((x, gu, dn, idx, w[:, :1]), ValueError, "topk_weights"),
        ((x, gu, dn, idx.to("meta"), w), ValueError, "topk_idx"),
        ((x, gu, dn, torch.where(idx == 0, 4, idx), w), ValueError, "topk_idx"),
        ((x, gu, dn, torch.where(idx == 0, -2, idx), w), ValueError, "topk_idx"),
    ]
    for args, exc, name in cases:
        with pytest.raises(exc, match=f"fused_experts: .*{name}"):
            moe.fused_experts(*args, variant="sm80")
    with pytest.raises(ValueError, match="fused_experts: `variant`"):
        moe.fused_experts(x, gu, dn, idx, w, variant="sm70")
    meta = [t.to("meta") for t in (x, gu, dn, idx, w)]
    for variant in (None, "reference", "sm80"):  # routing reads the ids: no data, a clear error
        with pytest.raises(ValueError, match="fused_experts: `x` and the other tensors must hold data"):
            moe.fused_experts(*meta, variant=variant)
    with pytest.raises(TypeError, match="fused_experts: variant 'sm80' supports"):
        moe.fused_experts(x.double(), gu.double(), dn.double(), idx, w, variant="sm80")
    with pytest.raises(TypeError, match="fused_experts: `check_indices`"):
        moe.fused_experts(x, gu, dn, idx, w, variant="sm80", check_indices="yes")
    bad = torch.where(idx == 0, 4, idx)
    with torch.no_grad():  # CPU inference: the default still checks (no sync to avoid here)
        with pytest.raises(ValueError, match="fused_experts: `topk_idx` entries"):
            moe.fused_experts(x, gu, dn, bad, w, variant="sm80")


def test_every_launch_forward_and_backward_runs_inside_the_input_device_guard(monkeypatch):
    ex = importlib.import_module(moe.__name__ + ".experts")
    rt = importlib.import_module(moe.__name__ + "._experts_routing")
    guards: list[torch.device] = []
    launches: list[list[torch.device]] = []

    @contextlib.contextmanager
    def recording_guard(t):
        guards.append(t.device)
        try:
            yield t.device
        finally:
            guards.pop()

    class Kernel:  # records the guards active at each launch, then launches
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(list(guards))
                return self.kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(ex, "device_guard", recording_guard)
    # every launcher's kernel (the interpreter always launches through `kernel[grid](...)`)
    for launcher in (ex._gemm_launch, ex._combine_launch, ex._wgrad_launch, rt._align_small_launch,
                     ex._decode_gate_up_launch, ex._decode_down_launch):
        monkeypatch.setattr(launcher, "kernel", Kernel(launcher.kernel))
    x, gu, dn, idx, w = make_inputs(3, 32, 16, 4, 2)
    leaves = [t.requires_grad_() for t in (x, gu, dn, w)]
    moe.fused_experts(leaves[0], leaves[1], leaves[2], idx, leaves[3], variant="sm90").sum().backward()
    assert len(launches) == 4 + 5  # align, gate_up, down, combine | dgrad, dx, combine, 2 wgrads
    moe.fused_experts(x.detach(), gu.detach(), dn.detach(), idx, w.detach(), variant="sm90", config=_with_decode())
    assert len(launches) == 9 + 2  # the decode path: gate_up, down
    assert all(stack == [x.device] for stack in launches), launches


DECODE = {"max_tokens": 3, "gate_up": {"BLOCK_N": 8, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2},
          "down": {"BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2}}


def _with_decode(decode: dict | None = None) -> dict:
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    return {**copy.deepcopy(cfgs.INTERPRETER_CONFIG), "decode": copy.deepcopy(decode or DECODE)}


def _kernel_names(calls) -> list[str]:
    return [getattr(c.launcher.kernel, "__name__", None) or c.launcher.kernel.fn.__name__ for c in calls]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", TRITON_VARIANTS)
@pytest.mark.parametrize("T", [1, 3])
def test_decode_path_matches_the_float64_loop(T, variant, dtype):
    """The token-major "decode" path: two launches (no alignment, no combine); ids -1 and >= E
    dropped; strided x, ids and weights; H and I not multiples of the tiles."""
    from kernelhub.device import CachedLaunch

    E, H, I, K = 6, 40, 24, 3
    x, gu, dn, idx, w = make_inputs(T, H, I, E, K, dtype=dtype, seed=T)
    idx[0, 1] = -1
    idx[T - 1, 2] = E  # the EP sentinel: dropped like -1 (check_indices=False)
    x_strided = torch.zeros(T, 2 * H, dtype=dtype)[:, ::2]
    x_strided.copy_(x)
    idx_t = idx.t().contiguous().t()  # strides (1, T)
    w32 = w.float()
    with CachedLaunch.recording() as calls:
        out = moe.fused_experts(x_strided, gu, dn, idx_t, w32, variant=variant, config=_with_decode(),
                                check_indices=False)
    assert _kernel_names(calls) == ["_decode_gate_up_kernel", "_decode_down_kernel"]
    keep = idx.masked_fill(idx >= E, -1)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert_close_rel(out, loop_reference(x, gu, dn, keep, w32), tol, "decode output")
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    grouped = moe.fused_experts(x, gu, dn, keep, w32, variant=variant, config=cfgs.INTERPRETER_CONFIG)
    assert_close_rel(out, grouped, tol, "decode vs grouped path")


def test_decode_key_applies_up_to_max_tokens_and_only_to_inference():
    from kernelhub.device import CachedLaunch

    E, H, I, K = 5, 32, 16, 2
    cfg = _with_decode({**DECODE, "max_tokens": 2})
    for T, grad, decode in ((2, False, True), (3, False, False), (1, True, False)):
        x, gu, dn, idx, w = make_inputs(T, H, I, E, K)
        x.requires_grad_(grad)
        with CachedLaunch.recording() as calls:
            out = moe.fused_experts(x, gu, dn, idx, w, variant="sm80", config=cfg)
        names = _kernel_names(calls)
        assert ("_decode_down_kernel" in names) is decode, (T, grad, names)
        assert ("_grouped_gemm_kernel" in names) is not decode, (T, grad, names)
        assert_close_rel(out.detach(), loop_reference(x.detach(), gu, dn, idx, w), 1e-6, f"T={T} grad={grad}")
        if grad:
            out.sum().backward()
            assert x.grad is not None


def test_decode_stages_fit_the_shared_memory():
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    bucket = _with_decode({**DECODE, "gate_up": {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4}})
    per_stage = (2 * 16 + 1) * 256 * 2
    fitted = cfgs.fit_shared_memory(bucket, 3 * per_stage, 2)["decode"]
    assert fitted["gate_up"]["num_stages"] == 3 and fitted["down"]["num_stages"] == 2
    assert bucket["decode"]["gate_up"]["num_stages"] == 4  # the cached bucket is not edited


def test_paired_tiles_count_twice_block_m_when_stages_are_fitted():
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    bucket = copy.deepcopy(cfgs.pick_config(90, 128, 2048, 768, 8 * 4096))
    bucket["block_m"] = 64
    bucket.pop("pair_m", None)  # the shipped Qwen3-30B-A3B entry pairs this bucket already
    tile = {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}
    bucket["down"] = dict(tile)
    smem = 4 * (128 + 128) * 64 * 2  # four stages of a 128-row tile (one byte short below)
    single = cfgs.fit_shared_memory(bucket, smem - 1, 2)["down"]["num_stages"]  # 64-row tiles fit 4
    bucket["pair_m"] = True
    paired = cfgs.fit_shared_memory(bucket, smem - 1, 2)["down"]["num_stages"]  # 128-row tiles: 3
    assert (single, paired) == (4, 3)


def test_stages_fit_the_shared_memory_of_each_device_index(fake_gpus):
    ex = importlib.import_module(moe.__name__ + ".experts")
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    fake_gpus.specs[0]["smem"] = 100 * 1024  # an sm86-like card next to the sm90 one
    cfgs.clear_config_cache()
    try:
        small = ex._config("sm80", 8, 4096, 14336, 1024, None, torch.device("cuda", 0))
        big = ex._config("sm80", 8, 4096, 14336, 1024, None, torch.device("cuda", 1))
    finally:
        cfgs.clear_config_cache()
    assert small["block_m"] == big["block_m"]
    for stage in ("gate_up", "down", "dgrad"):
        c = small[stage]
        per_stage = (small["block_m"] + (2 if stage == "gate_up" else 1) * c["BLOCK_N"]) * c["BLOCK_K"] * 2
        assert c["num_stages"] == 2 or c["num_stages"] * per_stage <= 100 * 1024 - 1024
    assert small["gate_up"]["num_stages"] < big["gate_up"]["num_stages"]
    pinned = copy.deepcopy(cfgs.INTERPRETER_CONFIG)
    assert ex._config("sm80", 8, 4096, 14336, 1024, pinned, torch.device("cuda", 0)) is pinned


@pytest.mark.parametrize("edit,error,words", [
    (lambda c: c.pop("wgrad"), ValueError, "missing key 'wgrad'"),
    (lambda c: c.update(colour=1), ValueError, "unknown keys ['colour']"),
    (lambda c: c.update(block_m=24), ValueError, "['block_m'] must be a power of two"),
    (lambda c: c["gate_up"].update(BLOCK_K=8), ValueError, "['gate_up']['BLOCK_K'] must be a power of two >= 16"),
    (lambda c: c["down"].update(num_warps=3), ValueError, "['down']['num_warps'] must be 1, 2, 4, 8 or 16"),
    (lambda c: c["dgrad"].pop("GROUP_M"), ValueError, "['dgrad']: missing key 'GROUP_M'"),
    (lambda c: c["wgrad"].update(ROWS="yes"), TypeError, "['wgrad']['ROWS'] must be true or false"),
    (lambda c: c["wgrad"].update(ROWS_PARTS=0), ValueError, "['wgrad']['ROWS_PARTS'] must be an int >= 1"),
    (lambda c: c["wgrad"].update(TMA_LOAD=True), ValueError, "['wgrad']: unknown keys ['TMA_LOAD']"),
    (lambda c: c.update(tma=1), TypeError, "['tma'] must be true or false"),
    (lambda c: c.update(pair_m="on"), TypeError, "['pair_m'] must be true or false"),
    (lambda c: c["dgrad"].update(maxnreg=300), ValueError, "['dgrad']['maxnreg'] must be an int in [24, 255]"),
    (lambda c: c["wgrad"].update(maxnreg=True), ValueError, "['wgrad']['maxnreg'] must be an int in [24, 255]"),
    (lambda c: c["wgrad"].update(PERSISTENT=-1), ValueError, "['wgrad']['PERSISTENT'] must be an int >= 0"),
    (lambda c: c["wgrad"].update(FLAT_STEPS=4), ValueError, "set 'PERSISTENT' (programs per SM) >= 1 too"),
    (lambda c: c["wgrad"].update(PERSISTENT=1, FLAT_STEPS=-2), ValueError, "['FLAT_STEPS'] must be an int >= 0"),
    (lambda c: c["down"].update(PERSISTENT=-1), ValueError, "['down']['PERSISTENT'] must be an int >= 0"),
    (lambda c: c["gate_up"].update(A_TMA=1), TypeError, "['gate_up']['A_TMA'] must be true or false"),
    (lambda c: c["down"].update(ROWS=True), ValueError, "['down']: 'ROWS' is a gate_up key"),
    (lambda c: c["dgrad"].update(EPI_HALVES=True), ValueError, "['dgrad']: 'EPI_HALVES' is a gate_up key"),
    (lambda c: c.update(decode=[1]), TypeError, "['decode'] must be a dict"),
    (lambda c: c.update(decode={"gate_up": DECODE["gate_up"], "down": DECODE["down"]}), ValueError,
     "['decode']: missing key 'max_tokens'"),
    (lambda c: c.update(decode={**DECODE, "max_tokens": 0}), ValueError,
     "['decode']['max_tokens'] must be an int >= 1"),
    (lambda c: c.update(decode={**DECODE, "rows": 1}), ValueError, "['decode']: unknown keys ['rows']"),
    (lambda c: c.update(decode={"max_tokens": 1, "gate_up": DECODE["gate_up"]}), ValueError,
     "['decode']: missing key 'down'"),
    (lambda c: c.update(decode={**DECODE, "down": {**DECODE["down"], "BLOCK_N": 2}}), ValueError,
     "['decode']['down']['BLOCK_N'] must be a power of two >= 4"),
    (lambda c: c.update(decode={**DECODE, "down": {**DECODE["down"], "BLOCK_K": 24}}), ValueError,
     "['decode']['down']['BLOCK_K'] must be a power of two >= 16"),
    (lambda c: c.update(decode={**DECODE, "gate_up": {"BLOCK_N": 8}}), ValueError,
     "['decode']['gate_up']: missing key 'BLOCK_K'"),
])
def test_a_bad_pinned_config_is_a_clear_error(edit, error, words):
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    cfg = copy.deepcopy(cfgs.INTERPRETER_CONFIG)
    edit(cfg)
    x, gu, dn, idx, w = make_inputs(3, 32, 16, 4, 2)
    with pytest.raises(error) as info:
        moe.fused_experts(x, gu, dn, idx, w, variant="sm80", config=cfg)
    assert "fused_experts: `config`" in str(info.value) and words in str(info.value), str(info.value)


@contextlib.contextmanager
def _config_dir(monkeypatch, path: Path):
    """The configs module reading KERNELHUB_MOE_CONFIG_DIR=path, its caches emptied around."""
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    monkeypatch.setenv("KERNELHUB_MOE_CONFIG_DIR", str(path))
    cfgs.clear_config_cache()
    try:
        yield cfgs
    finally:
        cfgs.clear_config_cache()


def test_a_bad_config_file_names_the_file_and_the_bucket(tmp_path, monkeypatch):
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    data = json.loads((Path(cfgs._DIR) / "sm80.json").read_text())
    data["buckets"][1]["wgrad"]["BLOCK_M"] = 100
    (tmp_path / "sm80.json").write_text(json.dumps(data))
    with _config_dir(monkeypatch, tmp_path) as cfgs:
        with pytest.raises(ValueError, match=r"sm80.json: buckets\[1\]\['wgrad'\]\['BLOCK_M'\] must be a power of two"):
            cfgs.pick_config(80, 8, 64, 64, 16)


def test_a_config_dir_that_does_not_exist_is_named(tmp_path, monkeypatch):
    with _config_dir(monkeypatch, tmp_path / "tunde") as cfgs:  # a typo
        with pytest.raises(ValueError, match=r"KERNELHUB_MOE_CONFIG_DIR=.*tunde' is not a directory"):
            cfgs.pick_config(80, 8, 64, 64, 16)


def test_the_shipped_configs_are_valid():
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    for name in ("sm80.json", "sm90.json"):
        data = json.loads((Path(cfgs._DIR) / name).read_text())
        for i, bucket in enumerate(data["buckets"]):
            cfgs.check_bucket(bucket, f"{name}: buckets[{i}]")


def test_graph_capture_is_asked_of_the_inputs_device_not_the_current_one(fake_gpus, monkeypatch):
    # the index check (one host sync) is skipped while x's device captures a CUDA graph; torch
    # answers is_current_stream_capturing for the current device only
    from conftest import fake_cuda_tensor

    ex = importlib.import_module(moe.__name__ + ".experts")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: fake_gpus.current == 1)
    x = fake_cuda_tensor((4, 8), 1)
    fake_gpus.current = 0
    assert ex._capturing(x) is True
    assert fake_gpus.current == 0  # the caller's device, restored
    assert ex._capturing(fake_cuda_tensor((4, 8), 0)) is False


def test_variant_follows_the_capability_of_each_device_index(fake_gpus):
    assert moe.select_variant(torch.device("cuda", 0)) == "sm80"
    assert moe.select_variant(torch.device("cuda", 1)) == "sm90"
    assert moe.select_variant(torch.device("cpu")) == "reference"


# ------------------------------------------------------------------ layers on transformers models

MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeExperts",
                  dict(hidden_size=32, moe_intermediate_size=24, num_experts=5, num_experts_per_tok=2)),
    "mixtral": ("MixtralConfig", "MixtralExperts",
                dict(hidden_size=32, intermediate_size=24, num_local_experts=5, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeExperts",
                  dict(hidden_size=32, moe_intermediate_size=24, num_experts=5, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3Experts",
                    dict(hidden_size=32, moe_intermediate_size=24, n_routed_experts=5,
                         num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "OlmoeExperts",
              dict(hidden_size=32, intermediate_size=24, num_experts=5, num_experts_per_tok=2)),
}


def build_experts(model: str, seed: int = 0):
    transformers = pytest.importorskip("transformers")
    cfg_name, cls_name, kwargs = MODELS[model]
    cfg = getattr(transformers, cfg_name)(**kwargs)
    cfg._experts_implementation = "eager"
    cls = getattr(importlib.import_module(f"transformers.models.{model}.modeling_{model}"), cls_name)
    torch.manual_seed(seed)
    module = cls(cfg)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
    return module


@pytest.mark.parametrize("layer", ["MoEExpertsSm80", "MoEExpertsSm90", "MoEExperts"])
@pytest.mark.parametrize("model", list(MODELS))
def test_layer_forward_and_grads_equal_eager(model, layer):
    module = build_experts(model)
    E = module.gate_up_proj.shape[0]
    T, K = 6, 2
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(T, 32, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[1, 0] = E  # transformers skips id == E (the EP sentinel)
    weights = torch.rand(T, K, generator=g)
    dy = torch.randn(T, 32, generator=g)

    def run(forward):
        module.zero_grad()
        h = hidden.clone().requires_grad_()
        w = weights.clone().requires_grad_()
        out = forward(h, idx, w)
        (out * dy).sum().backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        return out.detach(), h.grad, w.grad, grads

    eager = run(module.forward)
    kernel = run(types.MethodType(getattr(moe.layers, layer).forward, module))
    torch.testing.assert_close(kernel[0], eager[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kernel[1], eager[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kernel[2], eager[2], rtol=1e-4, atol=1e-5)
    assert kernel[3].keys() == eager[3].keys()
    for name in eager[3]:
        torch.testing.assert_close(kernel[3][name], eager[3][name], rtol=1e-4, atol=1e-5, msg=name)


def test_layer_support_check_follows_weight_shape_changes():
    # the answer is kept per module while its weight shapes stay; a reshaped weight is checked again
    module = build_experts("qwen3_moe")
    E, two_i, H = module.gate_up_proj.shape
    hidden = torch.randn(3, H)
    idx = torch.tensor([[0, 1], [1, 2], [2, 0]])
    w = torch.rand(3, 2)
    forward = types.MethodType(moe.layers.MoEExpertsSm80.forward, module)
    assert forward(hidden, idx, w).shape == (3, H)
    module.down_proj = torch.nn.Parameter(torch.zeros(E, H, two_i // 2 + 1))
    with pytest.raises(ValueError, match=r"MoEExperts.forward: .*weight shapes"):
        forward(hidden, idx, w)
    module.down_proj = torch.nn.Parameter(torch.zeros(E, H, two_i // 2))
    assert forward(hidden, idx, w).shape == (3, H)


def test_layer_classes_declare_backward_as_kernel_toml_lists_them():
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((Path(__file__).resolve().parents[1] / "kernel.toml").read_text())
    assert meta["name"] == "moe" and isinstance(meta["version"], int) and meta["description"]
    assert sorted(meta["layers"]) == sorted(["MoEExperts", "MoEExpertsSm90", "MoEExpertsSm80", "MoEExpertsReference"])
    for name, entry in meta["layers"].items():
        cls = getattr(moe.layers, name)
        assert cls.has_backward is True and entry["has_backward"] is True
        assert cls.can_torch_compile is entry["can_torch_compile"]
        assert list(cls().parameters()) == []


def test_gpt_oss_is_reported_unsupported_and_falls_back_to_eager():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = transformers.GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4,
                                    num_experts_per_tok=2)
    cfg._experts_implementation = "eager"
    module = GptOssExperts(cfg)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
    reason = moe.unsupported_reason(module)
    assert reason is not None and "transposed" in reason
    assert moe.unsupported_reason(build_experts("qwen3_moe")) is None
    hidden = torch.randn(3, 32)
    idx = torch.tensor([[0, 1], [2, 3], [1, 2]])
    w = torch.rand(3, 2)
    with pytest.raises(ValueError, match="MoEExperts.forward: GptOssExperts"):
        types.MethodType(moe.MoEExpertsSm80.forward, module)(hidden, idx, w)
    torch.testing.assert_close(moe.experts_forward(module, hidden, idx, w), module(hidden, idx, w))


def _random_experts(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return module


def test_experts_with_identity_experts_are_reported_unsupported():
    # LongcatFlashExperts: gate_up_proj also covers "zero-compute" experts (ids >= n_routed_experts,
    # which add w * x): [E + Z, 2I, H] against down_proj [E, H, I]
    pytest.importorskip("transformers")
    from transformers.models.longcat_flash.configuration_longcat_flash import LongcatFlashConfig
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashExperts

    cfg = LongcatFlashConfig()
    cfg.hidden_size, cfg.expert_ffn_hidden_size, cfg.n_routed_experts, cfg.zero_expert_num = 16, 8, 4, 2
    reason = moe.unsupported_reason(_random_experts(LongcatFlashExperts(cfg)))
    assert reason is not None and "weight shapes (6, 16, 16), (4, 16, 8)" in reason


def test_experts_activation_is_read_from_act_fn_first():
    transformers = pytest.importorskip("transformers")
    import torch.nn.functional as F
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    # Lfm2MoeExperts calls F.silu and its config has no hidden_act: supported, and equal to eager
    cfg = transformers.Lfm2MoeConfig()
    cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts = 16, 8, 4
    cfg._experts_implementation = "eager"
    module = _random_experts(Lfm2MoeExperts(cfg))
    assert module.act_fn is F.silu and moe.unsupported_reason(module) is None
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 16, generator=g)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(5)])
    w = torch.rand(5, 2, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(moe.MoEExpertsReference.forward(module, hidden, idx, w), module(hidden, idx, w))
    # a config that says silu does not hide an act_fn that is something else
    cfg = transformers.MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=4)
    cfg._experts_implementation = "eager"
    module = MixtralExperts(cfg)
    module.act_fn = torch.nn.GELU()
    assert "activation GELU is not SiLU" in moe.unsupported_reason(module)


def test_registered_as_transformers_experts_implementation():
    pytest.importorskip("transformers")
    from transformers.integrations.moe import ExpertsInterface

    module = build_experts("mixtral")
    hidden = torch.randn(4, 32)
    idx = torch.tensor([[0, 1], [2, 3], [4, 0], [1, 2]])
    w = torch.rand(4, 2)
    eager = module(hidden, idx, w)
    previous = ExpertsInterface._global_mapping.get("kernelhub")
    ExpertsInterface.register("kernelhub", moe.experts_forward)
    try:
        module.config._experts_implementation = "kernelhub"
        out = module(hidden, idx, w)
    finally:
        _restore_kernelhub(ExpertsInterface, previous)
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)


def test_whole_model_with_kernelhub_experts_implementation_matches_eager(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.moe import ExpertsInterface

    experts_mod = importlib.import_module(moe.__name__ + ".experts")
    monkeypatch.setattr(experts_mod, "select_variant", lambda device: "sm90")  # Triton on the CPU
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), experts_implementation="eager")
    previous = ExpertsInterface._global_mapping.get("kernelhub")
    ExpertsInterface.register("kernelhub", moe.experts_forward)
    try:
        fused = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                              experts_implementation="kernelhub")
        fused.load_state_dict(eager.state_dict())
        ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
        out_e, out_f = eager(ids, labels=ids), fused(ids, labels=ids)
        out_e.loss.backward()
        out_f.loss.backward()
    finally:
        _restore_kernelhub(ExpertsInterface, previous)
    torch.testing.assert_close(out_f.logits, out_e.logits, rtol=1e-4, atol=1e-5)
    for (name, pe), pf in zip(eager.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(pf.grad, pe.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_tile_configs_have_every_stage():
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    for cap in (80, 90):
        for pairs in (8, 256, 4096, 131072):
            bucket = cfgs.pick_config(cap, 128, 2048, 768, pairs)
            assert {"block_m", "gate_up", "down", "dgrad", "wgrad"} <= bucket.keys()
    assert cfgs.pick_config(90, 128, 2048, 768, 8)["block_m"] <= cfgs.pick_config(90, 128, 2048, 768, 131072)[
        "block_m"]


def test_config_directory_override_is_read(tmp_path, monkeypatch):
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    data = json.loads((Path(cfgs.__file__).parent / "configs" / "sm90.json").read_text())
    tuned = dict(data["buckets"][-1], block_m=64, max_rows_per_expert=None)
    data["shapes"] = {cfgs.shape_key(8, 64, 32): [tuned]}
    (tmp_path / "sm90.json").write_text(json.dumps(data))
    monkeypatch.setenv("KERNELHUB_MOE_CONFIG_DIR", str(tmp_path))
    try:
        assert cfgs.pick_config(90, 8, 64, 32, 16)["block_m"] == 64
        assert cfgs.pick_config(90, 128, 2048, 768, 8) == data["buckets"][0]
    finally:
        monkeypatch.delenv("KERNELHUB_MOE_CONFIG_DIR")
        cfgs.clear_config_cache()


# ------------------------------------------------------------------ GPU


SHAPES = {
    "qwen3_30b_a3b": dict(E=128, H=2048, I=768, K=8),
    "mixtral_8x7b": dict(E=8, H=4096, I=14336, K=2),
}


def gpu_inputs(E, H, I, K, T, dtype=torch.bfloat16):
    dev = torch.device("cuda")
    x = torch.randn(T, H, device=dev, dtype=dtype)
    gu = torch.randn(E, 2 * I, H, device=dev, dtype=dtype) * H**-0.5
    dn = torch.randn(E, H, I, device=dev, dtype=dtype) * I**-0.5
    logits = torch.randn(T, E, device=dev)
    w, idx = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    return x, gu, dn, idx, w


@pytest.mark.gpu
@pytest.mark.parametrize("variant", TRITON_VARIANTS)
@pytest.mark.parametrize("T", [1, 37, 1024])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_bf16_matches_reference(shape, T, variant):
    s = SHAPES[shape]
    if variant == "sm90" and moe.select_variant(torch.device("cuda")) != "sm90":
        pytest.skip("sm90 path needs a capability 9.x GPU")
    x, gu, dn, idx, w = gpu_inputs(s["E"], s["H"], s["I"], s["K"], T)
    dy = torch.randn_like(x)
    out, grads = run_with_grads(lambda *a: moe.fused_experts(*a, variant=variant), x, gu, dn, idx, w, dy,
                                torch.bfloat16)
    ref, ref_grads = run_with_grads(moe.fused_experts_reference, x, gu, dn, idx, w, dy, torch.float32)
    assert_close_rel(out, ref, 1e-2, "output")
    for name, got, want in zip(NAMES[:3], grads[:3], ref_grads[:3], strict=True):
        assert_close_rel(got, want, 1e-2, name)
    _assert_topk_weight_grad_close(grads[3], ref_grads[3], x, gu, dn, idx, dy)


def _assert_topk_weight_grad_close(got, want, x, gu, dn, idx, dy):
    """d topk_weights[t, k] = dy[t] . y[t, k] (expert k's output for token t): a dot over H of
    bf16-rounded terms. With T * K of them (2 at Mixtral T=1) one dot that cancels to near zero
    swings the relative norm error, so the bound is 1% of the result plus 2e-4 of the dots' natural
    size, |dy[t]| |y[t, k]| (bf16's 2**-8 over sqrt(H) terms is ~6e-5 of it at H = 4096)."""
    T, K = idx.shape
    ys = []
    for k in range(K):  # y[:, k]: the reference with weight 1 on slot k only
        unit = torch.zeros(T, K, device=x.device, dtype=torch.float32)
        unit[:, k] = 1
        ys.append(moe.fused_experts_reference(x.float(), gu.float(), dn.float(), idx, unit))
    scale = torch.stack([dy.float().norm(dim=-1) * y.norm(dim=-1) for y in ys], -1)
    err = (got.double() - want.double()).norm()
    bound = 1e-2 * want.double().norm() + 2e-4 * scale.double().norm()
    assert err < bound, f"topk_weights: error {err:.3g} >= {bound:.3g} (|want| {want.norm():.3g})"


@pytest.mark.gpu
@pytest.mark.parametrize("T", [64, 1024])  # one-program alignment, torch-ops alignment
def test_gpu_inference_is_cuda_graph_capturable(T):
    s = SHAPES["qwen3_30b_a3b"]
    x, gu, dn, idx, w = gpu_inputs(s["E"], s["H"], s["I"], s["K"], T)
    with torch.no_grad():
        expected = moe.fused_experts(x, gu, dn, idx, w)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            moe.fused_experts(x, gu, dn, idx, w)  # warm-up compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe.fused_experts(x, gu, dn, idx, w)
        x2, _, _, idx2, w2 = gpu_inputs(s["E"], s["H"], s["I"], s["K"], T)
        x.copy_(x2)
        idx.copy_(idx2)
        w.copy_(w2)
        graph.replay()
        torch.cuda.synchronize()
        fresh = moe.fused_experts(x, gu, dn, idx, w)
    assert not torch.equal(fresh, expected)
    torch.testing.assert_close(out, fresh, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 1024])  # replayed decode; one-program alignment; mapping kernels
def test_gpu_inference_never_synchronizes_with_the_host(T):
    """DESIGN.md: no host synchronisation on the inference path. torch raises on any synchronizing
    CUDA call under sync debug mode "error"; the first calls of a key (seen, recorded) and the
    replayed ones all run under it, as does the MoEExperts layer."""
    s = SHAPES["qwen3_30b_a3b"]
    x, gu, dn, idx, w = gpu_inputs(s["E"], s["H"], s["I"], s["K"], T)
    with torch.no_grad():
        expected = moe.fused_experts(x, gu, dn, idx, w)  # compiles (may sync) before the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = [moe.fused_experts(x, gu, dn, idx, w) for _ in range(4)]
            with pytest.raises(RuntimeError):  # the control: the asked-for id check does sync
                moe.fused_experts(x, gu, dn, idx, w, check_indices=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for out in outs:
        assert torch.equal(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 32, 1024])  # one-program alignment; mapping kernels and TMA weights
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_inference_replays_give_the_ordinary_paths_bits(shape, T):
    """Inference: the second call of a key records its launches, later calls replay them with
    their own addresses (and new descriptors where the bucket loads by TMA). A replay must give the
    bits of the ordinary path on the same inputs, on another current stream too, still check the
    ids, and must not keep the model's tensors alive."""
    _check_replay(SHAPES[shape], T)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,T", [("mixtral_8x7b", 1024), ("qwen3_30b_a3b", 8192), ("qwen3_30b_a3b", 4096)])
def test_gpu_replays_rebuild_descriptors_over_internal_buffers(shape, T, tmp_path, monkeypatch):
    """As above with buckets (KERNELHUB_MOE_CONFIG_DIR) whose down tile reads h by TMA from
    persistent programs (Qwen3 T=4096: paired, with the tile-list launch): the replay rebuilds
    those descriptors over its workspace every call."""
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    data = json.loads((Path(cfgs.__file__).parent / "configs" / "sm90.json").read_text())
    for bucket in data["buckets"] + [b for shape_buckets in data["shapes"].values() for b in shape_buckets]:
        if bucket["block_m"] >= 64:
            bucket["down"].update(A_TMA=True, PERSISTENT=1)
    (tmp_path / "sm90.json").write_text(json.dumps(data))
    monkeypatch.setenv("KERNELHUB_MOE_CONFIG_DIR", str(tmp_path))
    plan = _check_replay(SHAPES[shape], T)
    if moe.select_variant(torch.device("cuda")) == "sm90":  # the A descriptor was recorded as a view
        assert any(d is not None and type(d[1]) is tuple for launch in plan.launches for d in launch[4])


GPU_DECODE = {"max_tokens": 4, "gate_up": {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 2},
              "down": {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4, "num_stages": 2}}


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_decode_path_matches_the_reference_replays_and_captures(shape, T, tmp_path, monkeypatch):
    """Buckets with a "decode" key (KERNELHUB_MOE_CONFIG_DIR): the token-major path at real shapes
    in bf16 against the reference, its replay (two launches) with the ordinary path's bits, and a
    CUDA graph of it."""
    s = SHAPES[shape]
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    cap = 90 if moe.select_variant(torch.device("cuda")) == "sm90" else 80
    data = json.loads((Path(cfgs.__file__).parent / "configs" / f"sm{cap}.json").read_text())
    for bucket in data["buckets"] + [b for shape_buckets in data["shapes"].values() for b in shape_buckets]:
        bucket["decode"] = copy.deepcopy(GPU_DECODE)
    (tmp_path / f"sm{cap}.json").write_text(json.dumps(data))
    with _config_dir(monkeypatch, tmp_path):
        plan = _check_replay(s, T)
        assert len(plan.launches) == 2, "not the decode path's two launches"
        x, gu, dn, idx, w = gpu_inputs(s["E"], s["H"], s["I"], s["K"], T)
        with torch.no_grad():
            moe.fused_experts(x, gu, dn, idx, w)  # compiles outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = moe.fused_experts(x, gu, dn, idx, w)
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, moe.fused_experts(x, gu, dn, idx, w))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("T", [1, 256])
def test_gpu_torch_compile_gives_the_eager_bits(T, mode):
    """torch.compile (inductor; "reduce-overhead": CUDA graphs) of fused_experts at a real shape:
    the custom ops launch the eager path's kernels, forward and backward."""
    s = SHAPES["qwen3_30b_a3b"]
    x, gu, dn, idx, w = gpu_inputs(s["E"], s["H"], s["I"], s["K"], T)

    def f(x, gu, dn, idx, w):
        return moe.fused_experts(x, gu, dn, idx, w)

    compiled = torch.compile(f, mode=mode, fullgraph=True)
    with torch.no_grad():
        want = f(x, gu, dn, idx, w)
        for _ in range(3):  # warm-up, recording, replay
            got = compiled(x, gu, dn, idx, w).clone()
    assert torch.equal(got, want)
    dy = torch.randn_like(x)
    for _ in range(3):
        got, got_grads = run_with_grads(compiled, x, gu, dn, idx, w, dy, torch.bfloat16)
    want, want_grads = run_with_grads(f, x, gu, dn, idx, w, dy, torch.bfloat16)
    assert torch.equal(got, want)
    for name, a, b in zip(NAMES[:3], got_grads[:3], want_grads[:3], strict=True):
        assert torch.equal(a, b), name
    # d topk_weights is summed over the I tiles by fp32 atomics: order, hence last bits, may differ
    assert_close_rel(got_grads[3], want_grads[3], 1e-3, "topk_weights")


def _check_replay(s: dict, T: int):
    rp = importlib.import_module(moe.__name__ + "._experts_replay")
    first = gpu_inputs(s["E"], s["H"], s["I"], s["K"], T)
    second = gpu_inputs(s["E"], s["H"], s["I"], s["K"], T)
    second = (second[0], first[1], first[2], second[3], second[4])  # same weights, new tokens and routing
    with torch.no_grad():
        rp._REPLAYS.clear()
        moe.fused_experts(*first)  # the key is seen
        key = rp.replay_key(*second, None)
        assert key is not None and rp._REPLAYS.get(key) is rp._SEEN
        moe.fused_experts(*first)  # recorded
        plan = rp._REPLAYS.get(key)
        assert isinstance(plan, rp._Replay), "the inference call was not recorded"
        assert rp.replay(plan, second) is not None
        replayed = moe.fused_experts(*second)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            on_stream = moe.fused_experts(*second)
        torch.cuda.current_stream().wait_stream(stream)
        bad = second[3].clone()
        bad[0, 0] = s["E"]  # same key, an id out of range: the replay path checks the ids when asked
        with pytest.raises(ValueError, match=r"`topk_idx` entries must be in \[-1, "):
            moe.fused_experts(second[0], second[1], second[2], bad, second[4], check_indices=True)
        # by default an inference call does not sync to check: the id is dropped like -1
        dropped = moe.fused_experts(second[0], second[1], second[2], bad, second[4])
        minus_one = bad.masked_fill(bad == s["E"], -1)
        assert torch.equal(dropped, moe.fused_experts(second[0], second[1], second[2], minus_one, second[4]))
        rp._REPLAYS.clear()
        ordinary = moe.fused_experts(*second)  # the ordinary path (the key is only seen)
    assert torch.equal(replayed, ordinary) and torch.equal(on_stream, ordinary)
    assert_close_rel(ordinary, moe.fused_experts_reference(*second), 1e-2, "output")
    ref = weakref.ref(first[1])
    del first, second
    gc.collect()
    assert ref() is None, "a kept replay holds the weights"
    return plan


@pytest.mark.gpu
@pytest.mark.parametrize("shape,T", [("mixtral_8x7b", 2048), ("qwen3_30b_a3b", 4096)])
def test_gpu_wgrad_tma_matches_the_pointer_path(shape, T, monkeypatch):
    """At real sizes, in bf16: weight gradients with TMA operands (gathered or from row-ordered copies,
    "ROWS"; dW by TMA store from persistent programs, also flattened: "FLAT_STEPS") equal the pointer
    path's bits."""
    if moe.select_variant(torch.device("cuda")) != "sm90":
        pytest.skip("TMA needs a capability 9.x GPU")
    ex = importlib.import_module(moe.__name__ + ".experts")
    s = SHAPES[shape]
    x, gu, dn, idx, w = gpu_inputs(s["E"], s["H"], s["I"], s["K"], T)
    dy = torch.randn_like(x)
    cfg = ex._config("sm90", s["E"], s["H"], s["I"], T * s["K"], None, x.device)
    calls = _count_row_descriptors(monkeypatch)
    results = []
    # the shipped buckets may set TMA_STORE: each run below pins all three keys, the first none
    loop = {"PERSISTENT": 1, "num_stages": 2}  # persistent programs looping over tiles
    flat = {"PERSISTENT": 1, "num_stages": 3, "FLAT_STEPS": 64}  # ... in one flattened loop
    for on, rows, store, extra in ((False, False, False, {}), (True, False, False, {}), (True, True, False, {}),
                                   (True, True, True, {}), (True, True, True, loop), (True, True, True, flat)):
        pinned = _with_wgrad_tma(cfg, on, rows, store)
        pinned["wgrad"].update(extra)
        _, grads = run_with_grads(lambda *a, pinned=pinned: moe.fused_experts(*a, variant="sm90", config=pinned),
                                  x, gu, dn, idx, w, dy, torch.bfloat16)
        results.append(grads)
    # The TMA branch ran: one operand of each GEMM, then (ROWS) both operands of every chunk's launch.
    assert len(calls) > 2 + 4 and len(calls) % 2 == 0
    base = results[0]
    for got_all in results[1:]:
        for name, want, got in zip(NAMES, base, got_all, strict=True):
            if name == "topk_weights":
                # fp32 atomics over the dgrad's column blocks per (token, slot) in a varying order;
                # with dots that cancel, runs differ: 1.8e-5 relative seen at Qwen3 T=4096 (6 blocks),
                # 1.04e-4 at Mixtral T=2048 (112 blocks; H200, 2026-12-04)
                assert_close_rel(got, want, 5e-4, name)
            else:
                assert torch.equal(want, got), name


@pytest.mark.gpu
@pytest.mark.parametrize("shape,T,pair", [("qwen3_30b_a3b", 4096, True), ("qwen3_30b_a3b", 4096, False),
                                          ("deepseek_v3", 4096, False), ("mixtral_8x7b", 1024, False)])
def test_gpu_persistent_and_tma_a_gemms_give_the_one_tile_bits(shape, T, pair, monkeypatch):
    """At real sizes, in bf16, with the shipped tiles (paired as shipped, or unpaired):
    "PERSISTENT" programs (1 per SM, and 2 for the register-capped dgrad), "A_TMA" and gate_up's
    "ROWS" and "EPI_HALVES" give the one-program-per-tile pointer path's output and gradients bit
    for bit (topk_weights: fp32 atomics in varying order)."""
    if moe.select_variant(torch.device("cuda")) != "sm90":
        pytest.skip("TMA needs a capability 9.x GPU")
    ex = importlib.import_module(moe.__name__ + ".experts")
    s = {**SHAPES, "deepseek_v3": dict(E=256, H=7168, I=2048, K=8)}[shape]
    x, gu, dn, idx, w = gpu_inputs(s["E"], s["H"], s["I"], s["K"], T)
    dy = torch.randn_like(x)
    shipped = ex._config("sm90", s["E"], s["H"], s["I"], T * s["K"], None, x.device)
    calls = _count_row_descriptors(monkeypatch)
    base, descriptors = None, []
    both = {"PERSISTENT": 1, "A_TMA": True}
    for extra, dgrad_per_sm in (({}, 0), (both, 1), ({"PERSISTENT": 1}, 2), ({**both, "ROWS": True}, 1),
                                ({"EPI_HALVES": True}, 0)):
        calls.clear()
        cfg = copy.deepcopy(shipped)
        assert cfg.get("pair_m", False) == (shape == "qwen3_30b_a3b")  # as shipped at these points
        if not pair and cfg.pop("pair_m", False):
            cfg["block_m"] *= 2
        for stage in ("gate_up", "down", "dgrad"):
            cfg[stage].pop("PERSISTENT", None)
            cfg[stage].pop("A_TMA", None)
            cfg[stage].pop("ROWS", None)
            cfg[stage].pop("EPI_HALVES", None)
            cfg[stage].update({k: v for k, v in extra.items() if k not in ("ROWS", "EPI_HALVES") or stage == "gate_up"})
        if dgrad_per_sm:
            cfg["dgrad"]["PERSISTENT"] = dgrad_per_sm
        out, grads = run_with_grads(lambda *a, c=cfg: moe.fused_experts(*a, variant="sm90", config=c), x, gu, dn,
                                    idx, w, dy, torch.bfloat16)
        descriptors.append(len(calls))
        if base is None:  # compared as they come: DeepSeek-V3's weight gradients are 22.5 GB a run
            base = out, grads
            continue
        assert torch.equal(base[0], out)
        for name, a, b in zip(NAMES, base[1], grads, strict=True):
            if name == "topk_weights":
                assert_close_rel(b, a, 5e-4, name)
            else:
                assert torch.equal(a, b), name
        del out, grads
    # A by TMA: two more row descriptors (down and dL/dx), three with gate_up's row copy (paired: two
    # each) than the weight gradients build anyway
    per = 2 if pair else 1
    assert descriptors[1:] == [descriptors[0] + 2 * per, descriptors[0], descriptors[0] + 3 * per,
                               descriptors[0]], descriptors


@pytest.mark.gpu
@pytest.mark.parametrize("variant", TRITON_VARIANTS)
def test_gpu_paired_row_blocks_match_the_reference(variant):
    """Bucket key "pair_m" at Qwen3-30B-A3B T=4096 (256 rows per expert: pairs and lone blocks),
    rows padded to 64 and 128-row tiles, forward and every gradient in bf16 against fp32."""
    if variant == "sm90" and moe.select_variant(torch.device("cuda")) != "sm90":
        pytest.skip("sm90 path needs a capability 9.x GPU")
    ex = importlib.import_module(moe.__name__ + ".experts")
    s = SHAPES["qwen3_30b_a3b"]
    x, gu, dn, idx, w = gpu_inputs(s["E"], s["H"], s["I"], s["K"], 4096)
    dy = torch.randn_like(x)
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    cfg = copy.deepcopy(ex._config(variant, s["E"], s["H"], s["I"], 4096 * s["K"], None, x.device))
    cfg.update(block_m=64, pair_m=True)  # sm90 ships 128 here, sm80 64: either way 128-row tiles now
    cfg = cfgs.fit_shared_memory(cfg, device_properties(x.device).shared_memory_per_block, 2)
    out, grads = run_with_grads(lambda *a: moe.fused_experts(*a, variant=variant, config=cfg), x, gu, dn, idx, w,
                                dy, torch.bfloat16)
    ref, ref_grads = run_with_grads(moe.fused_experts_reference, x, gu, dn, idx, w, dy, torch.float32)
    assert_close_rel(out, ref, 1e-2, "output")
    for name, got, want in zip(NAMES[:3], grads[:3], ref_grads[:3], strict=True):
        assert_close_rel(got, want, 1e-2, name)
    _assert_topk_weight_grad_close(grads[3], ref_grads[3], x, gu, dn, idx, dy)


def _compiled_register_caps(kernel) -> list[tuple[int, int]]:
    """(maxnreg, registers used) of every compiled variant of a JIT kernel that has run."""
    found = []
    for cache in getattr(kernel, "device_caches", {}).values():
        for compiled in cache[0].values():
            cap = getattr(compiled.metadata, "maxnreg", None)
            if cap is not None:
                found.append((cap, compiled.n_regs))
    return found


@pytest.mark.gpu
@pytest.mark.parametrize("variant", TRITON_VARIANTS)
def test_gpu_register_capped_stages_give_the_same_bits(variant):
    """Stage key "maxnreg" at Qwen3-30B-A3B T=4096 in bf16: a cap on every GEMM stage changes the
    registers ptxas may use (checked on the compiled kernels), never the result (topk_weights: fp32
    atomics in varying order)."""
    if variant == "sm90" and moe.select_variant(torch.device("cuda")) != "sm90":
        pytest.skip("sm90 path needs a capability 9.x GPU")
    ex = importlib.import_module(moe.__name__ + ".experts")
    s = SHAPES["qwen3_30b_a3b"]
    x, gu, dn, idx, w = gpu_inputs(s["E"], s["H"], s["I"], s["K"], 4096)
    dy = torch.randn_like(x)
    results = []
    for cap in (None, 128):
        cfg = copy.deepcopy(ex._config(variant, s["E"], s["H"], s["I"], 4096 * s["K"], None, x.device))
        # the shipped 128x256 wgrad tile holds 128 fp32 accumulators per thread: no 128-register cap
        # can compile it (ptxas asks for 154), so both runs use the 128x128 tile
        cfg["wgrad"].update(BLOCK_M=128, BLOCK_N=128)
        for stage in ("dgrad", "wgrad"):
            cfg[stage].pop("maxnreg", None)
            if cap is not None:
                cfg[stage]["maxnreg"] = cap
        results.append(run_with_grads(lambda *a, c=cfg: moe.fused_experts(*a, variant=variant, config=c), x, gu,
                                      dn, idx, w, dy, torch.bfloat16))
    (out0, grads0), (out1, grads1) = results
    assert torch.equal(out0, out1)
    for name, a, b in zip(NAMES, grads0, grads1, strict=True):
        if name == "topk_weights":
            assert_close_rel(b, a, 1e-4, name)
        else:
            assert torch.equal(a, b), name
    for kernel in (ex._grouped_gemm_kernel, ex._grouped_wgrad_kernel):
        caps = [(c, n) for c, n in _compiled_register_caps(kernel) if c == 128]
        assert caps and all(n <= 128 for _, n in caps), (kernel.__name__, caps)


def _restore_kernelhub(interface, previous) -> None:
    """Put back what `import kernelhub` registered (other tests rely on it)."""
    if previous is None:
        interface._global_mapping.pop("kernelhub", None)
    else:
        interface.register("kernelhub", previous)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["sm90", "sm80"])
def test_weight_gradients_of_experts_past_2_to_the_31_elements(variant):
    """DeepSeek-V3 sizes: expert e's gradient starts at e * 4096 * 7168 elements, past int32 for e > 73."""
    E, H, I, T, K = 256, 7168, 2048, 4, 8
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(0)
    gu = (torch.randn(E, 2 * I, H, device=dev, generator=g, dtype=torch.bfloat16) * 0.02).requires_grad_()
    dn = (torch.randn(E, H, I, device=dev, generator=g, dtype=torch.bfloat16) * 0.02).requires_grad_()
    x = torch.randn(T, H, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
    idx = torch.randperm(E, device=dev, generator=g)[: T * K].view(T, K)
    idx[0, 0] = E - 1  # the last expert: the largest offset
    w = torch.rand(T, K, device=dev, generator=g)
    moe.fused_experts(x, gu, dn, idx, w, variant=variant).float().square().sum().backward()
    torch.cuda.synchronize(dev)
    touched = torch.unique(idx)
    untouched = torch.ones(E, dtype=torch.bool, device=dev)
    untouched[touched] = False
    assert gu.grad[untouched].abs().max().item() == 0 and dn.grad[untouched].abs().max().item() == 0
    # The touched experts against the reference on just those experts (ids renumbered).
    remap = torch.full((E,), -1, dtype=torch.long, device=dev)
    remap[touched] = torch.arange(touched.numel(), device=dev)
    gu_s = gu.detach()[touched].float().requires_grad_()
    dn_s = dn.detach()[touched].float().requires_grad_()
    x_s = x.detach().float().requires_grad_()
    moe.fused_experts_reference(x_s, gu_s, dn_s, remap[idx], w).square().sum().backward()
    assert_close_rel(gu.grad[touched].float(), gu_s.grad, 2e-2, "dW_gate_up")
    assert_close_rel(dn.grad[touched].float(), dn_s.grad, 2e-2, "dW_down")
    assert_close_rel(x.grad.float(), x_s.grad, 2e-2, "dx")
