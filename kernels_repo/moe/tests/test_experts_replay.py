"""Recorded and replayed inference launches of fused_experts (`_experts_replay`).

CPU: the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by the root conftest).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from _experts_helpers import (
    make_inputs,
    moe,
)


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


def _plan_parts():
    """(TensorDescriptor, _experts_replay, kernelhub.triton_launch, a launcher whose every call hits)
    for tests that record a launch by hand."""
    TensorDescriptor = pytest.importorskip("triton.tools.tensor_descriptor").TensorDescriptor

    class Launcher:
        @staticmethod
        def split_hit(call):
            return "hit"

    return (TensorDescriptor, importlib.import_module(moe.__name__ + "._experts_replay"),
            importlib.import_module("kernelhub.triton_launch"), Launcher)


def test_a_replay_rebuilds_descriptors_over_weights_and_internal_buffers(monkeypatch):
    """A recorded launch whose extras are TMA descriptors over a weight (an external) and over an
    internal buffer (the down GEMM's h with "A_TMA"): the replay passes a fresh descriptor over
    the new weight and one over the workspace region whose address the same launch gets for h,
    with the recorded dtype, shape, strides and box; a descriptor over the output is refused."""
    TensorDescriptor, rp, tl_mod, Launcher = _plan_parts()

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



def _fp8_cuda_inputs(fake_cuda_tensor, T=2, E=4, H=256, I=128, K=2, scale_dtype=torch.float32):
    x = fake_cuda_tensor((T, H), 1, torch.bfloat16)
    gu = fake_cuda_tensor((E, 2 * I, H), 1, torch.float8_e4m3fn)
    dn = fake_cuda_tensor((E, H, I), 1, torch.float8_e4m3fn)
    idx = fake_cuda_tensor((T, K), 1, torch.int64)
    w = fake_cuda_tensor((T, K), 1, torch.bfloat16)
    gus = fake_cuda_tensor((E, 2 * I // 128, H // 128), 1, scale_dtype)
    ds = fake_cuda_tensor((E, H // 128, I // 128), 1, scale_dtype)
    return x, gu, dn, idx, w, gus, ds


def test_fp8_replay_key_covers_the_scales_and_refuses_calls_the_ordinary_path_copies_for(fake_gpus):
    """The fp8 path's replay key: the 16-bit key's fields plus both scales' device, dtype, shape and
    strides, the variant and the block size. None where the ordinary path runs a torch op that a
    replay would not repeat (UE8M0 scales read as an fp32 copy; a column-strided x quantized from a
    contiguous copy), for a block size given as a list or with non-int entries (the checks reject
    what a replayed call would not see), and where a gradient is needed."""
    from conftest import fake_cuda_tensor

    fp8 = importlib.import_module(moe.__name__ + "._fp8_experts")
    ext = _fp8_cuda_inputs(fake_cuda_tensor)
    key = fp8.replay_key(*ext, (128, 128), None)
    assert key is not None and key == fp8.replay_key(*_fp8_cuda_inputs(fake_cuda_tensor), (128, 128), None)
    assert fp8.replay_key(*ext, (128, 128), "sm90") != key  # the variant
    wider = ext[:5] + (ext[5].as_strided(ext[5].shape, (8, 1, 4)), ext[6])  # a scale's strides
    assert fp8.replay_key(*wider, (128, 128), None) not in (None, key)
    if hasattr(torch, "float8_e8m0fnu"):
        ue8m0 = _fp8_cuda_inputs(fake_cuda_tensor, scale_dtype=torch.float8_e8m0fnu)
        assert fp8.replay_key(*ue8m0, (128, 128), None) is None
    x_cols = fake_cuda_tensor((256, 2), 1, torch.bfloat16).t()
    assert fp8.replay_key(x_cols, *ext[1:], (128, 128), None) is None
    assert fp8.replay_key(*ext, [128, 128], None) is None
    assert fp8.replay_key(*ext, (128, 128.0), None) is None
    assert fp8.replay_key(*ext, (128, True), None) is None
    grad = fake_cuda_tensor((2, 2), 1, torch.bfloat16).requires_grad_()
    assert fp8.replay_key(*ext[:4], grad, *ext[5:], (128, 128), None) is None
    with torch.no_grad():
        assert fp8.replay_key(*ext[:4], grad, *ext[5:], (128, 128), None) is not None


def test_a_replay_rebuilds_a_descriptor_over_a_dtype_view_of_a_weight(monkeypatch):
    """The W8A16 kernels read fp8 weights' bits through a TMA descriptor over weight.view(uint8):
    the replay rebuilds it over the new weight's view of that dtype. A descriptor over any other
    view inside a weight (an offset, another shape) is refused: the replay could not rebuild it."""
    TensorDescriptor, rp, tl_mod, Launcher = _plan_parts()

    def externals():
        return make_inputs(6, 32, 16, 4, 2, dtype=torch.bfloat16, seed=82)

    ext = externals()
    out = torch.empty(6, 32, dtype=torch.bfloat16)
    bits = ext[1].view(torch.int16)  # same element size, another dtype

    def call_over(t):
        desc = TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 16, 16])
        return tl_mod.SplitLaunch(Launcher, (2,), -1, (t, out), (desc,), (5,), (), 4, 3)

    plan = rp._plan([call_over(bits)], ext, out)
    assert plan is not None
    launched = []
    monkeypatch.setattr(tl_mod.CachedLaunch, "run_hit", staticmethod(lambda *a: launched.append(a)))
    new = externals()
    rp.replay(plan, new)
    (_, _, _, args), = launched
    ptr, out_ptr, desc = args[:3]
    assert ptr == new[1].data_ptr() and desc.base.data_ptr() == new[1].data_ptr()
    assert (desc.base.dtype, desc.base.shape, desc.base.stride()) == (torch.int16, new[1].shape, new[1].stride())
    assert rp._plan([call_over(ext[1][1:].view(torch.int16))], ext, out) is None
    assert rp._plan([call_over(ext[1].view(torch.int16)[:, :16])], ext, out) is None
