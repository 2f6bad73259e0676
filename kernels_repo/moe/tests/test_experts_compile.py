"""fused_experts under torch.compile (custom ops), torch.func transforms and double backward.

CPU: the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by the root conftest).
"""

from __future__ import annotations

import pytest
import torch
from _experts_helpers import (
    NAMES,
    TRITON_VARIANTS,
    GraphRecorder,
    build_experts,
    cfgs,
    make_inputs,
    moe,
    pipeline,
    run_with_grads,
    with_decode,
)


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
    rec = GraphRecorder()

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
    asked = []
    backward = pipeline.backward
    monkeypatch.setattr(pipeline, "backward", lambda *a: asked.append(a[-1]) or backward(*a))
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


def test_torch_compile_training_with_dynamic_token_counts_compiles_once():
    """dynamic=True: one graph for every token count. The training op's fake sized the saved rows
    with Python's min/max on the symbolic pair count, a guard on T*K < E that recompiled whenever
    a batch crossed it (here 6 pairs, then 26, for 16 experts)."""
    torch._dynamo.reset()
    f = lambda *a: moe.fused_experts(*a, variant="sm80")  # noqa: E731
    compiled = torch.compile(f, backend="aot_eager", dynamic=True, fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for T in (3, 13):
            x, gu, dn, idx, w = make_inputs(T, 32, 16, 16, 2, seed=T)
            dy = torch.randn(T, 32)
            got, got_grads = run_with_grads(compiled, x, gu, dn, idx, w, dy, torch.float32)
            want, want_grads = run_with_grads(f, x, gu, dn, idx, w, dy, torch.float32)
            assert torch.equal(got, want)
            for name, a, b in zip(NAMES, got_grads, want_grads, strict=True):
                assert torch.equal(a, b), name


@pytest.mark.parametrize("variant", ["sm80", "sm90"])
def test_training_op_sizes_its_saved_rows_without_a_guard_on_the_load(variant, fake_gpus):
    """On a GPU the bucket (and its block_m, which sizes the saved activation) follows the load
    T*K/E. With a symbolic T the training op's fake chose the bucket by comparing the load, a guard:
    compiled with dynamic=True it recompiled whenever a batch moved to a bucket of another block_m.
    Its row count is now one expression over every bucket: no guard, and the eager op's count at
    each load (E=128, H=2048, I=768 has shape-specific sm90 buckets)."""
    import importlib

    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    ops = importlib.import_module(moe.__name__ + "._experts_custom_ops")
    routing = importlib.import_module(moe.__name__ + "._experts_routing")
    E, H, inter, K = 128, 2048, 768, 8
    env = ShapeEnv()
    sym = env.create_symbol(40, source=ConstantSource("T"), dynamic_dim=DimDynamic.DYNAMIC)
    T = env.create_symintnode(sym, hint=40)
    dev = torch.device("cuda", 1 if variant == "sm90" else 0)
    with FakeTensorMode(shape_env=env):
        x = torch.empty(T, H, device=dev, dtype=torch.bfloat16)
        gu = torch.empty(E, 2 * inter, H, device=dev, dtype=torch.bfloat16)
        dn = torch.empty(E, H, inter, device=dev, dtype=torch.bfloat16)
        idx = torch.empty(T, K, device=dev, dtype=torch.int64)
        w = torch.empty(T, K, device=dev, dtype=torch.bfloat16)
        _, aux, meta = ops.fused_experts_train_op(x, gu, dn, idx, w, variant, "")
    assert not env.guards, [str(g.expr) for g in env.guards]
    capability = 90 if variant == "sm90" else 80
    for tokens in (1, 40, 64, 100, 512, 1024, 4096, 5000, 65536):
        pairs = tokens * K
        want = routing.max_rows(pairs, E, cfgs.pick_config(capability, E, H, inter, pairs)["block_m"])
        assert int(aux.shape[0].node.expr.subs(sym, tokens)) == want, tokens
        assert int(meta.shape[0].node.expr.subs(sym, tokens)) == 2 * want + 2 * E + pairs, tokens


def test_torch_compile_with_a_pinned_config_has_no_graph_break():
    cfg = with_decode()
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



def test_torch_compile_refuses_a_bad_pinned_config_on_every_variant():
    """As the eager path: the reference, which never reads the config, still checks it."""
    x, gu, dn, idx, w = make_inputs(3, 32, 16, 4, 2)
    bad = {**cfgs.INTERPRETER_CONFIG, "block_m": 3}
    compiled = torch.compile(lambda *a: moe.fused_experts(*a, variant="reference", config=bad), backend="aot_eager")
    for grad in (False, True):
        with pytest.raises(ValueError, match=r"fused_experts: `config`\['block_m'\] must be a power of two >= 16"):
            compiled(x.clone().requires_grad_(grad), gu, dn, idx, w)


def test_torch_compile_checks_check_indices_as_the_eager_path():
    x, gu, dn, idx, w = make_inputs(3, 32, 16, 4, 2)
    compiled = torch.compile(lambda *a: moe.fused_experts(*a, variant="reference", check_indices="yes"),
                             backend="aot_eager")
    with pytest.raises(TypeError, match="fused_experts: `check_indices` must be True, False or None, got 'yes'"):
        compiled(x, gu, dn, idx, w)
