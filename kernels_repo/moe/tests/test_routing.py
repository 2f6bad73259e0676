"""MoE routing kernels against their torch references and against the layout's own invariants.

CPU: the Triton interpreter on small shapes (both the sm90 and sm80 launch configs forced).
GPU (`-m gpu`): DeepSeek-V3-like shapes, T=16384, K=8, E=256, H=7168.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import fake_cuda_tensor, run_with_a_huge_strided_view
from kernelhub.hub import get_local_kernel

moe = get_local_kernel(Path(__file__).resolve().parents[1])
routing = moe.routing
ref = moe.reference_routing
checks = moe._routing_checks
kernels = moe._routing_kernels

GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
DEV = "cuda" if GPU else "cpu"


_torch_empty = torch.empty


def _poisoned_empty(*args, **kwargs):
    """torch.empty whose memory holds NaN / -12345, so an element a kernel forgets shows up."""
    t = _torch_empty(*args, **kwargs)
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype in (torch.int32, torch.int64):
        t.fill_(-12345)
    return t


@pytest.fixture(params=["sm90", "sm80"])
def variant(request, monkeypatch):
    """Force one capability's launch config for every entry point (4 'SMs' on the CPU), and
    poison every buffer the entry points allocate with torch.empty."""
    cfg = kernels.SM90 if request.param == "sm90" else kernels.SM80
    sms = 132 if GPU else 4
    monkeypatch.setattr(checks, "select_config", lambda device: (cfg, sms))
    monkeypatch.setattr(torch, "empty", _poisoned_empty)
    return cfg


def random_topk(t: int, k: int, e: int, *, drop: float = 0.1, device=DEV, skew: bool = False):
    """Distinct experts per row (like a real router), some slots -1; optionally skewed load."""
    g = torch.Generator().manual_seed(t * 1000 + k * 10 + e)
    if skew:  # a few hot experts, several experts with no tokens
        weights = torch.rand(t, e, generator=g) ** 4
    else:
        weights = torch.rand(t, e, generator=g)
    idx = torch.topk(weights, k, dim=1).indices
    idx[torch.rand(t, k, generator=g) < drop] = -1
    return idx.to(device)


def align(n, a):
    return (n + a - 1) // a * a


def check_mapping(topk_idx, e, a, outs, *, num_pos=None, synced=True):
    """Every documented property of get_fused_mapping's outputs, checked directly."""
    p2e, p2t, p2tk, inv, start, end, ntpe, lst = outs
    t, k = topk_idx.shape
    idx = topk_idx.long()
    for tensor in (p2e, p2t, p2tk, inv, start, end, ntpe):
        assert tensor.dtype == torch.int32 and tensor.device == topk_idx.device
    counts = torch.bincount(idx[idx >= 0], minlength=e)
    aligned = align(counts, a)
    assert torch.equal(ntpe.long(), aligned)
    assert torch.equal((end - start).long(), aligned)
    assert start[0].item() == 0 and torch.equal(start[1:], end[:-1])  # contiguous, expert order
    total = int(aligned.sum())
    assert p2e.numel() == (total if num_pos is None else num_pos)
    assert lst == (aligned.tolist() if synced else [])
    for ex in range(e):
        s, c, en = int(start[ex]), int(counts[ex]), int(end[ex])
        assert (p2e[s : s + c] == ex).all() and (p2e[s + c : en] == -1).all()  # real rows first
        rows = p2tk[s : s + c].long()
        assert (rows[1:] > rows[:-1]).all()  # token order inside an expert
    assert (p2e[total:] == -1).all()
    pad = p2e < 0
    assert torch.equal(pad, p2t < 0) and torch.equal(pad, p2tk < 0)  # -1 coincide
    real = torch.nonzero(~pad).flatten()
    flat_pos = p2tk[real].long()
    assert torch.equal(p2t[real].long(), flat_pos // k)
    assert torch.equal(idx.flatten()[flat_pos], p2e[real].long())
    assert torch.equal(inv.flatten()[flat_pos].long(), real)  # inverse on real rows
    assert torch.equal(inv < 0, idx < 0)  # -1 exactly where topk_idx is -1
    used = inv[inv >= 0]
    assert used.unique().numel() == used.numel()  # positions are distinct


MAP_SHAPES = [  # T, K, E, alignment
    (1, 1, 1, 1),
    (300, 4, 16, 8),
    (257, 6, 33, 16),
    (64, 8, 256, 128),
    (96, 8, 1024, 16),
    (0, 4, 8, 16),
]


@pytest.mark.parametrize("t,k,e,a", MAP_SHAPES)
def test_fused_mapping_with_host_sync_has_every_property(variant, t, k, e, a):
    idx = random_topk(t, k, e, skew=e > 32)
    outs = moe.get_fused_mapping(idx, e, 0, a)
    check_mapping(idx, e, a, outs)
    expected = ref.get_fused_mapping_ref(idx, e, outs[0].numel(), a)
    for got, want in zip(outs[:7], expected, strict=True):
        assert torch.equal(got, want)


def test_fused_mapping_int32_and_strided_topk_idx(variant):
    idx = random_topk(100, 3, 12).to(torch.int32).t().contiguous().t()  # column-major [T, K]
    assert not idx.is_contiguous()
    check_mapping(idx, 12, 4, moe.get_fused_mapping(idx, 12, 0, 4))


def test_fused_mapping_explicit_p_needs_no_sync_and_pads_the_tail(variant):
    idx = random_topk(200, 4, 10)
    synced = moe.get_fused_mapping(idx, 10, 0, 8)
    needed = synced[0].numel()
    for num_pos in (needed, needed + 37):
        outs = moe.get_fused_mapping(idx, 10, num_pos, 8)
        check_mapping(idx, 10, 8, outs, num_pos=num_pos, synced=False)
        assert torch.equal(outs[3], synced[3])


def test_fused_mapping_force_no_sync_uses_the_upper_bound(variant):
    t, k, e, a = 50, 4, 8, 16
    idx = random_topk(t, k, e)
    outs = moe.get_fused_mapping(idx, e, 0, a, force_no_sync=True)
    check_mapping(idx, e, a, outs, num_pos=(t * k + (a - 1) * e) // a * a, synced=False)


def test_fused_mapping_too_small_p_fails_loudly_without_sync(variant):
    idx = random_topk(64, 4, 8, drop=0.0)
    with pytest.raises(RuntimeError, match="num_expanded_tokens"):
        moe.get_fused_mapping(idx, 8, 64 * 4 - 1, 1)


def test_fused_mapping_reference_path_raises_value_errors(monkeypatch):
    monkeypatch.setattr(checks, "interpreting", lambda: False)
    idx = random_topk(64, 4, 8, drop=0.0, device="cpu")
    with pytest.raises(ValueError, match="too small"):
        moe.get_fused_mapping(idx, 8, 100, 1)
    idx[3, 1] = 8
    with pytest.raises(ValueError, match="topk_idx"):
        moe.get_fused_mapping(idx, 8, 0, 1)
    check_mapping(random_topk(30, 2, 5, device="cpu"), 5, 4,
                  moe.get_fused_mapping(random_topk(30, 2, 5, device="cpu"), 5, 0, 4))


@pytest.mark.parametrize("bad", [8, 1000, -2])
def test_fused_mapping_out_of_range_ids(variant, bad):
    idx = random_topk(40, 4, 8)
    idx[7, 2] = bad
    with pytest.raises(ValueError, match="expert ids"):
        moe.get_fused_mapping(idx, 8, 0, 4)  # host sync path: plain ValueError
    with pytest.raises(RuntimeError, match="expert ids"):
        moe.get_fused_mapping(idx, 8, 4096, 4)  # graph-capturable path: async assert


def test_fused_mapping_argument_errors():
    idx = random_topk(10, 2, 4)
    with pytest.raises(TypeError, match="get_fused_mapping: `topk_idx`"):
        moe.get_fused_mapping(idx.float(), 4, 0, 1)
    with pytest.raises(ValueError, match="`topk_idx` must be 2-D"):
        moe.get_fused_mapping(idx.flatten(), 4, 0, 1)
    with pytest.raises(ValueError, match="`num_experts`"):
        moe.get_fused_mapping(idx, 0, 0, 1)
    with pytest.raises(ValueError, match="`alignment`"):
        moe.get_fused_mapping(idx, 4, 0, 0)
    with pytest.raises(ValueError, match="`num_expanded_tokens`"):
        moe.get_fused_mapping(idx, 4, -1, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,k,e,h", [(37, 4, 8, 100), (16, 2, 3, 64), (0, 2, 4, 32)])
def test_expand_then_reduce_match_references(variant, dtype, t, k, e, h):
    idx = random_topk(t, k, e)
    p2e, _, _, inv, *_ = moe.get_fused_mapping(idx, e, 0, 8)
    base = torch.randn(t, h + 5, device=DEV).to(dtype)
    x = base[:, 3 : 3 + h]  # strided rows
    y = moe.expand_to_fused(x, inv, p2e)
    want = ref.expand_to_fused_ref(x, inv, p2e.numel())
    assert y.shape == (p2e.numel(), h) and y.dtype == dtype and y.device == x.device
    assert torch.equal(y.view(torch.uint8), want.view(torch.uint8))  # bit-exact, padding zero
    assert (y[p2e < 0] == 0).all()
    z = torch.randn(p2e.numel(), h + 3, device=DEV).to(dtype)[:, 2 : 2 + h]  # strided rows
    w = torch.rand(k, t, device=DEV).t()  # strided weights
    for weights in (w, None):
        got = moe.reduce_fused(z, weights, inv)
        exact = ref.reduce_fused_ref(z, weights, inv, acc_dtype=torch.float64)
        assert got.dtype == dtype and got.shape == (t, h)
        tol = 1e-5 if dtype == torch.float32 else 1.6e-2
        torch.testing.assert_close(got.double(), exact, rtol=tol, atol=tol)


def test_reduce_fused_rounds_its_fp32_sum_once_to_nearest(variant):
    """bf16 out = the fp32 sum (k order) rounded once to nearest even, as on the GPU (a truncating
    cast, as the interpreter's bf16 cast is, misses on about half the elements)."""
    idx = random_topk(64, 4, 8, drop=0.0)
    p2e, _, _, inv, *_ = moe.get_fused_mapping(idx, 8, 0, 8)
    z = torch.randn(p2e.numel(), 256, device=DEV).to(torch.bfloat16)
    w = torch.rand(64, 4, device=DEV)
    for weights in (w, None):
        got = moe.reduce_fused(z, weights, inv)
        want = ref.reduce_fused_ref(z, weights, inv).to(torch.bfloat16)
        frac = (got != want).float().mean().item()
        assert frac < 0.01, f"{frac:.1%} of the sums are not the fp32 value rounded to nearest"
    # a NaN weight whose payload would carry into the exponent (0x7FFFFFFF) stays NaN, as on the GPU
    w[5, 1] = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32).to(w.device)[0]
    got = moe.reduce_fused(z, w, inv)
    assert got[5].isnan().all() and not got[torch.arange(64, device=got.device) != 5].isnan().any()


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_nothing_routed_gives_an_empty_buffer_and_zero_rows(monkeypatch, path):
    """Every slot -1 (a rank that owns none of a batch's experts): P = 0, and expand / reduce
    still return [0, H] / zero [T, H], on the Triton path and on the torch path alike."""
    if path == "torch":
        monkeypatch.setattr(checks, "interpreting", lambda: False)
        dev = "cpu"
    else:
        dev = DEV
    idx = torch.full((3, 2), -1, dtype=torch.int64, device=dev)
    p2e, _, _, inv, *_ = moe.get_fused_mapping(idx, 4, 0, 8)
    assert p2e.numel() == 0 and (inv == -1).all()
    x = torch.randn(3, 8, device=dev, dtype=torch.bfloat16)
    y = moe.expand_to_fused(x, inv, p2e)
    assert y.shape == (0, 8)
    for weights in (torch.rand(3, 2, device=dev), None):
        out = moe.reduce_fused(y, weights, inv)
        assert out.shape == (3, 8) and out.dtype == x.dtype and not out.any()


def test_reduce_fused_writes_into_out_and_validates_it(variant):
    idx = random_topk(20, 3, 6)
    p2e, _, _, inv, *_ = moe.get_fused_mapping(idx, 6, 0, 4)
    z = torch.randn(p2e.numel(), 48, device=DEV)
    w = torch.rand(20, 3, device=DEV)
    out = torch.full((20, 48), float("nan"), device=DEV)
    res = moe.reduce_fused(z, w, inv, out=out)
    assert res is out and not out.isnan().any()
    torch.testing.assert_close(out.double(), ref.reduce_fused_ref(z, w, inv, torch.float64),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="reduce_fused: `out`"):
        moe.reduce_fused(z, w, inv, out=out.half())
    with pytest.raises(ValueError, match="reduce_fused: `out` must have shape"):
        moe.reduce_fused(z, w, inv, out=out[:5])
    with pytest.raises(ValueError, match="reduce_fused: `out` must be contiguous"):
        moe.reduce_fused(z, w, inv, out=torch.empty(48, 20, device=DEV).t())
    with pytest.raises(ValueError, match="`topk_weights` must have shape"):
        moe.reduce_fused(z, w[:, :2], inv)


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_reduce_fused_refuses_an_out_overlapping_its_inputs(monkeypatch, path):
    """A program writes out[t] while others still read x / the weights / the positions: an `out`
    sharing their memory gave wrong values (max error 1.4 with out = x). Refused on every path."""
    if path == "torch":
        monkeypatch.setattr(checks, "interpreting", lambda: False)
    dev = "cpu" if path == "torch" else DEV
    t, k, h = 12, 1, 16
    idx = random_topk(t, k, 4, drop=0.0, device=dev)
    p2e, _, _, inv, *_ = moe.get_fused_mapping(idx, 4, 0, 1)
    assert p2e.numel() == t  # alignment 1, one slot each: x has T rows, the shape of out
    x = torch.randn(t, h, device=dev)
    buf = torch.randn(3 * t * h, device=dev)
    w_in_buf = buf[5 : 5 + t * k].view(t, k)
    pos_buf = torch.zeros(t * h, dtype=torch.int32, device=dev)
    pos_buf[: t * k] = inv.view(-1)
    cases = [
        ("x", x, torch.rand(t, k, device=dev), inv, x),  # the very tensor
        ("x", buf[: t * h].view(t, h), None, inv, buf[h * 3 : h * 3 + t * h].view(t, h)),  # partly
        ("topk_weights", x, w_in_buf, inv, buf[: t * h].view(t, h)),
        ("token_topk_to_pos", x, None, pos_buf[: t * k].view(t, k), pos_buf.view(torch.float32).view(t, h)),
    ]
    for name, xs, w, pos, out in cases:
        with pytest.raises(ValueError, match=rf"reduce_fused: `out` overlaps `{name}`'s memory"):
            moe.reduce_fused(xs, w, pos, out=out)
    # memory next to x's (one row past its end) is fine
    buf2 = torch.randn(2 * t * h, device=dev)
    x2, out2 = buf2[: t * h].view(t, h), buf2[t * h :].view(t, h)
    w = torch.rand(t, k, device=dev)
    assert moe.reduce_fused(x2, w, inv, out=out2) is out2
    torch.testing.assert_close(out2, ref.reduce_fused_ref(x2, w, inv))


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_reduce_fused_ignores_the_weight_of_a_dropped_slot(monkeypatch, path, bad):
    """A slot with position -1 contributes nothing, whatever its weight: a NaN/inf weight there
    made the Triton path return a row of NaN (0 * NaN); the reference and fused_experts skip it.
    The reference's gradients stay finite too (where() alone passed 0 * NaN back to x)."""
    if path == "torch":
        monkeypatch.setattr(checks, "interpreting", lambda: False)
    dev = "cpu" if path == "torch" else DEV
    idx = random_topk(16, 3, 6, drop=0.0, device=dev)
    idx[2, 1] = idx[7, 0] = idx[7, 2] = -1
    p2e, _, _, inv, *_ = moe.get_fused_mapping(idx, 6, 0, 4)
    x = torch.randn(p2e.numel(), 40, device=dev)
    w = torch.rand(16, 3, device=dev)
    clean = ref.reduce_fused_ref(x, torch.where(inv >= 0, w, 0.0), inv)
    w[2, 1] = w[7, 0] = w[7, 2] = bad
    got = moe.reduce_fused(x, w, inv)
    assert not got.isnan().any()
    torch.testing.assert_close(got, clean)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    moe.reduce_fused(xg, wg, inv).sum().backward()
    assert xg.grad.isfinite().all() and wg.grad.isfinite().all()
    assert (wg.grad[inv < 0] == 0).all()


def _bad_positions(bad: str):
    idx = random_topk(12, 3, 5, drop=0.0, device=DEV)
    p2e, _, _, inv, *_ = moe.get_fused_mapping(idx, 5, 0, 4)
    z = torch.randn(p2e.numel(), 32, device=DEV)
    inv = inv.clone()
    if bad == "past_p":
        inv[4, 1] = p2e.numel()
    elif bad == "below_minus_one":
        inv[4, 1] = -2
    else:  # a pos_to_expert (and x) shorter than the positions need
        p2e, z = p2e[:4], z[:4]
    return torch.randn(12, 32, device=DEV), inv, p2e, z


@pytest.mark.parametrize("bad", ["past_p", "below_minus_one", "short_pos_to_expert"])
def test_expand_and_reduce_refuse_positions_out_of_range(variant, bad):
    x, inv, p2e, z = _bad_positions(bad)
    # graph-capturable path: an async assert after a launch that wrote nothing out of bounds
    with pytest.raises(RuntimeError, match="expand_to_fused: `token_topk_to_pos` holds positions"):
        moe.expand_to_fused(x, inv, p2e)
    with pytest.raises(RuntimeError, match="reduce_fused: `token_topk_to_pos` holds positions"):
        moe.reduce_fused(z, None, inv)


@pytest.mark.parametrize("bad", ["past_p", "below_minus_one", "short_pos_to_expert"])
def test_expand_and_reduce_reference_path_raise_value_errors_for_bad_positions(monkeypatch, bad):
    monkeypatch.setattr(checks, "interpreting", lambda: False)
    x, inv, p2e, z = _bad_positions(bad)
    with pytest.raises(ValueError, match="expand_to_fused: `token_topk_to_pos` holds positions"):
        moe.expand_to_fused(x, inv, p2e)
    with pytest.raises(ValueError, match="reduce_fused: `token_topk_to_pos` holds positions"):
        moe.reduce_fused(z, None, inv)


def test_tensors_on_different_devices_are_named(fake_gpus):
    x = torch.randn(4, 8)
    inv = fake_cuda_tensor((4, 2), 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"`token_topk_to_pos` is on cuda:1 but `x` is on cpu"):
        moe.expand_to_fused(x, inv, torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"`out` is on cuda:0 but `x` is on cpu"):
        moe.reduce_fused(x, None, torch.zeros(4, 2, dtype=torch.int32),
                         out=fake_cuda_tensor((4, 8), 0))


def test_config_and_sm_count_are_per_device_index(fake_gpus):
    cfg0, sms0 = checks.select_config(torch.device("cuda", 0))
    cfg1, sms1 = checks.select_config(torch.device("cuda", 1))
    assert (cfg0.name, sms0, cfg1.name, sms1) == ("sm80", 108, "sm90", 132)
    moe.set_num_sms("cuda:1", 7)
    try:
        assert moe.get_num_sms("cuda:1") == 7 and moe.get_num_sms("cuda:0") == 108
    finally:
        moe.set_num_sms("cuda:1", None)
    assert moe.get_num_sms(torch.device("cuda", 1)) == 132
    with pytest.raises(ValueError, match="set_num_sms: `num_sms`"):
        moe.set_num_sms("cuda:0", 0)


def test_topk_gate_matches_stable_sort_and_breaks_ties_to_smaller_index(variant):
    scores = torch.randint(0, 4, (50, 40), device=DEV).float()  # many ties
    for s in (scores, torch.randn(40, 50, device=DEV).t()):  # ties; strided
        for k in (1, 6, s.shape[1]):
            got = moe.topk_gate(s, k)
            assert got.dtype == torch.int64 and got.is_contiguous()
            assert torch.equal(got, ref.topk_gate_ref(s, k))
    row = torch.zeros(1, 9, device=DEV)
    assert moe.topk_gate(row, 3).tolist() == [[0, 1, 2]]
    # NaN ranks above every number, as torch.sort / topk rank it; ids always in [0, E)
    nan = float("nan")
    odd = torch.tensor([[nan, 1.0, 2.0, 3.0], [nan, nan, nan, nan], [1.0, nan, float("inf"), nan],
                        [float("-inf")] * 4], device=DEV)
    for k in (1, 2, 4):
        got = moe.topk_gate(odd, k)
        assert torch.equal(got, ref.topk_gate_ref(odd, k)), (k, got.tolist())
    assert moe.topk_gate(odd, 3).tolist() == [[0, 3, 2], [0, 1, 2], [1, 3, 2], [0, 1, 2]]
    assert moe.topk_gate(torch.empty(0, 9, device=DEV), 2).shape == (0, 2)
    with pytest.raises(ValueError, match="topk_gate: `num_topk`"):
        moe.topk_gate(scores, 41)
    with pytest.raises(TypeError, match="topk_gate: `scores`"):
        moe.topk_gate(scores.half(), 2)


def test_normalize_weight_is_bit_exact(variant):
    w = torch.rand(300, 6, device=DEV)
    for inp in (w, w.t().contiguous().t()):
        denom, norm = moe.normalize_weight(inp)
        d_ref, n_ref = ref.normalize_weight_ref(inp)
        assert torch.equal(denom, d_ref) and torch.equal(norm, n_ref)
    d0, n0 = moe.normalize_weight(torch.zeros(2, 3, device=DEV))
    assert torch.equal(d0, torch.full((2,), 1e-20, device=DEV)) and not n0.isnan().any()
    with pytest.raises(TypeError, match="normalize_weight: `topk_weights`"):
        moe.normalize_weight(w.double())


def test_group_count_and_aux_fi_are_exact(variant):
    idx = random_topk(333, 6, 20)
    for dt in (torch.int64, torch.int32):
        got = moe.group_count(idx.to(dt), 20)
        assert got.dtype == torch.int32 and torch.equal(got, ref.group_count_ref(idx, 20))
    fi = moe.aux_fi(idx, 20, 6)
    assert fi.dtype == torch.float32 and torch.equal(fi, ref.aux_fi_ref(idx, 20, 6))
    assert torch.equal(moe.aux_fi(idx[:0], 20, 6), torch.zeros(20, device=DEV))
    bad = idx.clone()
    bad[0, 0] = 20
    with pytest.raises(RuntimeError, match="group_count"):
        moe.group_count(bad, 20)
    with pytest.raises(RuntimeError, match="aux_fi"):
        moe.aux_fi(bad, 20, 6)
    with pytest.raises(TypeError, match="group_count: `group_idx`"):
        moe.group_count(idx.float(), 20)


def test_group_count_reference_path_raises_value_error(monkeypatch):
    monkeypatch.setattr(checks, "interpreting", lambda: False)
    idx = random_topk(10, 2, 4, device="cpu")
    idx[1, 1] = -3
    with pytest.raises(ValueError, match="group_count: `group_idx` holds group id -3"):
        moe.group_count(idx, 4)


@pytest.mark.parametrize("ep,tp", [(1, 2), (2, 4), (4, 8), (3, 1)])
def test_mask_indices_by_tp_matches_reference(variant, ep, tp):
    n = 16 * ep * tp
    idx = random_topk(64, 6, n)
    for rank in range(tp):
        got = moe.mask_indices_by_tp(idx, n, ep, rank, tp)
        assert got.dtype == idx.dtype and torch.equal(got, ref.mask_indices_by_tp_ref(idx, n, ep, rank, tp))
    with pytest.raises(ValueError, match="mask_indices_by_tp: `tp_rank`"):
        moe.mask_indices_by_tp(idx, n, ep, tp, tp)


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("bad", [16, 99, -2])
def test_mask_indices_by_tp_refuses_ids_outside_the_experts(monkeypatch, path, bad):
    """An id >= n (or < -1) is no expert: it used to be renumbered into some rank's local range."""
    if path == "torch":
        monkeypatch.setattr(checks, "interpreting", lambda: False)
    idx = random_topk(8, 2, 16, device="cpu")
    idx[3, 1] = bad
    # Triton: an async assert (no host sync) after a launch that mapped the id to -1
    error = ValueError if path == "torch" else RuntimeError
    with pytest.raises(error, match=r"mask_indices_by_tp: `indices` holds (an )?expert id"):
        moe.mask_indices_by_tp(idx, 16, 2, 0, 2)


def test_inplace_unique_group_indices(variant):
    g = torch.randint(-1, 5, (100, 7), device=DEV)
    for inp in (g.clone(), g.t().contiguous().t()):
        want = inp.clone()
        ref.inplace_unique_group_indices_ref(want, 5)
        assert moe.inplace_unique_group_indices(inp, 5) is None
        assert torch.equal(inp, want)
        for row in inp.tolist():  # each id >= 0 at most once, first occurrence kept
            kept = [v for v in row if v >= 0]
            assert len(kept) == len(set(kept))
    assert torch.equal(want[:, 0], g[:, 0])


def test_inplace_unique_leaves_ids_below_minus_one_alone_and_refuses_shared_memory(variant):
    """Only repeats become -1 (an id < -1 is not a repeat), as the reference and the docstring say;
    an in-place argument whose elements share memory (expanded) is refused on both paths."""
    g = torch.tensor([[3, -2, 5, -7], [-2, 1, -3, 1]], device=DEV)
    want = g.clone()
    ref.inplace_unique_group_indices_ref(want, 8)
    moe.inplace_unique_group_indices(g, 8)
    assert g.tolist() == want.tolist() == [[3, -2, 5, -7], [-2, 1, -3, -1]]
    shared = torch.tensor([[1, 2, 1]], device=DEV).expand(4, 3)
    with pytest.raises(ValueError, match="`group_indices` is modified in place"):
        moe.inplace_unique_group_indices(shared, 4)


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_inplace_unique_refuses_rows_that_overlap_each_other(monkeypatch, path):
    """Rows sharing elements (as_strided with strides (1, 1): row t, column j is element t + j) have
    no defined in-place result (the kernel turned first occurrences into -1); refused. Layouts that
    interleave without sharing (strides (1, T), a transpose) stay fine."""
    if path == "torch":
        monkeypatch.setattr(checks, "interpreting", lambda: False)
    dev = "cpu" if path == "torch" else DEV
    buf = torch.tensor([1, 2, 1, 2, 3, 1, 3, 3, 2, 1, 0, 2, 3], device=dev)
    with pytest.raises(ValueError, match="`group_indices` is modified in place"):
        moe.inplace_unique_group_indices(buf.as_strided((8, 4), (1, 1)), 4)
    with pytest.raises(ValueError, match="`group_indices` is modified in place"):
        moe.inplace_unique_group_indices(buf.as_strided((4, 3), (2, 3)), 4)  # (3, 0) and (0, 2): both 6
    g = buf[:8].as_strided((4, 2), (1, 4))  # the transpose of a [2, 4] block: disjoint elements
    want = g.clone()
    ref.inplace_unique_group_indices_ref(want, 4)
    moe.inplace_unique_group_indices(g, 4)
    assert torch.equal(g, want)


def test_expand_with_no_tokens_but_padding_rows_writes_zeros(variant):
    """T = 0 with P > 0 (force_no_sync's bound, or an explicit P): every row is padding, so zero,
    not the buffer's old contents (the fixture poisons every torch.empty)."""
    idx = torch.empty((0, 4), dtype=torch.int64, device=DEV)
    p2e, _, _, inv, *_ = moe.get_fused_mapping(idx, 8, 0, 16, force_no_sync=True)
    assert p2e.numel() > 0 and (p2e == -1).all()
    y = moe.expand_to_fused(torch.randn(0, 32, device=DEV), inv, p2e)
    assert y.shape == (p2e.numel(), 32) and not y.isnan().any() and not y.any()


def test_expand_of_a_complex_tensor_matches_the_reference(variant):
    idx = random_topk(9, 2, 4)
    p2e, _, _, inv, *_ = moe.get_fused_mapping(idx, 4, 0, 4)
    x = torch.randn(9, 12, dtype=torch.complex64, device=DEV)[:, 1:11]  # strided rows
    y = moe.expand_to_fused(x, inv, p2e)
    assert y.dtype == torch.complex64 and torch.equal(y, ref.expand_to_fused_ref(x, inv, p2e.numel()))


def test_routing_ops_keep_gradients_by_running_the_reference(variant):
    """The kernels build no autograd graph: where an input requires grad (grad mode on), the torch
    reference runs, so the result carries the gradient instead of silently dropping it."""
    idx = random_topk(10, 3, 5)
    p2e, _, _, inv, *_ = moe.get_fused_mapping(idx, 5, 0, 4)
    x = torch.randn(10, 16, device=DEV, requires_grad=True)
    y = moe.expand_to_fused(x, inv, p2e)
    w = torch.rand(10, 3, device=DEV, requires_grad=True)
    denom, wn = moe.normalize_weight(w)
    out = moe.reduce_fused(y, wn, inv)
    out.square().sum().backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    yr = ref.expand_to_fused_ref(xr, inv, p2e.numel())
    _, wnr = ref.normalize_weight_ref(wr)
    ref.reduce_fused_ref(yr, wnr, inv).square().sum().backward()
    assert x.grad is not None and w.grad is not None
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)
    with torch.no_grad():  # no gradient wanted: the kernels (the results match either way)
        torch.testing.assert_close(moe.reduce_fused(y, wn, inv), out)


def test_column_offsets_past_int32_take_a_contiguous_copy(variant, monkeypatch):
    """The kernels index columns in 32 bits; an input whose column offsets would not fit (a
    transposed view of > 2**31 elements; here the limit is lowered to reach it with small tensors)
    runs on a contiguous copy (in place: written back), with the same results."""
    monkeypatch.setattr(checks, "COLUMN_OFFSET_MAX", 40)
    scores = torch.randn(12, 6, device=DEV).t().contiguous().t()  # column stride 12: 5 * 12 > 40
    torch.testing.assert_close(moe.topk_gate(scores, 3), ref.topk_gate_ref(scores, 3), rtol=0, atol=0)
    w = torch.rand(3, 12, device=DEV).t()
    for got, want in zip(moe.normalize_weight(w), ref.normalize_weight_ref(w), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    idx = random_topk(12, 3, 4)
    p2e, _, _, inv, *_ = moe.get_fused_mapping(idx, 4, 0, 4)
    z = torch.randn(p2e.numel(), 8, device=DEV)
    torch.testing.assert_close(moe.reduce_fused(z, w, inv), ref.reduce_fused_ref(z, w, inv))
    g = torch.randint(-1, 5, (7, 30), device=DEV).t().contiguous().t()  # in place through a copy
    want = g.clone()
    ref.inplace_unique_group_indices_ref(want, 5)
    moe.inplace_unique_group_indices(g, 5)
    assert torch.equal(g, want)


def test_column_offsets_past_int32_at_real_size():
    """The same with a real view whose column stride is 2**30: before, the 32-bit column offset
    wrapped and the interpreter crashed reading out of bounds."""
    out = run_with_a_huge_strided_view(
        Path(__file__).resolve().parents[1],
        "print(kernel.reduce_fused(torch.ones(3, 2, dtype=torch.float16), view, torch.tensor([[0, 1, 2]])).tolist())",
    )
    assert out == ["[[6.0, 6.0]]"]


# ----------------------------------------------------------------------------------------------
# GPU: DeepSeek-V3 routing shape
# ----------------------------------------------------------------------------------------------

T_GPU, K_GPU, E_GPU, H_GPU = 16384, 8, 256, 7168


@pytest.mark.gpu
def test_gpu_fused_mapping_expand_reduce_at_scale(variant):
    idx = random_topk(T_GPU, K_GPU, E_GPU, drop=0.02, skew=True)
    outs = moe.get_fused_mapping(idx, E_GPU, 0, 128)
    check_mapping(idx, E_GPU, 128, outs)
    expected = ref.get_fused_mapping_ref(idx, E_GPU, outs[0].numel(), 128)
    for got, want in zip(outs[:7], expected, strict=True):
        assert torch.equal(got, want)
    p2e, _, _, inv, *_ = outs
    explicit = moe.get_fused_mapping(idx, E_GPU, p2e.numel() + 128, 128)
    check_mapping(idx, E_GPU, 128, explicit, num_pos=p2e.numel() + 128, synced=False)
    x = torch.randn(T_GPU, H_GPU, device="cuda", dtype=torch.bfloat16)
    y = moe.expand_to_fused(x, inv, p2e)
    assert torch.equal(y.view(torch.int16), ref.expand_to_fused_ref(x, inv, p2e.numel()).view(torch.int16))
    w = torch.rand(T_GPU, K_GPU, device="cuda")
    got = moe.reduce_fused(y, w, inv)
    exact = ref.reduce_fused_ref(y, w, inv, acc_dtype=torch.float64)
    rel = ((got.double() - exact).norm() / exact.norm()).item()
    assert rel < 1e-2 and not got.isnan().any()
    torch.testing.assert_close(got.double(), exact, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("t,e", [(65536, 1024), (1, 256), (3000, 8)])
def test_gpu_fused_mapping_large_and_small(variant, t, e):
    idx = random_topk(t, K_GPU, e, skew=True)
    outs = moe.get_fused_mapping(idx, e, 0, 64)
    check_mapping(idx, e, 64, outs)
    expected = ref.get_fused_mapping_ref(idx, e, outs[0].numel(), 64)
    for got, want in zip(outs[:7], expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_small_ops_at_scale(variant):
    scores = torch.randn(T_GPU, E_GPU, device="cuda")
    scores[:, 100] = scores[:, 7]  # exact ties
    assert torch.equal(moe.topk_gate(scores, K_GPU), ref.topk_gate_ref(scores, K_GPU))
    idx = random_topk(T_GPU, K_GPU, E_GPU)
    assert torch.equal(moe.group_count(idx, E_GPU), ref.group_count_ref(idx, E_GPU))
    assert torch.equal(moe.aux_fi(idx, E_GPU, K_GPU), ref.aux_fi_ref(idx, E_GPU, K_GPU))
    w = torch.rand(T_GPU, K_GPU, device="cuda")
    (d, n), (d_ref, n_ref) = moe.normalize_weight(w), ref.normalize_weight_ref(w)
    assert torch.equal(d, d_ref) and torch.equal(n, n_ref)
    masked = moe.mask_indices_by_tp(idx, E_GPU, 2, 1, 4)
    assert torch.equal(masked, ref.mask_indices_by_tp_ref(idx, E_GPU, 2, 1, 4))
    groups = idx // 32
    want = groups.clone()
    ref.inplace_unique_group_indices_ref(want, E_GPU // 32)
    moe.inplace_unique_group_indices(groups, E_GPU // 32)
    assert torch.equal(groups, want)


@pytest.mark.gpu
def test_gpu_bad_inputs_on_the_host_sync_path():
    idx = random_topk(T_GPU, K_GPU, E_GPU)
    idx[123, 4] = E_GPU
    with pytest.raises(ValueError, match="expert ids"):
        moe.get_fused_mapping(idx, E_GPU, 0, 128)
    with pytest.raises(TypeError, match="`topk_idx`"):
        moe.get_fused_mapping(idx.float(), E_GPU, 0, 128)
    x = torch.randn(T_GPU, 64, device="cuda")
    with pytest.raises(ValueError, match="`token_topk_to_pos` must have"):
        moe.expand_to_fused(x, idx[:10].int(), torch.zeros(8, dtype=torch.int32, device="cuda"))


_BAD_CALLS = {
    "too_small_p": "moe.get_fused_mapping(idx, 8, 100, 1)",
    "expand_position_past_p":
        "inv[3, 1] = p2e.numel(); moe.expand_to_fused(torch.randn(256, 64, device='cuda'), inv, p2e)",
    "reduce_position_below_minus_one":
        "inv[3, 1] = -2; moe.reduce_fused(torch.randn(p2e.numel(), 64, device='cuda'), None, inv)",
    "mask_expert_id_past_n": "idx[3, 1] = 8; moe.mask_indices_by_tp(idx, 8, 2, 0, 2)",
}


@pytest.mark.gpu
@pytest.mark.parametrize("bad", sorted(_BAD_CALLS))
def test_gpu_bad_input_without_sync_triggers_a_device_assert_in_a_subprocess(bad):
    # A device-side assert poisons the CUDA context, so it runs in its own process.
    code = (
        "import sys, torch; from pathlib import Path; from kernelhub.hub import get_local_kernel;"
        f"moe = get_local_kernel(Path({str(Path(__file__).resolve().parents[1])!r}));"
        "idx = torch.randint(0, 8, (256, 4), device='cuda');"
        "p2e, _, _, inv, *_ = moe.get_fused_mapping(idx, 8, 0, 1);"
        f"{_BAD_CALLS[bad]}; torch.cuda.synchronize(); print('NO ASSERT')"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "0"})
    assert res.returncode != 0 and "NO ASSERT" not in res.stdout
    assert "assert" in (res.stderr + res.stdout).lower()


# ----------------------------------------------------------------------------------------------
# No GPU needed: compile every kernel for sm90 and sm80 with Triton's bundled ptxas
# ----------------------------------------------------------------------------------------------

_I32, _I64 = "*i32", "*i64"
_COMPILE_JOBS = {  # kernel name: (pointer/int signature, constexprs) at the benchmark shape
    "_map_count_kernel": (
        [_I64, _I32, _I32, _I32, _I32] + ["i32"] * 5, {"SUB": 128, "NB": 512, "FILL_BLOCK": 1024}),
    "_map_scan_kernel": ([_I32, _I32, "i32", "i32"], {"BLOCK_T": 128, "BLOCK_E": 16}),
    "_map_scatter_kernel": ([_I64] + [_I32] * 9 + ["i32"] * 6, {"SUB": 128, "NB": 512}),
    "_expand_kernel": (["*bf16", "*bf16", _I32, _I32, _I32] + ["i32"] * 5,
                       {"K": 8, "BLOCK_H": 1024, "PAD_ROWS": 128, "PAD_R": 16, "SUB_H": 128}),
    "_reduce_kernel": (["*bf16", "*fp32", _I32, "*bf16", _I32] + ["i32"] * 7,
                       {"K": 8, "HAS_W": True, "BLOCK_H": 1024}),
    "_topk_gate_kernel": (["*fp32", _I64] + ["i32"] * 4, {"K": 8, "BLOCK_T": 16, "E_POW2": 256}),
    "_normalize_weight_kernel": (["*fp32"] * 3 + ["i32"] * 3, {"K": 8, "BLOCK_T": 128}),
    "_group_count_kernel": ([_I64, _I32, "i32", "i32"], {"BLOCK": 1024, "NB": 512}),
    "_mask_indices_by_tp_kernel": ([_I64, _I64, _I32] + ["i32"] * 6, {"BLOCK": 1024}),
    "_unique_group_kernel": ([_I64] + ["i32"] * 3, {"K": 8, "BLOCK_T": 256}),
}


def _compile_all_for_gpus() -> None:
    """Run as a script with TRITON_INTERPRET=0: compile each kernel to cubin for sm90 and sm80."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for name, (types, consts) in _COMPILE_JOBS.items():
        fn = getattr(kernels, name)
        params = list(inspect.signature(fn.fn).parameters)
        runtime = [p for p in params if p not in consts]
        assert len(runtime) == len(types), (name, runtime)
        sig = dict(zip(runtime, types, strict=True)) | {c: "constexpr" for c in consts}
        for cap in (90, 80):
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", cap, 32), options={"num_warps": 4})
            print(f"compiled {name} for sm{cap}", flush=True)


@pytest.mark.skipif(tuple(int(v) for v in __import__("triton").__version__.split(".")[:2]) < (3, 7),
                    reason="the ASTSource signature format used here is Triton 3.7's")
def test_every_kernel_compiles_for_sm90_and_sm80_without_a_gpu(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[3] / "src"),
                                          str(Path(__file__).resolve().parents[3]),
                                          os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=600,
                         env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("compiled ") == 2 * len(_COMPILE_JOBS)


if __name__ == "__main__":
    _compile_all_for_gpus()
