"""fused_experts against a float64 loop: dtypes, strides, gradients, empty and edge shapes.

CPU: the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by the root conftest).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from _experts_helpers import (
    NAMES,
    TRITON_VARIANTS,
    assert_close_rel,
    build_experts,
    checks,
    launch,
    loop_reference,
    make_inputs,
    moe,
    run_with_grads,
    with_decode,
)


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


def test_reference_with_nothing_routed_still_gives_zero_gradients():
    x, gu, dn, idx, w = make_inputs(3, 32, 16, 4, 2)
    leaves = [t.requires_grad_() for t in (x, gu, dn, w)]
    moe.fused_experts_reference(leaves[0], leaves[1], leaves[2], torch.full_like(idx, -1), leaves[3]).sum().backward()
    assert all(t.grad is not None and not t.grad.any() for t in leaves)


@pytest.mark.parametrize("variant", TRITON_VARIANTS + ["reference"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_dropped_pairs_and_unrouted_tokens_are_never_read(variant, bad):
    """A NaN/inf weight on a dropped pair (-1, or the EP sentinel E), or in a token no pair routes,
    changes no output and no gradient, also when nothing is routed (the reference returned
    0 * (a sum over every input): NaN, where the kernels return zeros)."""
    E = 4
    x, gu, dn, idx, w = make_inputs(4, 32, 16, E, 2, drop=2)
    idx[2, 0] = E  # transformers' expert-parallel sentinel
    idx[3] = torch.tensor([-1, E])  # token 3: no pair routed
    for ids in (idx, torch.where(idx[:, :1] < E, -1, E).expand(4, 2).contiguous()):  # ... or none
        dropped = (ids < 0) | (ids >= E)
        want = moe.fused_experts(x, gu, dn, ids, w.masked_fill(dropped, 0.0), variant=variant,
                                 check_indices=False)
        xb = x.clone()
        xb[3] = bad
        leaves = [t.clone().requires_grad_() for t in (xb, gu, dn, w.masked_fill(dropped, bad))]
        out = moe.fused_experts(leaves[0], leaves[1], leaves[2], ids, leaves[3], variant=variant,
                                check_indices=False)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        out.sum().backward()
        assert all(t.grad.isfinite().all() for t in leaves)
        assert not leaves[3].grad[dropped].any() and not leaves[0].grad[3].any()
    if variant != "reference":  # the token-major decode path (inference, up to 3 tokens here)
        ids = idx[1:]
        dropped = (ids < 0) | (ids >= E)
        xb = x[1:].clone()
        xb[2] = bad
        out = moe.fused_experts(xb, gu, dn, ids, w[1:].masked_fill(dropped, bad), variant=variant,
                                config=with_decode(), check_indices=False)
        want = moe.fused_experts(x[1:], gu, dn, ids, w[1:].masked_fill(dropped, 0.0), variant=variant,
                                 check_indices=False)
        torch.testing.assert_close(out, want)


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
    monkeypatch.setattr(checks, "INNER_OFFSET_MAX", 1000)
    seen = []
    gemm = launch.gemm
    monkeypatch.setattr(launch, "gemm", lambda a, weight, *args, **kw: (seen.append((a.stride(), weight.stride())),
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




@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])
def test_zero_hidden_size_with_tma_aligned_weights_gives_an_empty_result_on_every_variant(grad, dtype):
    """H = 0 with weights whose strides TMA accepts (views of larger weights): sm90 returns the empty
    result of sm80 and the reference instead of failing in a TensorDescriptor of a zero-size dim."""
    x = torch.randn(3, 16, dtype=dtype)[:, :0]
    gu = torch.randn(4, 8, 16, dtype=dtype)[:, :, :0]
    dn = torch.randn(4, 16, 4, dtype=dtype)[:, :0]
    idx, w = torch.tensor([[0, 1], [2, 3], [1, -1]]), torch.rand(3, 2, dtype=dtype)
    results = {}
    for variant in ("reference", "sm80", "sm90"):
        leaves = [t.detach().clone().requires_grad_(grad) for t in (x, gu, dn, w)]
        out = moe.fused_experts(leaves[0], leaves[1], leaves[2], idx, leaves[3], variant=variant)
        if grad:
            out.sum().backward()
        results[variant] = (out, [t.grad for t in leaves])
    for variant, (out, grads) in results.items():
        assert out.shape == (3, 0) and out.dtype == dtype, variant
        if grad:
            assert [g.shape for g in grads] == [t.shape for t in (x, gu, dn, w)], variant
            assert torch.equal(grads[3], torch.zeros_like(w)), variant
