"""SwiGLU kernels vs the fp32 reference on the CPU (Triton interpreter), plus GPU tests (`gpu`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import fake_cuda_tensor, run_with_a_huge_strided_view
from kernelhub.hub import get_local_kernel

kernel = get_local_kernel(Path(__file__).resolve().parents[1])
ops = kernel.ops
dispatch = kernel._dispatch
layers = kernel.layers

TOL = {  # (rtol, atol) per dtype, KERNELS.md
    torch.float32: (1e-5, 1e-6),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
}
DTYPES = list(TOL)
IMPLS = ["sm80", "sm90"]


def _rand(shape, dtype, device="cpu"):
    return torch.randn(shape, dtype=torch.float32, device=device).to(dtype)


def _reference(gate, up, dy=None):
    """fp32 forward (and grads) on the dtype-rounded inputs, through torch autograd."""
    g = gate.detach().float().requires_grad_()
    u = up.detach().float().requires_grad_()
    y = F.silu(g) * u
    if dy is None:
        return y
    y.backward(dy.float())
    return y, g.grad, u.grad


def _close(actual, expected, dtype):
    rtol, atol = TOL[dtype]
    assert not torch.isnan(actual).any()
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


def _check_forward_and_grads(gate, up, dy, impl="sm80"):
    """swiglu's output and both gradients (gate, up require grad) against the fp32 reference."""
    y = ops.swiglu(gate, up, impl=impl)
    y.backward(dy)
    ref, rdg, rdu = _reference(gate, up, dy)
    _close(y, ref, gate.dtype)
    _close(gate.grad, rdg, gate.dtype)
    _close(up.grad, rdu, gate.dtype)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_double_backward_is_an_error_first_order_under_create_graph_is_right(impl, packed):
    """The kernels build no graph: under create_graph=True the first-order gradients are right and
    a second derivative through them raises instead of silently reading zero."""
    x = _rand((4, 64), torch.float32).requires_grad_()
    g, u = x.chunk(2, dim=-1)
    y = ops.swiglu_packed(x, impl=impl) if packed else ops.swiglu(g, u, impl=impl)
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    xr = x.detach().requires_grad_()
    gr, ur = xr.chunk(2, dim=-1)
    (want,) = torch.autograd.grad((F.silu(gr) * ur).square().sum(), xr)
    _close(gx, want, torch.float32)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gx.square().sum().backward()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 200), (2, 3, 64), (1, 48), (3, 4100), (130,)])
def test_forward_and_grads_match_fp32_reference(impl, dtype, shape):
    gate = _rand(shape, dtype).requires_grad_()
    up = _rand(shape, dtype).requires_grad_()
    dy = _rand(shape, dtype)
    out = ops.swiglu(gate, up, impl=impl)
    out.backward(dy)
    ref, ref_dg, ref_du = _reference(gate, up, dy)
    assert out.dtype == dtype and out.shape == gate.shape and out.is_contiguous()
    _close(out, ref, dtype)
    _close(gate.grad, ref_dg, dtype)
    _close(up.grad, ref_du, dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_results_are_the_fp32_values_rounded_once_to_nearest(impl, dtype):
    """One rounding, to nearest even as on the GPU: the outputs equal the fp32 closed forms rounded
    once by torch, but for the odd element where the fp32 math itself differs in its last bit
    (a truncating cast, as the interpreter's bf16 cast is, misses on about half the elements)."""
    gate, up, dy = (_rand((64, 200), dtype) for _ in range(3))
    want = (F.silu(gate.float()) * up.float()).to(dtype)
    want_dg, want_du = kernel.reference.swiglu_backward_reference(dy, gate, up)
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = ops.swiglu(g, u, impl=impl)
    dg, du = torch.autograd.grad(out, (g, u), dy)
    for name, got, ref in (("out", out, want), ("d gate", dg, want_dg), ("d up", du, want_du)):
        frac = (got != ref).float().mean().item()
        assert frac < 0.01, f"{name}: {frac:.1%} of the elements are not the fp32 value rounded to nearest"


@pytest.mark.parametrize("dtype", DTYPES)
def test_sm90_and_sm80_paths_are_bit_identical(dtype):
    # different schedules (persistent grid-stride vs one tile per program), same tile math
    gate, up, dy = (_rand((45, 320), dtype) for _ in range(3))
    a = ops.swiglu(gate, up, impl="sm90")
    b = ops.swiglu(gate, up, impl="sm80")
    assert torch.equal(a, b)
    da, ua = torch.full_like(gate, float("nan")), torch.full_like(gate, float("nan"))
    db, ub = torch.full_like(gate, float("nan")), torch.full_like(gate, float("nan"))
    dispatch._run((dispatch._VARIANTS["sm90"], -1, 2), True, False, 320, (dy, gate, up, da, ua))
    dispatch._run((dispatch._VARIANTS["sm80"], -1, 2), True, False, 320, (dy, gate, up, db, ub))
    assert not torch.isnan(da).any() and not torch.isnan(ua).any()
    assert torch.equal(da, db) and torch.equal(ua, ub)


def test_sm90_persistent_grid_is_smaller_than_tile_count_on_cpu():
    # the grid-stride loop only runs more than once if the grid is smaller than the tile count
    bm, bn, _, grid = dispatch._VARIANTS["sm90"].config(45, 320, 2, dispatch._INTERPRETER_SM_COUNT, False)
    tiles = -(-45 // bm) * -(-320 // bn)
    assert grid < tiles


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_strided_inputs(impl, dtype):
    base_g = _rand((40, 2 * 96), dtype)
    base_u = _rand((96, 40), dtype)
    gate = base_g[:, ::2]  # column stride 2
    up = base_u.t()  # transposed: column stride 40, row stride 1
    out = ops.swiglu(gate, up, impl=impl)
    _close(out, _reference(gate, up), dtype)
    # leading dims that no single row stride spans: [6, 4, 32] permuted from [4, 6, 32]
    g3 = _rand((4, 6, 32), dtype).permute(1, 0, 2)
    u3 = _rand((6, 4, 32), dtype)
    assert dispatch._rows(g3.shape, g3.stride()) is None
    g3.requires_grad_()
    u3.requires_grad_()
    dy = _rand((6, 4, 32), dtype).expand(6, 4, 32)
    y = ops.swiglu(g3, u3, impl=impl)
    y.backward(dy)
    ref, rdg, rdu = _reference(g3, u3, dy)
    _close(y, ref, dtype)
    _close(g3.grad, rdg, dtype)
    _close(u3.grad, rdu, dtype)


def test_leading_dims_of_one_shape_with_other_strides_each_get_their_own_rows(monkeypatch):
    """The [M, N] view of leading batch dims is cached by shape and strides (`_Variant.collapse`):
    tensors of one shape but other layouts, called in turn and again, each get their own."""
    monkeypatch.setattr(dispatch._VARIANTS["sm80"], "_collapsed", {})
    packed = _rand((2, 3, 128), torch.float32)
    layouts = {
        "contiguous": (_rand((2, 3, 64), torch.float32), _rand((2, 3, 64), torch.float32)),
        "chunk views": packed.chunk(2, dim=-1),
        "rows of a longer tensor": (_rand((2, 4, 64), torch.float32)[:, 1:],  # no single row stride
                                    _rand((2, 3, 64), torch.float32)),
        "column stride 2": (_rand((2, 3, 128), torch.float32)[..., ::2], _rand((2, 3, 64), torch.float32)),
    }
    for _ in range(2):
        for gate, up in layouts.values():
            g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
            g.data, u.data = gate, up  # the layouts themselves, differentiable
            _check_forward_and_grads(g, u, _rand((2, 3, 64), torch.float32))
    collapsed = dispatch._VARIANTS["sm80"]._collapsed
    # forward and backward per layout; the sliced one's forward has no single row stride (and its
    # backward, whose d gate is ours, neither: one launch per outer index, each a 2-D call)
    assert sum(1 for k in collapsed if not k[0]) == 4 and sum(1 for v in collapsed.values() if v is None) >= 1


def test_the_reference_result_is_contiguous_like_the_kernels():
    gate, up = _rand((8, 6), torch.float32).t(), _rand((8, 6), torch.float32).t()
    for impl in ("reference", "sm80"):
        assert ops.swiglu(gate, up, impl=impl).is_contiguous()
        assert ops.swiglu_packed(_rand((12, 8), torch.float32).t(), impl=impl).is_contiguous()


def test_torch_func_transforms_run_the_reference():
    """vmap and grad of torch.func: the kernels read raw addresses, which a batched tensor has not,
    so impl=None runs the torch reference (same fp32 math, one rounding); a forced kernel refuses."""
    gate, up = _rand((3, 5, 32), torch.float32), _rand((3, 5, 32), torch.float32)
    out = torch.func.vmap(ops.swiglu)(gate, up)
    _close(out, _reference(gate, up), torch.float32)
    packed = torch.cat([gate, up], dim=-1)
    _close(torch.func.vmap(ops.swiglu_packed)(packed), _reference(gate, up), torch.float32)
    dg, du = torch.func.grad(lambda g, u: ops.swiglu(g, u).sum(), argnums=(0, 1))(gate[0], up[0])
    _, rdg, rdu = _reference(gate[0], up[0], torch.ones(5, 32))
    _close(dg, rdg, torch.float32)
    _close(du, rdu, torch.float32)
    with pytest.raises(ValueError, match=r"swiglu: torch.func transforms .* `impl` 'sm80'"):
        torch.func.vmap(lambda g, u: ops.swiglu(g, u, impl="sm80"))(gate, up)
    # the layers (whose classes force an impl) run the reference there
    mlp = types.SimpleNamespace(gate_proj=torch.nn.Linear(16, 32), up_proj=torch.nn.Linear(16, 32),
                                down_proj=torch.nn.Linear(32, 16), act_fn=torch.nn.SiLU())
    x = torch.randn(3, 5, 16)
    batched = torch.func.vmap(lambda xx: layers.SwiGLUMLPSm80.forward(mlp, xx))(x)
    with torch.no_grad():
        want = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    _close(batched, want, torch.float32)
    _close(torch.func.vmap(lambda p: layers.SiluAndMulSm90.forward(None, p))(packed), _reference(gate, up),
           torch.float32)


def test_column_offsets_past_int32_run_on_contiguous_copies(monkeypatch):
    """The kernels index columns in 32 bits: an input whose column offsets would not fit (a transposed
    view of > 2**31 elements; here the limit is lowered to reach it with small tensors) is launched
    from a contiguous copy, forward and backward, 2-D, leading dims and packed alike."""
    monkeypatch.setattr(dispatch, "_INT32_MAX", 100)
    monkeypatch.setattr(dispatch._VARIANTS["sm80"], "_collapsed", {})
    seen = []
    split = dispatch._VARIANTS["sm80"].fwd.split
    monkeypatch.setattr(dispatch._VARIANTS["sm80"].fwd, "split",
                        lambda grid, index, tensors, *a, **k: (seen.append([t.stride(-1) for t in tensors]),
                                                              split(grid, index, tensors, *a, **k)))
    gate = _rand((48, 12), torch.float32).t().requires_grad_()  # column stride 12: 47 * 12 > 100
    up = _rand((12, 48), torch.float32).requires_grad_()
    _check_forward_and_grads(gate, up, _rand((12, 48), torch.float32))
    g3 = _rand((2, 48, 3), torch.float32).transpose(1, 2)  # leading dims
    _close(ops.swiglu(g3, g3.contiguous(), impl="sm80"), _reference(g3, g3.contiguous()), torch.float32)
    x = _rand((96, 5), torch.float32).t()  # packed: the up half starts 48 columns in
    _close(ops.swiglu_packed(x, impl="sm80"), _reference(*x.chunk(2, dim=-1)), torch.float32)
    assert seen and all(strides == [1, 1, 1] for strides in seen)  # only copies reached the kernel


def test_column_offsets_past_int32_at_real_size():
    """A real view with column stride 2**30: before, the 32-bit column offset wrapped and the
    interpreter crashed reading out of bounds."""
    out = run_with_a_huge_strided_view(
        Path(__file__).resolve().parents[1],
        'for impl in ("sm80", "sm90"):\n'
        '    print(kernel.swiglu(view, torch.ones(1, 3, dtype=torch.float16), impl=impl).tolist())',
    )
    want = str(F.silu(torch.tensor([[1.0, 2.0, 3.0]])).half().tolist())
    assert out == [want, want]


def test_expanded_grad_output_from_sum():
    gate = _rand((8, 48), torch.float32).requires_grad_()
    up = _rand((8, 48), torch.float32).requires_grad_()
    ops.swiglu(gate, up).sum().backward()  # dy is a stride-0 expanded tensor
    _, rdg, rdu = _reference(gate, up, torch.ones(8, 48))
    _close(gate.grad, rdg, torch.float32)
    _close(up.grad, rdu, torch.float32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_matches_reference_and_chunk_view(impl, dtype):
    x = _rand((3, 5, 2 * 72), dtype).requires_grad_()
    dy = _rand((3, 5, 72), dtype)
    y = ops.swiglu_packed(x, impl=impl)
    y.backward(dy)
    gate, up = x.detach().chunk(2, dim=-1)
    ref, rdg, rdu = _reference(gate, up, dy)
    _close(y, ref, dtype)
    assert x.grad.shape == x.shape
    _close(x.grad, torch.cat([rdg, rdu], dim=-1), dtype)
    # the chunk views of a packed tensor go through `swiglu` without a copy, same bits
    assert torch.equal(ops.swiglu(gate, up, impl=impl), y.detach())


def test_packed_input_that_is_itself_strided():
    x = _rand((16, 160), torch.float16)[:, :80]  # row stride 160, width 2I = 80
    y = ops.swiglu_packed(x)
    g, u = x.chunk(2, -1)
    _close(y, _reference(g, u), torch.float16)


@pytest.mark.parametrize("impl", IMPLS + ["reference"])
def test_out_is_written_in_place_everywhere(impl):
    gate, up = (_rand((2, 3, 96), torch.bfloat16) for _ in range(2))
    out = torch.full((2, 3, 96), float("nan"), dtype=torch.bfloat16)  # poisoned
    assert ops.swiglu(gate, up, out=out, impl=impl) is out
    assert not torch.isnan(out).any()
    assert torch.equal(out, ops.swiglu(gate, up, impl=impl))
    x = torch.cat([gate, up], dim=-1)
    out.fill_(float("nan"))
    assert ops.swiglu_packed(x, out=out, impl=impl) is out
    assert torch.equal(out, ops.swiglu(gate, up, impl=impl))


def _overlapping_outs():
    """(call, the argument `out` overlaps) for outs sharing part of an input's memory."""
    buf = _rand((2 * 64 * 256 + 64,), torch.float32)
    gate, up = buf[: 64 * 256].view(64, 256), buf[64 * 256 : 2 * 64 * 256].view(64, 256)
    shifted = buf[100 : 100 + 64 * 256].view(64, 256)  # over gate's tail and up's head
    square = _rand((64, 64), torch.float32)
    x = _rand((64, 512), torch.float32)
    row = buf[:256].view(1, 256)  # shares one element (255) with the out below
    return [
        (lambda impl: ops.swiglu(gate, up, out=shifted, impl=impl), "gate"),
        (lambda impl: ops.swiglu(gate.clone(), up, out=buf[64 * 256 + 50 : 2 * 64 * 256 + 50].view(64, 256),
                                 impl=impl), "up"),
        # gate's very memory, read column-wise: the same bytes, other strides
        (lambda impl: ops.swiglu(square.t(), square.t().clone(), out=square, impl=impl), "gate"),
        (lambda impl: ops.swiglu(row.clone(), row, out=buf[255:511].view(1, 256), impl=impl), "up"),
        (lambda impl: ops.swiglu_packed(x, out=x.view(-1)[: 64 * 256].view(64, 256), impl=impl), "x"),
        (lambda impl: ops.swiglu_packed(x, out=x.view(-1)[-64 * 256 :].view(64, 256), impl=impl), "x"),
    ]


@pytest.mark.parametrize("impl", IMPLS + ["reference"])
def test_out_overlapping_an_input_is_refused(impl):
    """An `out` sharing part of an input's memory is read after other programs wrote it (max error
    ~5 on the Triton variants): refused on every path, whatever `impl`, as torch's out= ops do."""
    for call, name in _overlapping_outs():
        with pytest.raises(ValueError, match=rf"swiglu(_packed)?: `out` overlaps `{name}`'s memory"):
            call(impl)


def test_overlapping_out_under_torch_compile_is_computed_then_copied():
    """Compiled code has no addresses to compare; it computes the result, then copies it into `out`,
    so an overlapping `out` still gets the right values there."""
    def packed(x):
        return ops.swiglu_packed(x, out=x.view(-1)[: 8 * 64].view(8, 64), impl="sm80")

    x = _rand((8, 128), torch.float32)
    want = _reference(*x.chunk(2, dim=-1))
    got = torch.compile(packed, backend="aot_eager", fullgraph=True)(x)
    _close(got, want, torch.float32)
    _close(x.view(-1)[: 8 * 64].view(8, 64), want, torch.float32)


@pytest.mark.parametrize("impl", IMPLS + ["reference"])
def test_out_that_is_an_input_computes_in_place(impl):
    """`out` that is gate or up itself (same memory, same strides) is fine for an elementwise kernel:
    every element is read by the program that writes it, before it writes it. Torch allows it too."""
    for which in ("gate", "up", "both"):
        gate, up = (_rand((3, 5, 96), torch.bfloat16) for _ in range(2))
        if which == "both":
            up = gate
        want = ops.swiglu(gate, up, impl=impl)
        out = up if which == "up" else gate.view(15, 96).view(3, 5, 96)  # a view of the same memory
        assert ops.swiglu(gate, up, out=out, impl=impl) is out
        assert torch.equal(out, want)


@pytest.mark.parametrize("impl", IMPLS + ["reference"])
def test_empty_inputs(impl):
    for shape in [(0, 64), (4, 0), (2, 0, 8)]:
        gate = torch.randn(shape, requires_grad=True)
        up = torch.randn(shape, requires_grad=True)
        y = ops.swiglu(gate, up, impl=impl)
        assert y.shape == gate.shape
        y.sum().backward()
        assert gate.grad.shape == gate.shape and up.grad.shape == up.shape
    x = torch.randn(0, 10, requires_grad=True)
    y = ops.swiglu_packed(x, impl=impl)
    assert y.shape == (0, 5)
    y.sum().backward()
    assert x.grad.shape == (0, 10)


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic_and_inputs_not_mutated(impl):
    gate, up, dy = (_rand((33, 96), torch.bfloat16) for _ in range(3))
    saved = [t.clone() for t in (gate, up, dy)]
    results = []
    for _ in range(2):
        g = gate.clone().requires_grad_()
        u = up.clone().requires_grad_()
        y = ops.swiglu(g, u, impl=impl)
        y.backward(dy)
        results.append((y, g.grad, u.grad))
        assert torch.equal(g.detach(), gate) and torch.equal(u.detach(), up)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    for t, s in zip((gate, up, dy), saved, strict=True):
        assert torch.equal(t, s)


def test_cpu_default_path_is_the_triton_interpreter_sm80():
    x = torch.randn(2, 64)
    assert dispatch._resolve("swiglu", x, None)[0].name == "sm80"
    assert dispatch._resolve("swiglu", x, "reference") is None


def test_variant_chosen_per_device_index(fake_gpus):
    # cuda:0 is sm80, cuda:1 sm90 (conftest); each tensor gets its own device's variant
    def pick(index, impl):
        variant, device_index, sm_count = dispatch._resolve("swiglu", fake_cuda_tensor((2, 8), index), impl)
        return variant.name, device_index, sm_count

    assert pick(0, None) == ("sm80", 0, 108)
    # capability 90 runs what measured fastest there (dispatch._AUTO_SM90), with its own SM count
    assert pick(1, None) == (dispatch._AUTO_SM90, 1, 132)
    fake_gpus.specs[0]["capability"] = 75  # below sm80: still the generic (sm80) kernels
    from kernelhub.device import clear_device_caches

    clear_device_caches()
    assert pick(0, None) == ("sm80", 0, 108)
    assert pick(1, "sm80") == ("sm80", 1, 132)
    assert pick(0, "sm90") == ("sm90", 0, 108)
    assert dispatch._resolve("swiglu", fake_cuda_tensor((2, 8), 1), "reference") is None
    # the impl=None target is cached per index, and forgotten with the device caches
    fake_gpus.specs[1]["sm_count"] = 114
    assert pick(1, None) == (dispatch._AUTO_SM90, 1, 132)
    clear_device_caches()
    assert pick(1, None) == (dispatch._AUTO_SM90, 1, 114)


def test_launch_runs_on_the_input_device_and_restores_current(fake_gpus, monkeypatch):
    seen = []

    def record(target, backward, packed, N, tensors):
        variant, device_index, sm_count = target
        seen.append((variant.name, backward, fake_gpus.current, device_index, sm_count,
                     {t.device for t in tensors}))

    monkeypatch.setattr(dispatch, "_launch", record)
    x = fake_cuda_tensor((4, 64), 1, torch.bfloat16)
    with x.fake_mode:
        y = ops.swiglu_packed(x)
        assert y.device == torch.device("cuda", 1) and y.shape == (4, 32)
        # backward: the same guard, and the gradient allocated on x's device
        ctx = types.SimpleNamespace(saved_tensors=(x,), target=(dispatch._VARIANTS["sm90"], 1, 132))
        dx, _ = ops._SwiGLUPackedFunction.backward(ctx, torch.empty((4, 32), dtype=torch.bfloat16,
                                                                    device=x.device))
        assert dx.device == x.device and dx.shape == x.shape
        g1, u1 = fake_cuda_tensor((4, 32), 1), fake_cuda_tensor((4, 32), 1)
        ctx = types.SimpleNamespace(saved_tensors=(g1, u1), target=(dispatch._VARIANTS["sm90"], 1, 132))
        dg, du, _ = ops._SwiGLUFunction.backward(ctx, torch.empty((4, 32), device=x.device))
        assert dg.device == du.device == x.device
        g0 = fake_cuda_tensor((4, 32), 0, torch.float16)
        ops.swiglu(g0, fake_cuda_tensor((4, 32), 0, torch.float16))
    cuda1 = {torch.device("cuda", 1)}
    assert seen[0] == (dispatch._AUTO_SM90, False, 1, 1, 132, cuda1)
    assert seen[1] == ("sm90", True, 1, 1, 132, cuda1)
    assert seen[2] == ("sm90", True, 1, 1, 132, cuda1)
    assert seen[3] == ("sm80", False, 0, 0, 108, {torch.device("cuda", 0)})
    assert fake_gpus.current == 0
    assert fake_gpus.set_calls == [1, 0, 1, 0, 1, 0]  # made current for each launch, then restored


# ---------------------------------------------------------------- errors

def test_errors_name_the_function_and_argument(fake_gpus):
    g = torch.randn(4, 8)
    a, b = fake_cuda_tensor((4, 8), 0), fake_cuda_tensor((4, 8), 1)
    cases = [
        (TypeError, r"swiglu: `gate` must be a torch.Tensor", lambda: ops.swiglu([1.0], g)),
        (TypeError, r"swiglu: `up` must be a torch.Tensor", lambda: ops.swiglu(g, None)),
        (TypeError, r"swiglu: `gate` must be float16, bfloat16 or float32, got torch.float64",
         lambda: ops.swiglu(g.double(), g.double())),
        (TypeError, r"`gate` must be float16.*torch.int32", lambda: ops.swiglu(g.int(), g.int())),
        (TypeError, r"swiglu: `up` must have dtype torch.float32 like `gate`, got torch.bfloat16",
         lambda: ops.swiglu(g, g.bfloat16())),
        (ValueError, r"swiglu: `up` must have the shape of `gate` \(4, 8\), got \(4, 9\)",
         lambda: ops.swiglu(g, torch.randn(4, 9))),
        (ValueError, r"swiglu: `up` must be on cpu like `gate`, got meta",
         lambda: ops.swiglu(g, torch.empty(4, 8, device="meta"))),
        (ValueError, r"`up` must be on cuda:0 like `gate`, got cuda:1", lambda: ops.swiglu(a, b)),
        (ValueError, r"swiglu: `gate` must have at least one dimension",
         lambda: ops.swiglu(torch.tensor(1.0), torch.tensor(1.0))),
        (ValueError, r"swiglu: `impl` must be one of", lambda: ops.swiglu(g, g, impl="sm70")),
        (ValueError, r"swiglu_packed: `x` must have an even last dimension",
         lambda: ops.swiglu_packed(torch.randn(4, 7))),
        (TypeError, r"swiglu_packed: `x` must be float16, bfloat16 or float32",
         lambda: ops.swiglu_packed(torch.randn(4, 8).double())),
        (TypeError, r"swiglu_packed: `x` must be a torch.Tensor", lambda: ops.swiglu_packed(3)),
        (TypeError, r"swiglu: `out` must be a torch.Tensor or None", lambda: ops.swiglu(g, g, out=[])),
        (ValueError, r"swiglu: `out` must be on cpu like the input, got meta",
         lambda: ops.swiglu(g, g, out=torch.empty(4, 8, device="meta"))),
        (TypeError, r"swiglu: `out` must have dtype torch.float32 like the input, got torch.float16",
         lambda: ops.swiglu(g, g, out=torch.empty(4, 8, dtype=torch.float16))),
        (ValueError, r"swiglu_packed: `out` must have shape \(4, 4\), got \(4, 8\)",
         lambda: ops.swiglu_packed(g, out=torch.empty(4, 8))),
        (ValueError, r"swiglu: `out` must be contiguous",
         lambda: ops.swiglu(g, g, out=torch.empty(8, 4).t())),
        (ValueError, r"swiglu: `out` is not differentiable",
         lambda: ops.swiglu(g.clone().requires_grad_(), g, out=torch.empty(4, 8))),
    ]
    for exc, pattern, call in cases:
        with pytest.raises(exc, match=pattern):
            call()


def test_other_device_types_run_the_torch_reference_and_refuse_a_triton_impl():
    """A device that is neither CUDA nor the CPU (meta here: shapes only) never reaches Triton, not
    even under TRITON_INTERPRET=1; asking for a Triton variant there is a clear error."""
    g, u = torch.empty(4, 8, device="meta"), torch.empty(4, 8, device="meta")
    for impl in (None, "reference"):
        out = ops.swiglu(g, u, impl=impl)
        assert out.device.type == "meta" and out.shape == (4, 8) and out.dtype == g.dtype
        assert ops.swiglu_packed(torch.empty(4, 16, device="meta"), impl=impl).shape == (4, 8)
    for impl in ("sm90", "sm80"):
        with pytest.raises(ValueError, match=rf"swiglu: `impl` '{impl}' needs a CUDA tensor .* got meta"):
            ops.swiglu(g, u, impl=impl)


# ---------------------------------------------------------------- layers on a real transformers MLP

def _llama_mlp(dtype, act="silu"):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=200, hidden_act=act,
                                   num_hidden_layers=1, num_attention_heads=4, vocab_size=32)
    torch.manual_seed(0)
    return LlamaMLP(cfg).to(dtype)


MLP_LAYERS = ["SwiGLUMLP", "SwiGLUMLPSm90", "SwiGLUMLPSm80", "SwiGLUMLPReference"]


@pytest.mark.parametrize("name", MLP_LAYERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_layer_replaces_llama_forward(name, dtype):
    mlp = _llama_mlp(dtype)
    layer = getattr(layers, name)
    assert layer.has_backward is True and isinstance(layer.can_torch_compile, bool)
    assert list(layer().parameters()) == [] and list(layer().buffers()) == []
    x = _rand((2, 5, 64), dtype)
    expected = mlp(x)
    expected.float().sum().backward()
    host_grads = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    mlp.forward = types.MethodType(layer.forward, mlp)  # what kernelize does
    out = mlp(x)
    out.float().sum().backward()
    rtol, atol = (1.3e-6, 1e-5) if dtype == torch.float32 else (1.6e-2, 1e-2)
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    for p, hg in zip(mlp.parameters(), host_grads, strict=True):
        torch.testing.assert_close(p.grad, hg, rtol=rtol, atol=atol * 10)


def test_mlp_layer_keeps_a_non_silu_host_activation():
    mlp = _llama_mlp(torch.float32, act="gelu")
    x = torch.randn(3, 64)
    torch.testing.assert_close(layers.SwiGLUMLP.forward(mlp, x), mlp(x))


@pytest.mark.parametrize("name", ["SiluAndMul", "SiluAndMulSm90", "SiluAndMulSm80", "SiluAndMulReference"])
def test_silu_and_mul_layers(name):
    layer = getattr(layers, name)
    assert layer.has_backward is True
    host = torch.nn.Module()
    x = _rand((3, 2 * 40), torch.bfloat16)
    g, u = x.chunk(2, -1)
    _close(layer.forward(host, x), _reference(g, u), torch.bfloat16)


def test_kernel_toml_lists_every_layer_with_its_attributes():
    tomllib = pytest.importorskip("tomllib")
    repo = Path(__file__).resolve().parents[1]
    meta = tomllib.loads((repo / "kernel.toml").read_text())
    assert meta["name"] == "swiglu" and isinstance(meta["version"], int) and meta["description"]
    assert sorted(meta["layers"]) == sorted(layers.__all__)
    for name, entry in meta["layers"].items():
        layer = getattr(layers, name)
        assert layer.has_backward == entry["has_backward"]
        assert layer.can_torch_compile == entry["can_torch_compile"]


# ---------------------------------------------------------------- torch.compile

def test_torch_compile_of_a_torch_func_transform_runs_the_reference():
    torch._dynamo.reset()
    g, u = _rand((4, 32), torch.float32), _rand((4, 32), torch.float32)
    grad = torch.func.grad(lambda a, b: ops.swiglu(a, b).sum(), argnums=(0, 1))
    packed_grad = torch.func.grad(lambda x: ops.swiglu_packed(x).sum())
    for f, args in ((grad, (g, u)), (packed_grad, (torch.cat([g, u], dim=-1),))):
        torch.testing.assert_close(torch.compile(f, backend="aot_eager", fullgraph=True)(*args), f(*args))


@pytest.mark.parametrize("impl", [None, "sm90", "reference"])
def test_torch_compile_fullgraph_matches_eager(impl):
    # the compiled path goes through custom ops: fullgraph=True fails on any graph break
    def f(g, u, x):
        return ops.swiglu(g, u, impl=impl).sum() + ops.swiglu_packed(x, impl=impl).float().sum()

    g, u, x = (_rand(s, dt).requires_grad_() for s, dt in
               [((8, 64), torch.float32), ((8, 64), torch.float32), ((2, 4, 96), torch.bfloat16)])
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    compiled(g, u, x).backward()
    got = [t.grad.clone() for t in (g, u, x)]
    for t in (g, u, x):
        t.grad = None
    f(g, u, x).backward()
    for a, t in zip(got, (g, u, x), strict=True):
        assert torch.equal(a, t.grad)


@pytest.mark.parametrize("impl", [None, "sm80"])
def test_compiled_inference_uses_the_ops_without_autograd_layers(impl):
    """Where no gradient can be needed (no_grad, or inputs that need none) the traced graph holds the
    inference ops (plain Library ops); where one can, the custom ops with a backward. Both give the
    eager bits."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    seen: list[str] = []

    def forward(gm, _):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=forward, bw_compiler=lambda gm, _: make_boxed_func(gm.forward))

    def f(g, u, x):
        return ops.swiglu(g, u, impl=impl), ops.swiglu_packed(x, impl=impl)

    g, u = _rand((5, 64), torch.float32), _rand((5, 64), torch.float32)
    x = _rand((2, 3, 96), torch.bfloat16)
    want = f(g, u, x)
    cases = [("no_grad, inputs need grad", True, False), ("grad on, inputs need none", False, True),
             ("grad on, inputs need grad", True, True)]
    for name, requires, grad_mode in cases:
        torch._dynamo.reset()
        seen.clear()
        args = [t.detach().requires_grad_(requires) for t in (g, u, x)]
        with torch.set_grad_enabled(grad_mode):
            got = torch.compile(f, backend=backend, fullgraph=True)(*args)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a.detach(), b), name
        ours = sorted(op.split(".")[-2] for op in seen if "kernelhub" in op)  # ns.name.default
        infer = not (requires and grad_mode)
        assert ours == (["swiglu_infer", "swiglu_packed_infer"] if infer else ["swiglu", "swiglu_packed"]), (name, seen)


def test_mlp_layer_under_torch_compile():
    mlp = _llama_mlp(torch.float32)
    x = torch.randn(2, 3, 64)
    expected = mlp(x)
    mlp.forward = types.MethodType(layers.SwiGLUMLP.forward, mlp)
    assert layers.SwiGLUMLP.can_torch_compile
    out = torch.compile(mlp, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(out, expected, rtol=1.3e-6, atol=1e-5)


# ---------------------------------------------------------------- GPU code generation, without a GPU

def test_gpu_code_is_vectorised_and_fits_its_register_budget():
    # compile for sm80 and sm90 (Triton's bundled ptxas, no device needed) in a fresh process,
    # since this one defined the kernels for the interpreter
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = Path(__file__).resolve().parents[3] / "tools" / "compile_probe.py"
    out = subprocess.run([sys.executable, str(probe)], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 12
    for r in rows:
        # every global access a 16-byte vector: 2 (fwd) or 3 (bwd) tensors in, 1 or 2 out
        assert set(r["loads"]) == {"ld.global.v4.b32"} and set(r["stores"]) == {"st.global.v4.b32"}, r
        assert r["loads"]["ld.global.v4.b32"] % (3 if r["backward"] else 2) == 0, r
        assert r["spill_bytes"] == 0, r
        if r["variant"] == "_sm90":
            # the persistent grid assumes 10 resident programs per SM: the register cap must hold
            assert r["registers"] <= r["maxnreg"] == 48, r
            assert r["config"][3] == 10 * 132, r
            if not r["packed"]:
                # the cap was chosen so that a tile's loads all issue before the first use
                assert r["loads_up_front"], r


# ---------------------------------------------------------------- GPU (TRITON_INTERPRET=0 pytest -m gpu)

GPU_SHAPES = [(4096, 6144), (64, 14336), (1, 11008), (333, 4100)]


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_variants_match_reference(impl, dtype, shape):
    dev = torch.device("cuda", torch.cuda.current_device())
    x = _rand((shape[0], 2 * shape[1]), dtype, dev).requires_grad_()
    dy = _rand(shape, dtype, dev)
    for _ in range(2):  # the second call takes the cached launch
        x.grad = None
        y = ops.swiglu_packed(x, impl=impl)
        y.backward(dy)
        g, u = x.detach().chunk(2, -1)
        ref, rdg, rdu = _reference(g, u, dy)
        _close(y, ref, dtype)
        _close(x.grad, torch.cat([rdg, rdu], -1), dtype)
    variant = dispatch._VARIANTS[impl]
    assert variant.fwd.exact and variant.bwd.exact  # repeated calls took the cached launch
    # a misaligned view after an aligned one must not reuse the aligned specialization
    g1, u1 = (_rand((shape[0] * shape[1] + 1,), dtype, dev)[1:].view(shape) for _ in range(2))
    _close(ops.swiglu(g1, u1, impl=impl), _reference(g1, u1), dtype)


@pytest.mark.gpu
def test_gpu_inductor_compile_matches_eager():
    dev = torch.device("cuda", torch.cuda.current_device())
    x = _rand((512, 2 * 4096), torch.bfloat16, dev).requires_grad_()
    dy = _rand((512, 4096), torch.bfloat16, dev)
    compiled = torch.compile(lambda t: ops.swiglu_packed(t) * 2, fullgraph=True)
    y = compiled(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    y_ref = ops.swiglu_packed(x) * 2
    (dx_ref,) = torch.autograd.grad(y_ref, x, dy)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
def test_gpu_work_lands_on_the_current_stream(impl):
    dev = torch.device("cuda", torch.cuda.current_device())
    gate, up = (_rand((2048, 4096), torch.bfloat16, dev) for _ in range(2))
    ops.swiglu(gate, up, impl=impl)  # compile and cache outside the capture
    side = torch.cuda.Stream(dev)
    graph = torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        # capture fails (or records nothing) unless the launch goes to the capturing stream
        with torch.cuda.graph(graph, stream=side):
            out = ops.swiglu(gate, up, impl=impl)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize(dev)
    _close(out, _reference(gate, up), torch.bfloat16)
