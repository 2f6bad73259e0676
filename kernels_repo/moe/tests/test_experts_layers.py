"""The MoEExperts layers and the transformers experts implementation on transformers' *Experts modules.

CPU: the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by the root conftest).
"""

from __future__ import annotations

import copy
import importlib
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _experts_helpers import (
    MODELS,
    build_experts,
    moe,
    restore_kernelhub,
)


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
    assert sorted(meta["layers"]) == sorted(["MoEExperts", "MoEExpertsSm90", "MoEExpertsSm80", "MoEExpertsReference",
                                             "MoEExpertsFP8", "MoEExpertsFP8Sm90", "MoEExpertsFP8Sm80",
                                             "MoEExpertsFP8Reference"])
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
        restore_kernelhub(ExpertsInterface, previous)
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
        restore_kernelhub(ExpertsInterface, previous)
    torch.testing.assert_close(out_f.logits, out_e.logits, rtol=1e-4, atol=1e-5)
    for (name, pe), pf in zip(eager.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(pf.grad, pe.grad, rtol=1e-4, atol=1e-5, msg=name)




LAYERS = ["MoEExperts", "MoEExpertsSm80", "MoEExpertsSm90", "MoEExpertsReference"]


def _layer_forwards(module):
    """(the name its errors start with, forward) of every layer class bound to `module` (they share
    MoEExperts.forward's checks), and of the transformers implementation."""
    forwards = [("MoEExperts.forward", lambda h, i, w, name=name: getattr(moe.layers, name).forward(module, h, i, w))
                for name in LAYERS]
    return [*forwards, ("experts_forward", lambda h, i, w: moe.experts_forward(module, h, i, w))]


def test_layers_take_batched_and_flat_arguments_alike():
    """[B, S, H] hidden states with [B, S, K] or [B*S, K] routing give the [T, H] call's rows in
    [B, S, H]; a 2-D call (what transformers' MoE blocks pass, used without views) returns [T, H]."""
    module = build_experts("qwen3_moe")
    E = module.gate_up_proj.shape[0]
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 3, 32, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(6)]).view(2, 3, 2)
    w = torch.rand(2, 3, 2, generator=g)
    want = module.forward(hidden.view(6, 32), idx.view(6, 2), w.view(6, 2))
    for name, forward in _layer_forwards(module):
        flat = forward(hidden.view(6, 32), idx.view(6, 2), w.view(6, 2))
        assert flat.shape == (6, 32), name
        torch.testing.assert_close(flat, want, rtol=1e-4, atol=1e-5, msg=name)
        for i, wt in ((idx, w), (idx.view(6, 2), w.view(6, 2)), (idx, w.view(6, 2))):
            out = forward(hidden, i, wt)
            assert out.shape == (2, 3, 32), name
            torch.testing.assert_close(out.view(6, 32), want, rtol=1e-4, atol=1e-5, msg=name)


def test_layers_refuse_routing_with_another_row_count_naming_the_argument():
    module = build_experts("qwen3_moe")
    hidden = torch.randn(2, 3, 32)
    idx, w = torch.zeros(2, 3, 2, dtype=torch.long), torch.rand(2, 3, 2)
    for name, forward in _layer_forwards(module):
        rows = rf"{name}: `top_k_index` must have one row per token of `hidden_states` \(6\)"
        with pytest.raises(ValueError, match=rows):
            forward(hidden, idx[:, :2], w)
        with pytest.raises(ValueError, match=rf"{name}: `top_k_weights` must have the shape of `top_k_index`"):
            forward(hidden, idx, w[:1])
        with pytest.raises(ValueError, match=rf"{name}: `top_k_index` must be \[\.\.\., K\]"):
            forward(hidden, torch.tensor(0), w)


def test_layers_refuse_a_0d_hidden_state_naming_the_argument():
    module = build_experts("qwen3_moe")
    for name, forward in _layer_forwards(module):
        with pytest.raises(ValueError, match=rf"{name}: `hidden_states` must be \[\.\.\., H\], got a 0-d tensor"):
            forward(torch.tensor(1.0), torch.zeros(1, 2, dtype=torch.long), torch.rand(1, 2))


def test_layers_refuse_integer_hidden_states_instead_of_casting_them():
    module = build_experts("qwen3_moe")
    hidden = torch.randint(0, 5, (3, 32))
    idx, w = torch.zeros(3, 2, dtype=torch.long), torch.rand(3, 2)
    for name, forward in _layer_forwards(module):
        with pytest.raises(TypeError, match=rf"{name}: `hidden_states` must be floating point, got torch.int64"):
            forward(hidden, idx, w)
        with pytest.raises(TypeError, match=rf"{name}: `top_k_index` must be a torch.Tensor, got list"):
            forward(hidden.float(), idx.tolist(), w)


def test_layers_refuse_hidden_states_the_module_cannot_take_naming_the_argument():
    module = build_experts("qwen3_moe")
    idx, w = torch.zeros(3, 2, dtype=torch.long), torch.rand(3, 2)
    for name, forward in _layer_forwards(module):
        with pytest.raises(ValueError, match=rf"{name}: `hidden_states` must be \[\.\.\., H=32\]"):
            forward(torch.randn(3, 16), idx, w)
        with pytest.raises(TypeError, match=rf"{name}: `top_k_index` must be int32 or int64, got torch.float32"):
            forward(torch.randn(3, 32), idx.float(), w)
        with pytest.raises(ValueError, match=rf"{name}: `top_k_index` must be on cpu like `hidden_states`, got meta"):
            forward(torch.randn(3, 32), idx.to("meta"), w)
