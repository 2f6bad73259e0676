"""kernelize on real transformers v5 models built from small configs."""

import pytest
import torch
import transformers

import kernelhub
from kernelhub.matching import match_layer

TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=64)


def tiny_model(kind: str) -> torch.nn.Module:
    if kind == "llama":
        cfg = transformers.LlamaConfig(intermediate_size=48, **TINY)
        return transformers.LlamaForCausalLM(cfg)
    if kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                          num_experts_per_tok=2, **TINY)
        return transformers.Qwen3MoeForCausalLM(cfg)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, **TINY)
        return transformers.MixtralForCausalLM(cfg)
    if kind == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=24,
                                          shared_expert_intermediate_size=40, num_experts=4,
                                          num_experts_per_tok=2, **TINY)
        return transformers.Qwen2MoeForCausalLM(cfg)
    if kind == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            intermediate_size=48, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
            q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            **{**TINY, "num_key_value_heads": 2})
        return transformers.DeepseekV3ForCausalLM(cfg)
    if kind == "olmoe":
        cfg = transformers.OlmoeConfig(intermediate_size=24, num_experts=4, num_experts_per_tok=2, **TINY)
        return transformers.OlmoeForCausalLM(cfg)
    raise ValueError(kind)


# (model, number of *Experts modules, number of SiLU-gated MLPs incl. shared experts)
EXPECTED = {
    "llama": (0, 2),
    "qwen3_moe": (2, 0),
    "mixtral": (2, 0),
    "qwen2_moe": (2, 2),
    "deepseek_v3": (1, 2),
    "olmoe": (2, 0),
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_transformers_modules_are_matched_by_class(kind):
    model = tiny_model(kind)
    found = {"MoEExperts": 0, "SwiGLUMLP": 0}
    for module in model.modules():
        m = match_layer(module)
        if m is not None:
            assert m.unsupported_reason is None, (type(module).__name__, m.unsupported_reason)
            found[m.layer_name] += 1
    assert (found["MoEExperts"], found["SwiGLUMLP"]) == EXPECTED[kind]


def test_experts_implementation_kernelhub_is_registered():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert "kernelhub" in ALL_EXPERTS_FUNCTIONS
    cfg = transformers.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                      num_experts_per_tok=2, **TINY)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    model.set_experts_implementation("kernelhub")
    assert model.config._experts_implementation == "kernelhub"
    assert kernelhub.__name__ == "kernelhub"


def _triton_on_cpu_mapping():
    """Map the CPU to the sm80 Triton layers, which run in the Triton interpreter in these tests."""
    root = kernelhub.default_mapping.bundled_kernels_dir()
    return {
        "SwiGLUMLP": {"cpu": kernelhub.LocalLayerRepository(root / "swiglu", layer_name="SwiGLUMLPSm80")},
        "MoEExperts": {"cpu": kernelhub.LocalLayerRepository(root / "moe", layer_name="MoEExpertsSm80")},
    }


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_kernelized_logits_equal_eager(kind):
    torch.manual_seed(0)
    model = tiny_model(kind).eval()
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    with kernelhub.use_kernel_mapping(_triton_on_cpu_mapping()):
        report = kernelhub.kernelize_report(kernelhub.kernelize(model, config={}))
    assert len(report.kernelized) == sum(EXPECTED[kind]) and not report.fallbacks, str(report)
    assert all(e.layer.endswith("Sm80") for e in report.entries)
    with torch.no_grad():
        out = model(input_ids=ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3", "llama"])
def test_training_loss_and_every_gradient_equal_eager(kind):
    torch.manual_seed(0)
    model = tiny_model(kind).train()
    ids = torch.randint(0, 64, (2, 5))
    ref = _loss_and_grads(model, ids)
    with kernelhub.use_kernel_mapping(_triton_on_cpu_mapping()):
        report = kernelhub.kernelize_report(kernelhub.kernelize(model, mode=kernelhub.Mode.TRAINING, config={}))
    assert not report.fallbacks
    _assert_same_loss_and_grads(_loss_and_grads(model, ids), ref)


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_loss_and_grads(got: tuple[torch.Tensor, dict], want: tuple[torch.Tensor, dict]) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert got[1].keys() == want[1].keys()
    for name, g in got[1].items():
        torch.testing.assert_close(g, want[1][name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_compiled_kernelized_model_matches_the_uncompiled_one(kind):
    """kernelize(mode=TRAINING | TORCH_COMPILE) binds the kernels (their layers declare
    can_torch_compile), and torch.compile traces the whole model without a graph break: the experts
    and MLPs are custom ops. Loss, every gradient and inference logits equal the eager ones."""
    torch.manual_seed(0)
    model = tiny_model(kind).train()
    ids = torch.randint(0, 64, (2, 5))
    with kernelhub.use_kernel_mapping(_triton_on_cpu_mapping()):
        model = kernelhub.kernelize(model, mode=kernelhub.Mode.TRAINING | kernelhub.Mode.TORCH_COMPILE, config={})
        report = kernelhub.kernelize_report(model)
    assert len(report.kernelized) == sum(EXPECTED[kind]) and not report.fallbacks, str(report)

    def loss_and_grads(m):
        model.zero_grad()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref_grads = loss_and_grads(model)
    compiled = torch.compile(model, backend="aot_eager")
    loss, grads = loss_and_grads(compiled)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-6, atol=1e-6)
    assert torch._dynamo.explain(model)(input_ids=ids).graph_break_count == 0


def test_gpt_oss_experts_fall_back_with_the_reason():
    cfg = transformers.GptOssConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                    head_dim=16, **{**TINY, "num_attention_heads": 2})
    model = transformers.GptOssForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 4))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    report = kernelhub.kernelize_report(kernelhub.kernelize(model, config={}))
    experts = [e for e in report.entries if e.layer_name == "MoEExperts"]
    assert len(experts) == 2
    for e in experts:
        assert e.layer is None and "transposed" in e.fallback_reason
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref)


def test_from_pretrained_with_experts_implementation_kernelhub(tmp_path):
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe").eval()
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="kernelhub").eval()
    assert loaded.config._experts_implementation == "kernelhub"
    calls = []
    from kernelhub.integrations import transformers as integration

    original = integration.kernelhub_experts_forward

    def spy(self, *args):
        calls.append(type(self).__name__)
        return original(self, *args)

    transformers.integrations.moe.ExpertsInterface.register("kernelhub", spy)
    try:
        with torch.no_grad():
            out = loaded(input_ids=ids).logits
    finally:
        integration.register_experts_implementation()
    assert calls == ["Qwen3MoeExperts", "Qwen3MoeExperts"]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_llama4_mlps_are_kernelized_and_its_experts_fall_back_with_the_reason():
    """Llama4TextMLP keeps its activation as `activation_fn` (not `act_fn`); Llama4TextExperts takes
    hidden states pre-sorted per expert and no routing, so MoEExperts must not replace it."""
    cfg = transformers.Llama4TextConfig(
        intermediate_size=48, intermediate_size_mlp=40, head_dim=16, num_local_experts=4,
        num_experts_per_tok=1, moe_layers=[1], no_rope_layers=[1, 1], attention_chunk_size=64, **TINY)
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(cfg).train()
    ids = torch.randint(0, 64, (2, 5))
    ref = _loss_and_grads(model, ids)
    with kernelhub.use_kernel_mapping(_triton_on_cpu_mapping()):
        report = kernelhub.kernelize_report(kernelhub.kernelize(model, mode=kernelhub.Mode.TRAINING, config={}))
    kinds = {e.module_class: e for e in report.entries}
    assert [e.layer for e in report.entries if e.module_class == "Llama4TextMLP"] == ["SwiGLUMLPSm80"] * 2
    assert kinds["Llama4TextExperts"].layer is None
    assert "Llama4TextExperts.forward(hidden_states) takes no routing" in kinds["Llama4TextExperts"].fallback_reason
    _assert_same_loss_and_grads(_loss_and_grads(model, ids), ref)


def _mlp_with_other_maths(name: str) -> torch.nn.Module:
    from types import SimpleNamespace

    base = dict(hidden_size=16, intermediate_size=24, hidden_act="silu", mlp_bias=False)
    if name == "FalconH1MLP":  # gate and output multipliers
        from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1MLP

        return FalconH1MLP(SimpleNamespace(**base, mlp_multipliers=(0.5, 3.0)))
    if name == "Glm5NextTextMLP":  # gate and up clamped
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextMLP

        return Glm5NextTextMLP(SimpleNamespace(**base, swiglu_limit=0.05))
    if name == "DeepseekV4MLP":  # gate and up clamped
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4MLP

        return DeepseekV4MLP(SimpleNamespace(**base, swiglu_limit=0.05))
    raise ValueError(name)


@pytest.mark.parametrize("name", ["FalconH1MLP", "Glm5NextTextMLP", "DeepseekV4MLP"])
def test_transformers_mlps_with_the_shape_but_other_maths_keep_their_forward(name):
    torch.manual_seed(0)
    mlp = _mlp_with_other_maths(name).eval()
    x = torch.randn(3, 16) * 4
    with torch.no_grad():
        ref = mlp(x)
    (entry,) = kernelhub.kernelize_report(kernelhub.kernelize(mlp, config={})).entries
    assert entry.layer is None and f"{name}.forward computes something other than" in entry.fallback_reason
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), ref)


def test_transformers_mlp_with_input_named_hidden_state_is_kernelized():
    from types import SimpleNamespace

    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLMLP

    torch.manual_seed(0)
    mlp = Qwen2_5_VLMLP(SimpleNamespace(hidden_size=16, intermediate_size=24, hidden_act="silu"), bias=True).eval()
    x = torch.randn(3, 16)
    with torch.no_grad():
        ref = mlp(x)
        (entry,) = kernelhub.kernelize_report(kernelhub.kernelize(mlp, config={})).entries
        assert entry.layer == "SwiGLUMLPReference", entry.fallback_reason
        torch.testing.assert_close(mlp(hidden_state=x), ref)


SPY_CALLS: list = []  # outside the layer class: a kernel layer has no members but forward and its flags


class _SpyExperts(torch.nn.Module):
    """An MoEExperts layer that records its calls (in SPY_CALLS) and runs the host's eager forward."""

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states, top_k_index, top_k_weights):
        SPY_CALLS.append(type(self).__name__)
        from kernelhub.integrations.transformers import _eager_forward

        return _eager_forward(self)(self, hidden_states, top_k_index, top_k_weights)


class _Repo:
    def __init__(self, layer=None, error=None):
        self.layer_name, self.layer, self.error = "MoEExperts", layer, error

    def load(self):
        if self.error is not None:
            raise self.error
        return self.layer


def _loaded_with_kernelhub_experts(tmp_path):
    torch.manual_seed(0)
    tiny_model("qwen3_moe").save_pretrained(tmp_path)
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="kernelhub").eval()


def test_experts_implementation_follows_the_mapping_in_effect(tmp_path):
    model = _loaded_with_kernelhub_experts(tmp_path)
    ids = torch.randint(0, 64, (1, 4))
    SPY_CALLS.clear()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        assert SPY_CALLS == []
        with kernelhub.use_kernel_mapping({"MoEExperts": {"cpu": _Repo(_SpyExperts)}}):
            torch.testing.assert_close(model(input_ids=ids).logits, ref)
        assert SPY_CALLS == ["Qwen3MoeExperts"] * 2
        model(input_ids=ids)  # the block has ended: its kernel is no longer used
    assert SPY_CALLS == ["Qwen3MoeExperts"] * 2


def test_experts_implementation_under_torch_compile_has_no_graph_break(tmp_path):
    """After an eager call has resolved each experts class, torch.compile traces the model without a
    graph break (the resolution is not redone while tracing) and the kernel's custom op is in the
    graph; the logits equal the eager kernelized ones."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    model = _loaded_with_kernelhub_experts(tmp_path)
    ids = torch.randint(0, 64, (1, 4))
    ops: list[str] = []

    def keep(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    with torch.no_grad(), kernelhub.use_kernel_mapping(_triton_on_cpu_mapping()):
        ref = model(input_ids=ids).logits
        assert torch._dynamo.explain(model)(input_ids=ids).graph_break_count == 0
        out = torch.compile(model, backend=aot_autograd(fw_compiler=keep))(input_ids=ids).logits
    assert sum(op.endswith("fused_experts.default") for op in ops) == 2, ops  # both layers' experts
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_experts_implementation_runs_eager_with_a_warning_when_the_kernel_cannot_load(tmp_path):
    model = _loaded_with_kernelhub_experts(tmp_path)
    ids = torch.randint(0, 64, (1, 4))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        broken = {kernelhub.Mode.INFERENCE: _Repo(error=OSError("hub unreachable"))}
        with kernelhub.use_kernel_mapping({"MoEExperts": {"cpu": broken}}):
            with pytest.warns(RuntimeWarning, match="runs eager: could not load .*hub unreachable"):
                out = model(input_ids=ids).logits
    torch.testing.assert_close(out, ref)


def test_experts_implementation_applies_the_config_pins(tmp_path, monkeypatch):
    from kernelhub.integrations import transformers as integration

    model = _loaded_with_kernelhub_experts(tmp_path / "model")
    experts = next(m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts")
    (tmp_path / "kernelhub.toml").write_text('[layers.MoEExperts]\nlayer = "MoEExpertsSm80"\n')
    monkeypatch.chdir(tmp_path)
    integration._cache.clear()  # the config is read when a (class, device, mode) is first resolved
    forward = integration._layer_for(experts, torch.device("cpu"), kernelhub.Mode.INFERENCE)
    assert forward.__qualname__ == "MoEExpertsSm80.forward"
    monkeypatch.chdir(tmp_path / "model")
    integration._cache.clear()
    forward = integration._layer_for(experts, torch.device("cpu"), kernelhub.Mode.INFERENCE)
    assert forward.__qualname__ == "MoEExpertsReference.forward"


@pytest.mark.parametrize("kind", ["qwen3_moe", "llama"])
def test_kernelize_a_model_offloaded_by_accelerate(kind):
    """accelerate's cpu_offload keeps the weights on "meta" and loads them in a hook around each
    module's forward: kernelize resolves for the hook's execution device and runs inside the hook.
    (accelerate is not among CI's pins: this runs where it is installed; the hook protocol itself
    is tested without it in tests/test_kernelize.py.)"""
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = tiny_model(kind).eval()
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    with kernelhub.use_kernel_mapping(_triton_on_cpu_mapping()):
        report = kernelhub.kernelize_report(kernelhub.kernelize(model, config={}))
    assert len(report.kernelized) == sum(EXPECTED[kind]) and not report.fallbacks, str(report)
    assert {e.device for e in report.entries} == {torch.device("cpu")}
    with torch.no_grad():
        out = model(input_ids=ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_experts_implementation_checks_each_module_not_only_the_first_of_its_class(tmp_path):
    from kernelhub.integrations import transformers as integration

    model = _loaded_with_kernelhub_experts(tmp_path)
    first, second = (m for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts")
    second.act_fn = torch.nn.GELU()  # this one the SwiGLU kernel cannot serve
    integration._cache.clear()
    cpu, mode = torch.device("cpu"), kernelhub.Mode.INFERENCE
    assert integration._layer_for(first, cpu, mode) is not None  # resolved for the class with `first`
    assert integration._layer_for(second, cpu, mode) is None  # ... and still checked for `second`
    torch.manual_seed(0)
    h = torch.randn(5, first.gate_up_proj.shape[2])
    idx = torch.stack([torch.randperm(first.gate_up_proj.shape[0])[:2] for _ in range(5)])
    w = torch.rand(5, 2)
    with torch.no_grad():
        got = integration.kernelhub_experts_forward(second, h, idx, w)
        torch.testing.assert_close(got, integration._eager_forward(second)(second, h, idx, w))


def test_kernelhub_is_the_fp8_experts_implementation_too():
    """transformers' FP8Experts (fp8 checkpoints) have their own experts interface: "kernelhub"
    there runs the bundled moe kernel's fp8 path, also when that module is imported after kernelhub."""
    import subprocess
    import sys

    from transformers.integrations import finegrained_fp8 as fp8
    from transformers.integrations.moe import use_experts_implementation

    from kernelhub.integrations.transformers import kernelhub_fp8_experts_forward

    assert fp8.ALL_FP8_EXPERTS_FUNCTIONS.get("kernelhub") is kernelhub_fp8_experts_forward
    code = ("import kernelhub, sys; assert 'transformers.integrations.finegrained_fp8' not in sys.modules; "
            "from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS as f; "
            "assert f.get('kernelhub').__name__ == 'kernelhub_fp8_experts_forward'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)

    moe = kernelhub.get_local_kernel(kernelhub.default_mapping.bundled_kernels_dir() / "moe")
    cfg = transformers.Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=4,
                                      num_experts_per_tok=2)
    cls = use_experts_implementation(experts_class=fp8.FP8Experts, experts_interface=fp8.ALL_FP8_EXPERTS_FUNCTIONS,
                                     has_bias=False, has_gate=True)
    m = cls(cfg, block_size=(128, 128)).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    for name in ("gate_up_proj", "down_proj"):
        q, s = moe.quantize_blocks(torch.randn(getattr(m, name).shape, generator=g) / 16)
        getattr(m, name).data, getattr(m, name + "_scale_inv").data = q, s
    m.config._experts_implementation = "kernelhub"
    x, w = torch.randn(5, 256, generator=g), torch.rand(5, 2, generator=g)
    idx = torch.randint(0, 4, (5, 2), generator=g)
    want = moe.fused_experts_fp8_reference(x, m.gate_up_proj, m.down_proj, idx, w,
                                           gate_up_proj_scale_inv=m.gate_up_proj_scale_inv,
                                           down_proj_scale_inv=m.down_proj_scale_inv)
    torch.testing.assert_close(m(x, idx, w), want)
