"""kernelhub as a drop-in for Hugging Face `kernels`: kernelize's return value and report, its
device and mode rules, layer validation, function layers and the `kernels` spellings of names."""

from __future__ import annotations

import copy
import pickle
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernelhub
from kernelhub import (
    CUDAProperties,
    Device,
    LocalFuncRepository,
    LocalLayerRepository,
    Mode,
    ROCMProperties,
    ROCmProperties,
    get_kernel_mapping,
    kernelize,
    kernelize_report,
    register_kernel_mapping,
    unkernelize,
    use_kernel_forward_from_hub,
    use_kernel_mapping,
    use_kernelized_func,
)

TOY = Path(__file__).parent / "fixtures" / "kernels" / "toy_mlp"


class MLP(nn.Module):
    def __init__(self, h=8, i=12):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@use_kernel_forward_from_hub("Double")
class Double(nn.Module):
    def forward(self, x):
        return x * 2


def _kernel(tmp_path: Path, layers: str, name: str = "dropin_kernel") -> Path:
    """A local kernel repository whose `layers` module is `layers` (and `triple(x)` a function)."""
    pkg = tmp_path / name / "build" / "torch-universal" / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import layers\n\n\ndef triple(x):\n    return x * 3\n")
    (pkg / "layers.py").write_text("from torch import nn\n\n\n" + textwrap.dedent(layers))
    (pkg / "metadata.json").write_text("{}")
    return tmp_path / name


_TRIPLE = """
class Triple(nn.Module):
    has_backward = True
    can_torch_compile = True

    def forward(self, x):
        return x * 3


class TripleNoBackward(nn.Module):
    has_backward = False

    def forward(self, x):
        return x * 3


class TripleImplicitBackward(nn.Module):
    def forward(self, x):
        return x * 3


class TripleWithHelper(nn.Module):
    has_backward = True

    def helper(self, x):
        return x * 3

    def forward(self, x):
        return self.helper(x)
"""


# -- kernelize returns the model; the report is kept per model -----------------------------------


def test_kernelize_returns_the_model_and_kernelize_report_gives_its_report(tmp_path):
    model = nn.Sequential(Double())
    with use_kernel_mapping({"Double": {"cpu": LocalLayerRepository(_kernel(tmp_path, _TRIPLE), layer_name="Triple")}}):
        assert kernelize(model, mode=Mode.INFERENCE, device="cpu") is model
    (entry,) = kernelize_report(model).entries
    assert (entry.module_name, entry.layer) == ("0", "Triple")
    assert model(torch.ones(2)).tolist() == [3.0, 3.0]
    with pytest.warns(UserWarning, match="No kernel mapping found for layer `Double`"):
        kernelize(model, mode=Mode.INFERENCE, device="cpu")  # Double is not mapped now: the new report says so
    (entry,) = kernelize_report(model).entries
    assert entry.layer is None and "no kernel mapping" in entry.fallback_reason


def test_kernelize_report_of_a_model_never_kernelized_is_a_value_error():
    with pytest.raises(ValueError, match="kernelize_report: `model` .* has not been kernelized"):
        kernelize_report(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="kernelize_report: `model` must be a torch.nn.Module"):
        kernelize_report("model")  # type: ignore[arg-type]


def test_the_report_leaves_state_dict_pickle_and_deepcopy_alone():
    model = nn.Sequential(MLP())
    keys = list(model.state_dict())
    kernelize(model)
    assert list(model.state_dict()) == keys
    assert not any("report" in k.lower() for k in vars(model))
    loaded = pickle.loads(pickle.dumps(model))
    copied = copy.deepcopy(model)
    x = torch.randn(2, 8)
    torch.testing.assert_close(loaded(x), model(x))
    torch.testing.assert_close(copied(x), model(x))
    assert len(kernelize_report(model).entries) == 1


def test_verbose_prints_the_report(capsys):
    model = kernelize(nn.Sequential(MLP()), verbose=True)
    out = capsys.readouterr().out
    assert out.strip() == str(kernelize_report(model)).strip()
    assert "1 of 1 modules kernelized" in out
    with pytest.raises(TypeError, match="kernelize: `verbose` must be True or False"):
        kernelize(model, verbose="yes")  # type: ignore[arg-type]


def test_mode_is_taken_as_kernels_passes_it_and_defaults_to_inference():
    model = nn.Sequential(MLP())
    assert kernelize(model) is model
    assert kernelize_report(model).mode == Mode.INFERENCE
    kernelize(model, mode=Mode.TRAINING | Mode.TORCH_COMPILE)
    assert kernelize_report(model).mode == Mode.TRAINING | Mode.TORCH_COMPILE


# -- a GPU device asked of a torch without CUDA ----------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="about a torch that cannot see a CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 5, torch.device("cuda")])
def test_a_cuda_device_without_cuda_keeps_the_forward(device):
    @use_kernel_forward_from_hub("NotMappedAnywhere")
    class Layer(nn.Module):
        def forward(self, x):
            return x + 1

    layer = Layer()
    with pytest.warns(UserWarning, match="No kernel mapping found for layer `NotMappedAnywhere`"):
        assert kernelize(layer, device=device, mode=Mode.INFERENCE) is layer
    assert layer(torch.zeros(1)).item() == 1.0
    # mapped for cuda: the capability cannot be read here, so nothing is bound (no AssertionError)
    with use_kernel_mapping({"SwiGLUMLP": {"cuda": LocalLayerRepository(TOY, layer_name="ToyMLPSm80")}}):
        model = kernelize(nn.Sequential(MLP()), device=device)
    (entry,) = kernelize_report(model).entries
    assert entry.layer is None and "cannot be read here" in entry.fallback_reason


# -- modes: has_backward as in kernels -------------------------------------------------------------


def test_a_layer_without_backward_registered_for_training_is_a_value_error(tmp_path):
    repo = LocalLayerRepository(_kernel(tmp_path, _TRIPLE), layer_name="TripleNoBackward")
    model = nn.Sequential(Double())
    with use_kernel_mapping({"Double": {"cpu": {Mode.TRAINING: repo}}}):
        with pytest.raises(ValueError, match="does not support backward"):
            kernelize(model, mode=Mode.TRAINING, device="cpu")
    assert "forward" not in model[0].__dict__  # nothing half-kernelized
    # registered for every mode (FALLBACK), TRAINING falls back to the module's forward instead
    with use_kernel_mapping({"Double": {"cpu": repo}}):
        kernelize(model, mode=Mode.TRAINING, device="cpu")
        assert kernelize_report(model).entries[0].layer is None
        kernelize(model, mode=Mode.INFERENCE, device="cpu")
        assert kernelize_report(model).entries[0].layer == "TripleNoBackward"


def test_a_layer_without_has_backward_has_a_backward(tmp_path):
    repo = LocalLayerRepository(_kernel(tmp_path, _TRIPLE), layer_name="TripleImplicitBackward")
    model = nn.Sequential(Double())
    with use_kernel_mapping({"Double": {"cpu": {Mode.TRAINING: repo}}}):
        kernelize(model, mode=Mode.TRAINING, device="cpu")
    assert kernelize_report(model).entries[0].layer == "TripleImplicitBackward"
    x = torch.ones(2, requires_grad=True)
    model(x).sum().backward()
    assert x.grad.tolist() == [3.0, 3.0]


# -- layer validation ------------------------------------------------------------------------------


def test_a_layer_with_other_members_is_refused(tmp_path):
    repo = LocalLayerRepository(_kernel(tmp_path, _TRIPLE), layer_name="TripleWithHelper")
    with use_kernel_mapping({"Double": {"cpu": repo}}):
        # a module marked with a layer name: refused as Hugging Face kernels refuses it
        with pytest.raises(TypeError, match=r"must not contain additional members compared to `Double`.*'helper'"):
            kernelize(nn.Sequential(Double()), device="cpu")
    # a module kernelhub recognised by its class: kept, with the reason in the report
    with use_kernel_mapping({"SwiGLUMLP": {"cpu": repo}}):
        model = kernelize(nn.Sequential(MLP()))
    (entry,) = kernelize_report(model).entries
    assert entry.layer is None and "must not contain additional members" in entry.fallback_reason


def test_bundled_layers_pass_kernels_layer_validation():
    from kernelhub.layer import _validate_layer, extra_members

    for name in ("swiglu", "moe"):
        layers = kernelhub.get_local_kernel(Path(__file__).parents[1] / "kernels_repo" / name).layers
        classes = [c for c in vars(layers).values() if isinstance(c, type) and issubclass(c, nn.Module)
                   and c.__module__ == layers.__name__]
        assert classes
        for cls in classes:
            assert extra_members(cls) == [], cls
            _validate_layer(check_cls=cls, cls=cls, repo=LocalLayerRepository(name, layer_name=cls.__name__))


def test_a_repository_that_fails_to_load_raises_for_a_marked_module(tmp_path):
    repo = LocalLayerRepository(_kernel(tmp_path, _TRIPLE), layer_name="NoSuchLayer")
    with use_kernel_mapping({"Double": {"cpu": repo}}):
        with pytest.raises(AttributeError, match="no layer 'NoSuchLayer'"):
            kernelize(nn.Sequential(Double()), device="cpu")


# -- function layers -------------------------------------------------------------------------------


def test_use_kernel_forward_from_hub_on_a_function_gives_a_module():
    @use_kernel_forward_from_hub("Halve")
    def halve(x: torch.Tensor) -> torch.Tensor:
        return x / 2

    assert isinstance(halve, nn.Module) and type(halve).kernel_layer_name == "Halve"
    assert halve(torch.full((2,), 4.0)).tolist() == [2.0, 2.0]
    with pytest.raises(TypeError, match="use_kernel_forward_from_hub: can only be applied to classes"):
        use_kernel_forward_from_hub("Halve")(42)


def test_kernelized_functions_are_kernelized_and_restored(tmp_path):
    @use_kernel_forward_from_hub("Quadruple")
    def quadruple(x):
        return x * 4

    @use_kernelized_func(quadruple)
    class Host(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 2)

        def forward(self, x):
            return quadruple(x)

    model = nn.Sequential(Host())
    assert "quadruple" not in dict(model.named_modules())  # attached, not a submodule
    path = _kernel(tmp_path, _TRIPLE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        func_repo = LocalFuncRepository(path, func_name="triple")
    with use_kernel_mapping({"Quadruple": {"cpu": func_repo}}):
        kernelize(model)
    (entry,) = kernelize_report(model).entries
    assert (entry.module_name, entry.layer, entry.device) == ("0.Quadruple", "triple", torch.device("cpu"))
    assert model(torch.ones(2)).tolist() == [3.0, 3.0]
    assert unkernelize(model) == 1
    assert model(torch.ones(2)).tolist() == [4.0, 4.0]
    with use_kernel_mapping({"Quadruple": {"cpu": LocalLayerRepository(path, layer_name="Triple")}}):
        kernelize(model)  # and by a layer
    assert model(torch.ones(2)).tolist() == [3.0, 3.0]


def test_a_function_layer_keeps_the_functions_signature():
    from kernelhub.layer import create_func_module

    def silu_and_mul(x: torch.Tensor, *, limit: float = 1.0) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:] * limit

    layer = create_func_module(silu_and_mul)
    assert list(__import__("inspect").signature(layer.forward).parameters) == ["self", "x", "limit"]
    assert layer.has_backward is True and layer.can_torch_compile is False


# -- names and signatures as kernels spells them ---------------------------------------------------


def test_kernels_spellings_of_devices_and_repositories(tmp_path):
    props = CUDAProperties(min_capability=80, max_capability=89)
    assert Device("cuda", props) == Device(type="cuda", properties=props)
    assert Device("cuda", props).index is None
    assert ROCMProperties is ROCmProperties
    assert Device("rocm", ROCMProperties(min_capability=90, max_capability=94)).properties.max_capability == 94
    a = LocalLayerRepository(repo_path=TOY, package_name="toy_mlp", layer_name="ToyMLPCpu")
    assert a == LocalLayerRepository(TOY, layer_name="ToyMLPCpu") == LocalLayerRepository(path=TOY,
                                                                                            layer_name="ToyMLPCpu")
    assert a.package_name == "toy_mlp" and a.load().__name__ == "ToyMLPCpu"
    with pytest.raises(TypeError, match="LocalLayerRepository: give the repository directory once"):
        LocalLayerRepository(TOY, path=TOY, layer_name="ToyMLPCpu")


def test_register_kernel_mapping_takes_inherit_mapping_positionally():
    from kernelhub import registry

    before = registry._GLOBAL_MAPPING
    try:
        register_kernel_mapping({"Double": {"cpu": LocalLayerRepository(TOY, layer_name="ToyMLPCpu")}}, False)
        assert set(get_kernel_mapping()) == {"Double"}
    finally:
        registry._GLOBAL_MAPPING = before


def test_names_torch_compile_sets_on_a_layer_class_are_not_its_members(tmp_path):
    from kernelhub.layer import extra_members

    layer = LocalLayerRepository(_kernel(tmp_path, _TRIPLE), layer_name="Triple").load()
    layer.___needs_generation_tag_patch = False  # what dynamo sets on a class it has traced
    assert extra_members(layer) == []
    with use_kernel_mapping({"Double": {"cpu": LocalLayerRepository(tmp_path / "dropin_kernel", layer_name="Triple")}}):
        model = kernelize(nn.Sequential(Double()), device="cpu")
    assert kernelize_report(model).entries[0].layer == "Triple"


def test_replace_kernel_forward_from_hub_marks_a_third_party_class(tmp_path):
    class ThirdParty(nn.Module):  # a class the user cannot decorate
        def forward(self, x):
            return x * 2

    kernelhub.replace_kernel_forward_from_hub(ThirdParty, "ThirdParty")
    assert ThirdParty.kernel_layer_name == "ThirdParty"
    repo = LocalLayerRepository(_kernel(tmp_path, _TRIPLE), layer_name="Triple")
    with use_kernel_mapping({"ThirdParty": {"cpu": repo}}):
        model = kernelize(nn.Sequential(ThirdParty()), device="cpu")
    assert model(torch.ones(1)).item() == 3.0
    with pytest.raises(ValueError, match="replace_kernel_forward_from_hub: `layer_name` must be a non-empty str"):
        kernelhub.replace_kernel_forward_from_hub(ThirdParty, "")


def test_a_layer_without_torch_compile_registered_for_it_is_a_value_error(tmp_path):
    repo = LocalLayerRepository(_kernel(tmp_path, _TRIPLE), layer_name="TripleImplicitBackward")
    with use_kernel_mapping({"Double": {"cpu": {Mode.INFERENCE | Mode.TORCH_COMPILE: repo}}}):
        with pytest.raises(ValueError, match="does not support torch.compile"):
            kernelize(nn.Sequential(Double()), mode=Mode.INFERENCE | Mode.TORCH_COMPILE, device="cpu")


def test_the_report_goes_with_the_model():
    import gc

    from kernelhub.kernelize import _REPORTS

    model = kernelize(nn.Sequential(MLP()))
    key = id(model)
    assert key in _REPORTS
    del model
    gc.collect()
    assert key not in _REPORTS


def test_members_added_to_nn_module_later_are_not_a_layers_own(monkeypatch):
    """transformers adds `smart_apply` to nn.Module itself when it loads a model; a layer checked
    before that must not then count it as state of its own."""
    from kernelhub.layer import extra_members

    class Layer(torch.nn.Module):
        has_backward = True

        def forward(self, x):
            return x

    assert extra_members(Layer) == []
    monkeypatch.setattr(torch.nn.Module, "added_by_a_library", lambda self: None, raising=False)
    assert extra_members(Layer) == []
