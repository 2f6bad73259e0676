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

