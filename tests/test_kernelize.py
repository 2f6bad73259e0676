import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import fake_cuda_tensor
from kernelhub import (
    CUDAProperties,
    Device,
    LocalLayerRepository,
    Mode,
    kernelize,
    kernelize_report,
    unkernelize,
    use_kernel_forward_from_hub,
    use_kernel_mapping,
)
from kernelhub.hub import get_local_kernel
from kernelhub.matching import match_layer

TOY = Path(__file__).parent / "fixtures" / "kernels" / "toy_mlp"
CALLS = get_local_kernel(TOY).CALLS


class MLP(nn.Module):
    def __init__(self, h=8, i=12, act=None):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act_fn = act if act is not None else nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def toy(layer):
    return LocalLayerRepository(TOY, layer_name=layer)


MAPPING = {
    "SwiGLUMLP": {
        Device("cuda", properties=CUDAProperties(90, 129)): toy("ToyMLPSm90"),
        Device("cuda", properties=CUDAProperties(80, 89)): toy("ToyMLPSm80"),
        Device("cpu"): toy("ToyMLPCpu"),
    }
}


@pytest.fixture(autouse=True)
def toy_mapping():
    CALLS.clear()
    with use_kernel_mapping(MAPPING, inherit_mapping=False):
        yield


def on_fake_gpu(module: nn.Module, index: int) -> nn.Module:
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            setattr(sub, name, nn.Parameter(fake_cuda_tensor(tuple(p.shape), index), requires_grad=False))
    return module


def layers_by_module(report):
    return {e.module_name: e.layer for e in report.entries}


@pytest.mark.parametrize("current", [0, 1])
@pytest.mark.parametrize("order", ["sm80_first", "sm90_first"])
def test_modules_on_gpus_of_different_capability_get_their_own_kernel(fake_gpus, current, order):
    fake_gpus.current = current
    a, b = on_fake_gpu(MLP(), 0), on_fake_gpu(MLP(), 1)
    model = nn.Sequential(a, b) if order == "sm80_first" else nn.Sequential(b, a)
    report = kernelize_report(kernelize(model))
    by_module = {e.module_name: e for e in report.entries}
    first, second = ("0", "1") if order == "sm80_first" else ("1", "0")
    assert by_module[first].layer == "ToyMLPSm80" and by_module[first].capability == 80
    assert by_module[second].layer == "ToyMLPSm90" and by_module[second].capability == 90
    assert by_module[first].device == torch.device("cuda", 0)
    a(fake_cuda_tensor((2, 8), 0))
    b(fake_cuda_tensor((2, 8), 1))
    assert [c[0] for c in CALLS] == ["ToyMLPSm80", "ToyMLPSm90"]
    assert torch.cuda.current_device() == current


def test_explicit_device_keeps_its_index(fake_gpus):
    model = nn.Sequential(MLP())  # parameters on the CPU
    report = kernelize_report(kernelize(model, device=torch.device("cuda", 1)))
    (entry,) = report.entries
    assert entry.device == torch.device("cuda", 1)
    assert entry.capability == 90 and entry.layer == "ToyMLPSm90"
    report = kernelize_report(kernelize(model, device="cuda:0"))
    assert report.entries[0].layer == "ToyMLPSm80"


def test_index_specific_mapping_beats_agnostic_one_in_kernelize(fake_gpus):
    a, b = on_fake_gpu(MLP(), 0), on_fake_gpu(MLP(), 1)
    with use_kernel_mapping({"SwiGLUMLP": {Device("cuda", 1): toy("ToyMLPIndex1")}}):
        report = kernelize_report(kernelize(nn.Sequential(a, b)))
    assert layers_by_module(report) == {"0": "ToyMLPSm80", "1": "ToyMLPIndex1"}


def test_model_moved_after_kernelize_re_resolves(fake_gpus):
    mlp = on_fake_gpu(MLP(), 0)
    kernelize(nn.Sequential(mlp))
    mlp(fake_cuda_tensor((2, 8), 0))
    on_fake_gpu(mlp, 1)  # "moved": input and weights now on cuda:1 (sm90)
    mlp(fake_cuda_tensor((2, 8), 1))
    mlp(fake_cuda_tensor((2, 8), 0))  # and back: cached per index
    assert [c[0] for c in CALLS] == ["ToyMLPSm80", "ToyMLPSm90", "ToyMLPSm80"]


def test_cpu_model_output_equals_eager_and_unkernelize_restores():
    torch.manual_seed(0)
    model = nn.Sequential(MLP(), nn.ReLU(), MLP())
    x = torch.randn(3, 8)
    ref = model(x)
    report = kernelize_report(kernelize(model))
    assert [e.layer for e in report.entries] == ["ToyMLPCpu", "ToyMLPCpu"]
    out = model(x)
    assert [c[0] for c in CALLS] == ["ToyMLPCpu", "ToyMLPCpu"]
    torch.testing.assert_close(out, ref)
    assert unkernelize(model) == 2
    CALLS.clear()
    torch.testing.assert_close(model(x), ref)
    assert CALLS == []
    assert "forward" not in model[0].__dict__


def test_kernelize_twice_does_not_stack_wrappers():
    model = nn.Sequential(MLP())
    kernelize(model)
    kernelize(model)
    assert unkernelize(model) == 1
    assert "forward" not in model[0].__dict__


def test_training_with_layer_without_backward_falls_back_with_reason():
    with use_kernel_mapping({"SwiGLUMLP": {"cpu": toy("ToyMLPNoBackward")}}):
        report = kernelize_report(kernelize(nn.Sequential(MLP()), mode=Mode.TRAINING))
        (entry,) = report.entries
        assert entry.layer is None and "has_backward" in entry.fallback_reason
        with pytest.raises(ValueError, match="has_backward"):
            kernelize(nn.Sequential(MLP()), mode=Mode.TRAINING, use_fallback=False)
        model = kernelize(nn.Sequential(MLP()), mode=Mode.INFERENCE)
        assert kernelize_report(model).entries[0].layer == "ToyMLPNoBackward"


@pytest.mark.parametrize(
    "layer, reason",
    [("ToyMLPStateful", "stateless"), ("ToyMLPBadSignature", "does not match"), ("Missing", "no layer")],
)
def test_unusable_layers_fall_back_with_reason(layer, reason):
    with use_kernel_mapping({"SwiGLUMLP": {"cpu": toy(layer)}}):
        (entry,) = kernelize_report(kernelize(nn.Sequential(MLP()))).entries
    assert entry.layer is None and reason in entry.fallback_reason


def test_non_silu_mlp_is_reported_not_kernelized():
    model = nn.Sequential(MLP(act=nn.GELU()))
    (entry,) = kernelize_report(kernelize(model)).entries
    assert entry.layer is None and "GELU" in entry.fallback_reason
    assert "forward" not in model[0].__dict__


def test_kernel_layer_name_marks_custom_modules():
    @use_kernel_forward_from_hub("SwiGLUMLP")
    class MyBlock(MLP):
        pass

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = MyBlock(act=nn.GELU())  # matched by name, whatever its activation

    (entry,) = kernelize_report(kernelize(Holder())).entries
    assert entry.module_name == "block" and entry.layer == "ToyMLPCpu"


def test_module_without_parameters_uses_parents_device(fake_gpus):
    class Shell(nn.Module):  # no parameters of its own; kernelized by name
        kernel_layer_name = "SwiGLUMLP"

        def forward(self, x):
            return x

    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(fake_cuda_tensor((2,), 1), requires_grad=False)
            self.shell = Shell()

    with use_kernel_mapping({"SwiGLUMLP": {"cuda": toy("ToyMLPSm90")}}):
        (entry,) = kernelize_report(kernelize(Parent())).entries
    assert entry.device == torch.device("cuda", 1)


def test_no_kernel_and_no_fallback_raises(fake_gpus):
    with use_kernel_mapping({"SwiGLUMLP": {"cpu": toy("ToyMLPCpu")}}, inherit_mapping=False):
        with pytest.raises(ValueError, match="use_fallback=False"):
            kernelize(nn.Sequential(on_fake_gpu(MLP(), 0)), use_fallback=False)


def test_kernelize_rejects_bad_arguments():
    with pytest.raises(TypeError, match="`model`"):
        kernelize("not a model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`mode`"):
        kernelize(nn.Sequential(MLP()), mode="inference")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`mode`"):
        kernelize(nn.Sequential(MLP()), mode=Mode.FALLBACK)
    with pytest.raises(TypeError, match="`device`"):
        kernelize(nn.Sequential(MLP()), device=3.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`use_fallback`"):
        kernelize(nn.Sequential(MLP()), use_fallback="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="get_local_kernel: `repo_path`"):
        get_local_kernel(5)  # type: ignore[arg-type]


def test_report_renders_as_readable_table(fake_gpus):
    model = nn.Sequential(on_fake_gpu(MLP(), 0), on_fake_gpu(MLP(), 1), MLP(act=nn.GELU()))
    text = str(kernelize_report(kernelize(model)))
    lines = text.splitlines()
    assert lines[0].startswith("kernelize report: mode=Mode.INFERENCE, 2 of 3 modules kernelized")
    assert lines[1].split() == ["module", "class", "layer", "device", "sm", "kernel", "from", "/", "why", "not"]
    assert lines[3].split()[:6] == ["0", "MLP", "SwiGLUMLP", "cuda:0", "80", "ToyMLPSm80"]
    assert lines[3].split()[6].startswith("local:")
    assert lines[4].split()[:6] == ["1", "MLP", "SwiGLUMLP", "cuda:1", "90", "ToyMLPSm90"]
    assert lines[5].split()[:6] == ["2", "MLP", "SwiGLUMLP", "cpu", "-", "eager"]
    assert "act_fn is GELU" in lines[5]


class ScaledMLP(MLP):
    """The shape of a SwiGLU MLP, not its maths (FalconH1MLP scales the gate and the output)."""

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x) * 0.5) * self.up_proj(x)) * 3.0


class StepwiseMLP(MLP):
    """SwiGLU written in steps, product commuted, input named as many transformers MLPs name it."""

    def forward(self, hidden_state):
        """Docstrings are skipped."""
        up = self.up_proj(hidden_state)
        gate = self.act_fn(self.gate_proj(hidden_state))
        out = self.down_proj(up * gate)
        return out


def _kernelize_one(mlp: nn.Module):
    """(model, input, eager output, the report's entry) for a one-MLP model."""
    torch.manual_seed(0)
    model = nn.Sequential(mlp)
    x = torch.randn(3, 8)
    ref = model(x)
    (entry,) = kernelize_report(kernelize(model)).entries
    return model, x, ref, entry


class _StackedExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(2, 8, 4))
        self.down_proj = nn.Parameter(torch.zeros(2, 4, 4))


class RoutedExperts(_StackedExperts):
    def forward(self, hidden_states, top_k_index, top_k_weights):
        return hidden_states


class WrappedExperts(_StackedExperts):
    def forward(self, *args, **kwargs):  # e.g. behind a decorator without functools.wraps
        return args[0]


class PresortedExperts(_StackedExperts):
    def forward(self, hidden_states):  # Llama4TextExperts' convention: no routing passed
        return hidden_states


def test_experts_are_matched_only_when_their_forward_takes_the_routing():
    assert match_layer(RoutedExperts()).unsupported_reason is None
    assert match_layer(WrappedExperts()).unsupported_reason is None
    reason = match_layer(PresortedExperts()).unsupported_reason
    assert reason is not None and "PresortedExperts.forward(hidden_states) takes no routing" in reason
    (entry,) = kernelize_report(kernelize(PresortedExperts(), config={})).entries
    assert entry.layer is None and entry.fallback_reason == reason


def test_mlp_with_the_shape_but_other_maths_keeps_its_forward():
    model, x, ref, entry = _kernelize_one(ScaledMLP())
    assert entry.layer is None and "computes something other than" in entry.fallback_reason
    assert "forward" not in model[0].__dict__
    torch.testing.assert_close(model(x), ref)
    assert CALLS == []


def test_mlp_whose_input_has_another_name_is_kernelized_and_takes_it_by_keyword():
    model, x, ref, entry = _kernelize_one(StepwiseMLP())
    assert entry.layer == "ToyMLPCpu", entry.fallback_reason
    torch.testing.assert_close(model[0](hidden_state=x), ref)
    torch.testing.assert_close(model[0](x), ref)
    assert [c[0] for c in CALLS] == ["ToyMLPCpu", "ToyMLPCpu"]


def test_deepcopy_of_a_kernelized_model_runs_the_kernel_on_its_own_weights():
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(MLP(), nn.ReLU(), MLP())
    kernelize(model)
    x = torch.randn(3, 8)
    ref = model(x)
    clone = copy.deepcopy(model)
    CALLS.clear()
    torch.testing.assert_close(clone(x), ref)
    assert [c[0] for c in CALLS] == ["ToyMLPCpu", "ToyMLPCpu"]  # the copy is still kernelized
    with torch.no_grad():
        clone[0].down_proj.weight.mul_(2.0)  # the copy's kernel reads the copy's weights ...
    assert not torch.allclose(clone(x), ref)
    torch.testing.assert_close(model(x), ref)  # ... and the original's its own
    assert unkernelize(clone) == 2 and "forward" not in clone[0].__dict__


def test_pickled_kernelized_model_loads_and_resolves_again():
    import io

    torch.manual_seed(0)
    model = nn.Sequential(MLP())
    kernelize(model)
    x = torch.randn(3, 8)
    ref = model(x)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    CALLS.clear()
    torch.testing.assert_close(loaded(x), ref)
    assert [c[0] for c in CALLS] == ["ToyMLPCpu"]  # resolved again on its first call
    assert unkernelize(loaded) == 1
    CALLS.clear()
    torch.testing.assert_close(loaded(x), ref)
    assert CALLS == []


def test_unsupported_module_on_a_gpu_reports_that_gpus_capability(fake_gpus):
    (entry,) = kernelize_report(kernelize(nn.Sequential(on_fake_gpu(MLP(act=nn.GELU()), 1)))).entries
    assert entry.layer is None and "GELU" in entry.fallback_reason
    assert entry.device == torch.device("cuda", 1) and entry.capability == 90


def test_a_config_entry_for_a_layer_nothing_knows_is_warned_about():
    model = nn.Sequential(MLP())
    typo = r"names layer\(s\) \['SwiGLUMlp'\] that neither .*known layers: \['SwiGLUMLP'\]"
    with pytest.warns(UserWarning, match=typo):
        kernelize(model, config={"layers": {"SwiGLUMlp": {"layer": "ToyMLPSm80"}}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (entry,) = kernelize_report(kernelize(model, config={"layers": {"SwiGLUMLP": {"layer": "ToyMLPSm80"}}})).entries
    assert entry.layer == "ToyMLPSm80"


class _OffloadHook:
    """Hugging Face accelerate's offloading hook (AlignDevicesHook with offload=True), reduced to
    the protocol kernelize relies on: the module's weights stay on "meta" between calls, and
    `pre_forward` puts them on `execution_device` for the duration of one forward."""

    no_grad = False

    def __init__(self, module: nn.Module, device: torch.device):
        self.execution_device = device
        self.weights = {n: p.detach().clone() for n, p in module.named_parameters()}
        self._place(module, lambda w: w.to("meta"))

    def _place(self, module, how):
        for name, w in self.weights.items():
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner)._parameters[leaf] = nn.Parameter(how(w), requires_grad=False)

    def pre_forward(self, module, *args, **kwargs):
        self._place(module, lambda w: w.to(self.execution_device))
        return args, kwargs

    def post_forward(self, module, output):
        self._place(module, lambda w: w.to("meta"))
        return output


def _add_offload_hook(module: nn.Module) -> None:
    """As accelerate's add_hook_to_module does it."""
    import functools

    module._hf_hook = _OffloadHook(module, torch.device("cpu"))
    module._old_forward = module.forward

    def new_forward(module, *args, **kwargs):
        args, kwargs = module._hf_hook.pre_forward(module, *args, **kwargs)
        return module._hf_hook.post_forward(module, module._old_forward(*args, **kwargs))

    module.forward = functools.update_wrapper(functools.partial(new_forward, module), module._old_forward)


def test_an_offloaded_module_is_kernelized_inside_its_accelerate_hook():
    torch.manual_seed(0)
    mlp = MLP()
    x = torch.randn(3, 8)
    ref = mlp(x)
    _add_offload_hook(mlp)  # as accelerate hooks a module with parameters of its own (experts)
    hooked_forward = mlp.forward
    assert mlp.gate_proj.weight.device.type == "meta"
    torch.testing.assert_close(mlp(x), ref)
    (entry,) = kernelize_report(kernelize(nn.Sequential(mlp))).entries
    # resolved for the hook's execution device, not the weights' "meta"; bound under the hook
    assert entry.device == torch.device("cpu") and entry.layer == "ToyMLPCpu", entry.fallback_reason
    assert mlp.forward is hooked_forward
    torch.testing.assert_close(mlp(x), ref)
    assert [c[0] for c in CALLS] == ["ToyMLPCpu"]
    assert mlp.gate_proj.weight.device.type == "meta"  # the hook offloaded again after the kernel
    assert unkernelize(mlp) == 1 and mlp.forward is hooked_forward
    assert mlp._old_forward == MLP.forward.__get__(mlp)  # the module's own forward, under the hook
    CALLS.clear()
    torch.testing.assert_close(mlp(x), ref)
    assert CALLS == []


def test_a_module_whose_offloaded_layers_are_hooked_resolves_for_their_execution_device():
    torch.manual_seed(0)
    mlp = MLP()
    x = torch.randn(3, 8)
    ref = mlp(x)
    for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):  # as accelerate hooks a Llama MLP
        _add_offload_hook(linear)
    (entry,) = kernelize_report(kernelize(nn.Sequential(mlp))).entries
    assert entry.device == torch.device("cpu") and entry.layer == "ToyMLPCpu", entry.fallback_reason
    torch.testing.assert_close(mlp(x), ref)
    assert [c[0] for c in CALLS] == ["ToyMLPCpu"]


def test_unkernelize_after_an_accelerate_hook_added_later_keeps_the_hook_working():
    """kernelize binds `forward`; a hook added afterwards keeps that binding as `_old_forward` and
    calls it: unkernelize must put the module's own forward there, not delete the attribute."""
    torch.manual_seed(0)
    mlp = MLP()
    x = torch.randn(3, 8)
    ref = mlp(x)
    kernelize(nn.Sequential(mlp))
    _add_offload_hook(mlp)
    torch.testing.assert_close(mlp(x), ref)
    assert unkernelize(mlp) == 1
    assert mlp._old_forward == MLP.forward.__get__(mlp)
    CALLS.clear()
    torch.testing.assert_close(mlp(x), ref)
    assert CALLS == []


def test_a_kernelize_that_raises_leaves_every_forward_as_it_was(fake_gpus):
    """use_fallback=False raising on a later module: the modules before it keep what they had (here
    an earlier kernelize's bindings), so the model is not left half-kernelized."""
    first, second = MLP(), on_fake_gpu(MLP(), 0)
    model = nn.Sequential(first, second)
    kernelize(model)  # the CPU module bound, the fake-GPU one too (toy mapping)
    before = (first.__dict__.get("forward"), second.__dict__.get("forward"))
    assert all(b is not None for b in before)
    with use_kernel_mapping({"SwiGLUMLP": {"cpu": toy("ToyMLPCpu")}}, inherit_mapping=False):
        with pytest.raises(ValueError, match="use_fallback=False"):
            kernelize(model, use_fallback=False)  # first binds, second has no kernel: raises
    assert (first.__dict__.get("forward"), second.__dict__.get("forward")) == before
    fresh = nn.Sequential(MLP(), on_fake_gpu(MLP(), 0))
    with use_kernel_mapping({"SwiGLUMLP": {"cpu": toy("ToyMLPCpu")}}, inherit_mapping=False):
        with pytest.raises(ValueError, match="use_fallback=False"):
            kernelize(fresh, use_fallback=False)
    assert "forward" not in fresh[0].__dict__ and "forward" not in fresh[1].__dict__


def test_a_cpu_device_with_an_index_is_the_cpu():
    """CPU tensors are on "cpu", never "cpu:0": kernelize(device="cpu:0") resolves for the CPU (a
    binding for "cpu:0" would never match its inputs and re-resolve on every call)."""
    (entry,) = kernelize_report(kernelize(nn.Sequential(MLP()), device="cpu:0")).entries
    assert entry.device == torch.device("cpu") and entry.layer == "ToyMLPCpu"


def test_mapping_mode_keys_that_no_request_reaches_are_refused():
    for mode in (Mode.TORCH_COMPILE, Mode(Mode.INFERENCE.value | Mode.TRAINING.value)):
        with pytest.raises(ValueError, match="never looked up"):
            with use_kernel_mapping({"SwiGLUMLP": {"cpu": {mode: toy("ToyMLPCpu")}}}):
                pass


def test_a_binding_pickled_before_its_module_loads_with_the_modules_own_forward():
    """The original forward is pickled by name: as a bound method it would be re-read with
    getattr(module, "forward") on load, which yields the binding itself when the module's state was
    restored first (the binding pickled before its module), a loop instead of the eager forward."""
    import pickle

    torch.manual_seed(0)
    mlp = MLP()
    x = torch.randn(3, 8)
    ref = mlp(x)
    kernelize(nn.Sequential(mlp))
    for objs in ((mlp.forward, mlp), (mlp, mlp.forward)):
        loaded = pickle.loads(pickle.dumps(objs))
        binding, module = (loaded[0], loaded[1]) if objs[0] is mlp.forward else (loaded[1], loaded[0])
        assert module.forward is binding and binding.original.__func__ is MLP.forward
        torch.testing.assert_close(module(x), ref)
        assert unkernelize(module) == 1
        torch.testing.assert_close(module(x), ref)
