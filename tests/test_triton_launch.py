"""CachedLaunch: keys at least as fine as Triton's specialization, and the same results either way."""

from __future__ import annotations

import threading
import types

import pytest
import torch
import triton
import triton.language as tl

from kernelhub import triton_launch
from kernelhub.triton_launch import CachedLaunch, _arg_key, _int_spec, _spec_key


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * alpha * SCALE + y, mask=mask)


@triton.jit
def _twice_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2, mask=mask)


def test_split_launch_runs_the_same_kernel():
    launch = CachedLaunch(_twice_kernel)
    x = torch.randn(100)
    out = torch.zeros(100)
    launch.split((2,), -1, (x, out), (100,), (64,))
    torch.testing.assert_close(out, 2 * x, rtol=0, atol=0)


@triton.jit
def _maybe_bias_kernel(x_ptr, out_ptr, bias_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask)
    if bias_ptr is not None:
        v += tl.load(bias_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, v, mask=mask)


def test_split_launch_passes_extras_between_tensors_and_ints():
    # (tensors, extras, ints, constexprs): the MoE kernels take None or a tensor descriptor there
    launch = CachedLaunch(_maybe_bias_kernel)
    x = torch.randn(100)
    out = torch.zeros(100)
    launch.split((2,), -1, (x, out), (100,), (64,), extras=(None,))
    torch.testing.assert_close(out, x, rtol=0, atol=0)


def test_keys_tell_apart_what_triton_specializes_apart():
    a = torch.zeros(64)
    assert _arg_key(True) != _arg_key(1)  # i1 vs the constant 1
    assert _arg_key(a) != _arg_key(a.half())  # dtype
    assert _arg_key(a) != _arg_key(a[1:])  # 16-byte alignment (4-byte offset)
    assert _arg_key(a) == _arg_key(torch.ones(64))  # same dtype and alignment: same kernel
    assert _arg_key(None) is None and _arg_key(7) == 7


def test_tensor_descriptors_are_keyed_by_every_field():
    TensorDescriptor = pytest.importorskip("triton.tools.tensor_descriptor").TensorDescriptor
    w = torch.zeros(4, 64, 32)

    def desc(t, block):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block)

    base = _arg_key(desc(w, [1, 16, 32]))
    assert base == _arg_key(desc(torch.ones(4, 64, 32), [1, 16, 32]))
    assert base != _arg_key(desc(w, [1, 32, 32]))  # block shape
    assert base != _arg_key(desc(w.half(), [1, 16, 32]))  # dtype
    assert base != _arg_key(desc(w[:2], [1, 16, 32]))  # shape


def test_runtime_ints_map_to_triton_specializations_and_constexprs_stay_exact():
    assert _int_spec(1) == 1
    assert _int_spec(16) == _int_spec(4096) != _int_spec(17)
    assert _int_spec(17) == _int_spec(3)
    assert _int_spec(2**31) != _int_spec(2**31 - 16)  # 64-bit vs 32-bit
    exact = (5, 32, 16)
    assert _spec_key(exact, (False, False, True)) == (_int_spec(5), _int_spec(32), 16)


def test_constexpr_keywords_are_ordered_by_the_kernel_signature():
    launch = CachedLaunch(_axpy_kernel)
    x, y = torch.randn(100), torch.randn(100)
    out = torch.empty(100)
    # keywords in another order than the signature's
    launch((2,), -1, x, y, out, 100, 0.5, BLOCK=64, SCALE=2, num_warps=4)
    torch.testing.assert_close(out, x + y, rtol=0, atol=0)
    assert launch.names[-2:] == ("SCALE", "BLOCK")
    out.zero_()
    launch((2,), -1, x, y, out, 100, 0.5, BLOCK=64, SCALE=4, num_warps=4)
    torch.testing.assert_close(out, 2 * x + y)


def test_recording_collects_split_calls_of_its_context_only():
    launch = CachedLaunch(_twice_kernel)
    x = torch.randn(100)
    out = torch.zeros(100)
    launch.split((2,), -1, (x, out), (100,), (64,))  # before: not recorded
    with CachedLaunch.recording() as calls:
        launch.split((2,), -1, (x, out), (100,), (64,), num_warps=2)
        with CachedLaunch.recording() as inner:  # a nested recording takes the calls made inside it
            launch.split((1,), -1, (x, out), (64,), (64,))
        seen = []
        worker = threading.Thread(target=lambda: (launch.split((2,), -1, (x, out), (100,), (64,)),
                                                  seen.append(triton_launch._RECORDING.get())))
        worker.start()
        worker.join()
    launch.split((2,), -1, (x, out), (100,), (64,))  # after: not recorded
    assert seen == [None]  # another thread's launches are not this context's
    assert [c.grid for c in inner] == [(1,)]
    assert len(calls) == 1
    call = calls[0]
    assert call.launcher is launch and call.tensors[0] is x and call.tensors[1] is out
    assert (call.grid, call.device_index, call.ints, call.constexprs, call.num_warps) == ((2,), -1, (100,), (64,), 2)
    assert launch.split_hit(call) is None  # the interpreter takes Triton's path: nothing to replay
    torch.testing.assert_close(out, 2 * x, rtol=0, atol=0)


@pytest.mark.gpu
def test_a_recorded_split_call_replays_with_other_addresses():
    launch = CachedLaunch(_twice_kernel)
    if not launch.fast:
        pytest.skip("triton < 3.4 or hooks: split takes Triton's path")
    dev = torch.device("cuda", torch.cuda.current_device())
    x, out = torch.randn(100, device=dev), torch.zeros(100, device=dev)
    with CachedLaunch.recording() as calls:
        launch.split((2,), dev.index, (x, out), (100,), (64,))
    hit = launch.split_hit(calls[0])
    assert hit is not None
    x2, out2 = torch.randn(100, device=dev), torch.zeros(100, device=dev)
    CachedLaunch.run_hit(hit, (2,), dev.index, (x2.data_ptr(), out2.data_ptr(), 100, 64))
    torch.testing.assert_close(out2, 2 * x2, rtol=0, atol=0)


@pytest.mark.gpu
def test_cached_launches_match_triton_launches_on_the_gpu():
    launch = CachedLaunch(_axpy_kernel)
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = torch.randn(4096 + 8, device=dev)
    y = torch.randn(4096 + 8, device=dev)
    for n in (1, 16, 100, 4096):  # == 1, % 16, other: three specializations, reused across n
        for offset in (0, 1):  # aligned and misaligned pointers
            x = buf[offset:offset + n]
            out = torch.empty(n, device=dev)
            for _ in range(2):  # first call through Triton, second through the cached handle
                out.zero_()
                launch((triton.cdiv(n, 64),), dev.index, x, y[:n], out, n, 1.5, SCALE=2, BLOCK=64)
                torch.testing.assert_close(out, x * 3 + y[:n], rtol=0, atol=0)
    if launch.fast:  # triton >= 3.4 without hooks: the cached path was taken
        assert launch.exact and launch.by_spec
        assert len(launch.by_spec) <= 3 * 2  # n: == 1, % 16, other; x: aligned or not
    twice = CachedLaunch(_twice_kernel)
    for n in (1, 16, 100, 4096):
        for offset in (0, 1):
            x = buf[offset:offset + n]
            for dtype in (torch.float32, torch.bfloat16):
                xx = x.to(dtype)
                out = torch.zeros(n, device=dev, dtype=dtype)
                for _ in range(2):
                    twice.split((triton.cdiv(n, 64),), dev.index, (xx, out), (n,), (64,))
                    torch.testing.assert_close(out, 2 * xx, rtol=0, atol=0)
    if twice.fast:
        assert any(k[0] == "split" for k in twice.exact)
        if triton.__version__.startswith("3.6."):  # the launcher's entry point, called directly
            assert all(hit[3] is not None for hit in twice.by_spec.values())


def test_direct_entry_only_for_a_scratch_free_triton_3_6_launcher():
    class CudaLauncher:  # the fields of triton 3.6's launcher object
        def __init__(self, **fields):
            self.launch = print
            self.launch_cooperative_grid = False
            self.launch_pdl = True
            self.global_scratch_size = self.profile_scratch_size = 0
            self.__dict__.update(fields)

    assert triton_launch._direct_entry(CudaLauncher()) == (print, False, True)
    assert triton_launch._direct_entry(CudaLauncher(global_scratch_size=128)) is None
    assert triton_launch._direct_entry(CudaLauncher(profile_scratch_size=8)) is None
    assert triton_launch._direct_entry(CudaLauncher(arg_annotations=())) is None  # 3.7's layout
    assert triton_launch._direct_entry(print) is None


def test_the_interpreter_always_takes_tritons_path():
    if not triton_launch._INTERPRET:
        pytest.skip("only meaningful under TRITON_INTERPRET=1")
    assert not CachedLaunch(_axpy_kernel).fast



class _FakeParam:
    def __init__(self, name: str, is_constexpr: bool) -> None:
        self.name, self.is_constexpr = name, is_constexpr


class _FakeJit:
    """A JITFunction's surface as CachedLaunch reads it; `kernel[grid](...)`, Triton's own path,
    records its call and returns a compiled handle that only names itself."""

    def __init__(self, names: list[str], n_constexpr: int) -> None:
        self.params = [_FakeParam(n, i >= len(names) - n_constexpr) for i, n in enumerate(names)]
        self.arg_names = names
        self.pre_run_hooks = []
        self.triton_calls = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.triton_calls.append((grid, args, kwargs))
            return types.SimpleNamespace(run=print, function=("compiled", len(self.triton_calls)),
                                         packed_metadata=None)
        return launch


@pytest.fixture
def fast_fake(monkeypatch):
    """A CachedLaunch on the cached (GPU) path over a fake kernel (x, y, out, n, stride, BLOCK),
    with the driver call recorded instead of made: split's keyed path, checkable on a CPU."""
    if triton_launch._knobs is None:
        pytest.skip("triton < 3.4: no cached path")
    ran = []
    monkeypatch.setattr(CachedLaunch, "_run", staticmethod(lambda hit, grid, index, args: ran.append(
        (hit[1], grid, index, tuple(args)))))
    launch = CachedLaunch(_FakeJit(["x", "y", "out", "n", "stride", "BLOCK"], 1))
    launch.fast = True  # (under the interpreter every launch takes Triton's path)
    return launch, ran


def test_split_reuses_a_compiled_handle_only_for_what_it_was_compiled_for(fast_fake, monkeypatch):
    launch, ran = fast_fake
    kernel = launch.kernel
    x, y, out = torch.randn(65), torch.randn(64), torch.empty(64)
    launch.split((2,), 0, (x[:64], y, out), (64, 1), (32,), num_warps=8)  # compiled by Triton
    assert len(kernel.triton_calls) == 1 and not ran
    assert kernel.triton_calls[0][2]["num_warps"] == 8
    x2, y2, out2 = torch.randn(64), torch.randn(64), torch.empty(64)
    launch.split((2,), 0, (x2, y2, out2), (64, 1), (32,), num_warps=8)  # the handle, other addresses
    assert ran == [(("compiled", 1), (2,), 0, (x2.data_ptr(), y2.data_ptr(), out2.data_ptr(), 64, 1, 32))]
    launch.split((2,), 0, (x2, y2, out2), (48, 1), (32,), num_warps=8)  # same specialization of n
    assert ran[-1] == (("compiled", 1), (2,), 0, (x2.data_ptr(), y2.data_ptr(), out2.data_ptr(), 48, 1, 32))
    assert len(kernel.triton_calls) == 1
    # what Triton compiles apart is compiled apart: another dtype, n == 1, other warps, device,
    # constexpr; a 4-byte offset (alignment) goes through Triton's own launch every time
    others = [
        lambda: launch.split((2,), 0, (x2.half(), y2, out2), (64, 1), (32,), num_warps=8),
        lambda: launch.split((2,), 0, (x2, y2, out2), (1, 1), (32,), num_warps=8),
        lambda: launch.split((2,), 0, (x2, y2, out2), (64, 1), (32,), num_warps=4),
        lambda: launch.split((2,), 1, (x2, y2, out2), (64, 1), (32,), num_warps=8),
        lambda: launch.split((2,), 0, (x2, y2, out2), (64, 1), (64,), num_warps=8),
        lambda: launch.split((2,), 0, (x[1:], y, out), (64, 1), (32,), num_warps=8),
    ]
    for i, call in enumerate(others):
        n = len(ran)
        call()
        assert len(kernel.triton_calls) == 2 + i and len(ran) == n
    # launch hooks registered, or other Triton settings: Triton's path (which calls the hooks)
    monkeypatch.setattr(triton_launch, "_launch_state", lambda: None)
    launch.split((2,), 0, (x2, y2, out2), (64, 1), (32,), num_warps=8)
    assert len(kernel.triton_calls) == 8
    monkeypatch.setattr(triton_launch, "_launch_state", lambda: (True, None))  # e.g. debug on
    launch.split((2,), 0, (x2, y2, out2), (64, 1), (32,), num_warps=8)
    assert len(kernel.triton_calls) == 9
    monkeypatch.undo()
    # an argument too few: Triton's path, which raises for it (never a cached launch)
    launch.split((2,), 0, (x2, y2, out2), (64,), (32,), num_warps=8)
    assert kernel.triton_calls[-1][1] == (x2, y2, out2, 64, 32) and len(kernel.triton_calls) == 10
