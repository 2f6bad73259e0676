"""fused_experts' argument checks, device guards and per-device answers.

CPU: the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by the root conftest).
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from _experts_helpers import (
    checks,
    launch,
    make_inputs,
    moe,
    with_decode,
)


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

    # the guards of the training path (the autograd Function) and of the inference path
    monkeypatch.setattr(importlib.import_module(moe.__name__ + "._experts_autograd"), "device_guard", recording_guard)
    monkeypatch.setattr(importlib.import_module(moe.__name__ + "._experts_eager"), "device_guard", recording_guard)
    # every launcher's kernel (the interpreter always launches through `kernel[grid](...)`)
    for launcher in (launch.gemm_launch, launch.combine_launch, launch.wgrad_launch, rt._align_small_launch,
                     launch.decode_gate_up_launch, launch.decode_down_launch):
        monkeypatch.setattr(launcher, "kernel", Kernel(launcher.kernel))
    x, gu, dn, idx, w = make_inputs(3, 32, 16, 4, 2)
    leaves = [t.requires_grad_() for t in (x, gu, dn, w)]
    moe.fused_experts(leaves[0], leaves[1], leaves[2], idx, leaves[3], variant="sm90").sum().backward()
    assert len(launches) == 4 + 5  # align, gate_up, down, combine | dgrad, dx, combine, 2 wgrads
    moe.fused_experts(x.detach(), gu.detach(), dn.detach(), idx, w.detach(), variant="sm90", config=with_decode())
    assert len(launches) == 9 + 2  # the decode path: gate_up, down
    assert all(stack == [x.device] for stack in launches), launches


def test_graph_capture_is_asked_of_the_inputs_device_not_the_current_one(fake_gpus, monkeypatch):
    # the index check (one host sync) is skipped while x's device captures a CUDA graph; torch
    # answers is_current_stream_capturing for the current device only
    from conftest import fake_cuda_tensor

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: fake_gpus.current == 1)
    x = fake_cuda_tensor((4, 8), 1)
    fake_gpus.current = 0
    assert checks.capturing(x) is True
    assert fake_gpus.current == 0  # the caller's device, restored
    assert checks.capturing(fake_cuda_tensor((4, 8), 0)) is False


def test_variant_follows_the_capability_of_each_device_index(fake_gpus):
    assert moe.select_variant(torch.device("cuda", 0)) == "sm80"
    assert moe.select_variant(torch.device("cuda", 1)) == "sm90"
    assert moe.select_variant(torch.device("cpu")) == "reference"



def test_the_reference_refuses_bad_inputs_naming_the_argument():
    """The public reference checks its inputs as `fused_experts` does (shapes, dtypes), instead of an
    IndexError, a silently short routing or integer inputs computed in fp32 and cast back."""
    x, gu, dn, idx, w = make_inputs(3, 32, 16, 4, 2)
    fn = "fused_experts_reference"
    with pytest.raises(ValueError, match=rf"{fn}: `x` must be \[T, H\], got shape \(\)"):
        moe.fused_experts_reference(torch.tensor(1.0), gu, dn, idx, w)
    with pytest.raises(ValueError, match=rf"{fn}: `topk_idx` must be \[T=3, K>=1\], got shape \(2, 2\)"):
        moe.fused_experts_reference(x, gu, dn, idx[:2], w[:2])
    with pytest.raises(TypeError, match=rf"{fn}: `x` must be float16/bfloat16/float32/float64, got torch.int64"):
        moe.fused_experts_reference(x.long(), gu.long(), dn.long(), idx, w)
    with pytest.raises(ValueError, match=rf"{fn}: `topk_weights` must have the shape of `topk_idx`"):
        moe.fused_experts_reference(x, gu, dn, idx, w[:, :1])
    # ids outside [-1, E) stay dropped, as documented (no host-synchronising id check)
    far = idx.clone()
    far[0, 0] = 4
    torch.testing.assert_close(moe.fused_experts_reference(x, gu, dn, far, w),
                               moe.fused_experts_reference(x, gu, dn, torch.where(far == 4, -1, far), w))
