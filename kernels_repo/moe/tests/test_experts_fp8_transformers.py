"""fp8_experts_forward: the "kernelhub" implementation of transformers' FP8ExpertsInterface, on real
`FP8Experts` modules built from model configs (CPU: the reference variant, as [dispatch_fp8] says)."""

from __future__ import annotations

import pytest
import torch
from _experts_helpers import loop_reference, moe, restore_kernelhub

transformers = pytest.importorskip("transformers")
fp8_integration = pytest.importorskip("transformers.integrations.finegrained_fp8")
from transformers.integrations.moe import use_experts_implementation  # noqa: E402

CONFIGS = {
    "deepseek_v3": ("DeepseekV3Config", dict(hidden_size=256, moe_intermediate_size=128, n_routed_experts=4,
                                             num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(hidden_size=256, moe_intermediate_size=256, num_experts=5,
                                         num_experts_per_tok=3)),
}


def build(model: str, seed: int = 0, **kwargs):
    """An FP8Experts module as transformers' FineGrainedFP8 conversion builds it, with random weights
    quantized to 128x128 blocks."""
    cfg_name, cfg_kwargs = CONFIGS[model]
    cfg = getattr(transformers, cfg_name)(**cfg_kwargs)
    cls = use_experts_implementation(experts_class=fp8_integration.FP8Experts,
                                     experts_interface=fp8_integration.ALL_FP8_EXPERTS_FUNCTIONS,
                                     has_bias=False, has_gate=True)
    m = cls(cfg, block_size=(128, 128), **kwargs)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n in ("gate_up_proj", "down_proj"):
            q, s = moe.quantize_blocks(torch.randn(getattr(m, n).shape, generator=g) * getattr(m, n).shape[-1] ** -0.5)
            getattr(m, n).data = q
            getattr(m, n + "_scale_inv").data = s
    return m


@pytest.fixture
def kernelhub_fp8():
    interface = fp8_integration.ALL_FP8_EXPERTS_FUNCTIONS
    previous = interface._global_mapping.get("kernelhub")
    interface.register("kernelhub", moe.layers.fp8_experts_forward)
    yield
    restore_kernelhub(interface, previous)


@pytest.mark.parametrize("model", list(CONFIGS))
def test_fp8_experts_with_kernelhub_implementation_matches_float64_loop(model, kernelhub_fp8):
    m = build(model)
    assert m.gate_up_proj.requires_grad  # transformers allocates the fp8 weights as trainable Parameters
    m.config._experts_implementation = "kernelhub"
    E = m.gate_up_proj.shape[0]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 256, generator=g).bfloat16().requires_grad_()
    idx = torch.randint(0, E + 1, (6, 2), generator=g)  # id E: transformers' skipped sentinel
    w = torch.rand(6, 2, generator=g).bfloat16()
    out = m(x.view(6, 256), idx, w)  # grad enabled, weights requiring grad: a forward still runs
    wgu = moe.dequantize_blocks(m.gate_up_proj, m.gate_up_proj_scale_inv, dtype=torch.float64)
    wd = moe.dequantize_blocks(m.down_proj, m.down_proj_scale_inv, dtype=torch.float64)
    ref = loop_reference(x.detach().view(6, 256).double(), wgu, wd, torch.where(idx < E, idx, -1), w.double())
    assert out.dtype == torch.bfloat16 and out.shape == (6, 256)
    assert float((out.detach().double() - ref).norm() / ref.norm()) < 1e-2
    m.gate_up_proj.requires_grad_(False)
    m.down_proj.requires_grad_(False)
    m.gate_up_proj_scale_inv.requires_grad_(False)
    m.down_proj_scale_inv.requires_grad_(False)
    m(x.view(6, 256), idx, w).float().sum().backward()  # frozen fp8 weights: gradients reach x
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_unsupported_fp8_experts_are_named():
    m = build("deepseek_v3")
    assert moe.layers.fp8_unsupported_reason(m) is None
    static = build("deepseek_v3", activation_scheme="static")
    assert "static activation scales" in moe.layers.fp8_unsupported_reason(static)
    m.block_size = None
    assert "block_size None" in moe.layers.fp8_unsupported_reason(m)


def test_fp8_experts_with_blocks_other_than_128_are_unsupported():
    """The Triton variants take 128x128 scale blocks only: a module quantized with other blocks is
    turned down (kernelize and the "kernelhub" implementation keep its eager forward) instead of
    being bound to a layer whose every forward on a GPU raises."""
    m = build("deepseek_v3")
    m.block_size = (64, 64)
    assert "block_size (64, 64)" in moe.layers.fp8_unsupported_reason(m)
    m.block_size = [128, 128]  # a list, as a model config gives it
    assert moe.layers.fp8_unsupported_reason(m) is None


def test_fp8_layer_sees_a_block_size_list_changed_in_place():
    """The layers remember their answer per weights and block size: a block_size list (as a model
    config gives it) changed in place is a change too."""
    m = build("qwen3_moe")
    m.block_size = [128, 128]
    forward = moe.layers.MoEExpertsFP8Reference.forward.__get__(m)
    x, idx, w = torch.randn(3, 256), torch.tensor([[0, 1, 2], [1, 2, 3], [2, 3, 4]]), torch.rand(3, 3)
    assert forward(x, idx, w).shape == (3, 256)
    m.block_size[0] = 64
    with pytest.raises(ValueError, match=r"MoEExpertsFP8.forward: .*block_size \(64, 128\) is not supported"):
        forward(x, idx, w)


def test_fp8_experts_whose_scales_are_not_the_block_layout_are_unsupported():
    """transformers gives a gate_up scale at least two block rows ("room for both halves"): with
    I <= 64 that is [E, 2, ceil(H/128)] where the 128x128 blocks of [gate; up] have one row. The
    module is turned down (its eager forward runs) instead of every kernelized forward raising."""
    cfg_name, cfg_kwargs = CONFIGS["deepseek_v3"]
    cfg = getattr(transformers, cfg_name)(**{**cfg_kwargs, "moe_intermediate_size": 32})
    cls = use_experts_implementation(experts_class=fp8_integration.FP8Experts,
                                     experts_interface=fp8_integration.ALL_FP8_EXPERTS_FUNCTIONS,
                                     has_bias=False, has_gate=True)
    m = cls(cfg, block_size=(128, 128))
    assert tuple(m.gate_up_proj_scale_inv.shape) == (4, 2, 2)  # (what transformers allocates)
    reason = moe.layers.fp8_unsupported_reason(m)
    assert reason is not None and "gate_up_proj_scale_inv" in reason and "[4, 1, 2]" in reason
    assert moe.layers.fp8_unsupported_reason(build("deepseek_v3")) is None  # I = 128: the block layout
    # a layer that served the module looks again when a scale's shape changes
    m = build("deepseek_v3")
    forward = moe.layers.MoEExpertsFP8Reference.forward.__get__(m)
    x, idx, w = torch.randn(3, 256), torch.tensor([[0, 1], [1, 2], [2, 3]]), torch.rand(3, 2)
    with torch.no_grad():
        assert forward(x, idx, w).shape == (3, 256)
        m.gate_up_proj_scale_inv = torch.nn.Parameter(torch.ones(4, 3, 2), requires_grad=False)
        with pytest.raises(ValueError, match=r"MoEExpertsFP8.forward: .*`gate_up_proj_scale_inv` \[4, 3, 2\] is not"):
            forward(x, idx, w)
