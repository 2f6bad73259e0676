"""kernelhub as a drop-in for Hugging Face `kernels`: kernelize's return value and report, its
device and mode rules, layer validation, function layers and the `kernels` spellings of names."""

from __future__ import annotations

import copy
import inspect
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


# -- condition= on the marking decorators, as kernels 0.17 honours it ----------------------------


def test_a_condition_decides_per_instance_whether_kernelize_replaces_the_forward(tmp_path):
    @use_kernel_forward_from_hub("Double", condition=lambda module: module.fast)
    class Switchable(nn.Module):
        def __init__(self, fast):
            super().__init__()
            self.fast = fast

        def forward(self, x):
            return x * 2

    model = nn.Sequential(Switchable(True), Switchable(False))
    repo = LocalLayerRepository(_kernel(tmp_path, _TRIPLE), layer_name="Triple")
    with use_kernel_mapping({"Double": {"cpu": repo}}):
        kernelize(model, mode=Mode.INFERENCE, device="cpu", use_fallback=False)  # a skip is no failure
    assert model[0](torch.ones(1)).item() == 3.0 and model[1](torch.ones(1)).item() == 2.0
    kept, skipped = kernelize_report(model).entries
    assert kept.layer == "Triple" and skipped.layer is None and "kernel_condition" in skipped.fallback_reason
    model[1].fast = True  # asked again at every kernelize
    with use_kernel_mapping({"Double": {"cpu": repo}}):
        kernelize(model, device="cpu")
    assert model[1](torch.ones(1)).item() == 3.0
    model[0].fast = model[1].fast = False  # skipped now: back on their own forward
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a skipped module is not reported as unmapped ("Double" is not here)
        kernelize(model, device="cpu")
    assert model(torch.ones(1)).item() == 4.0


def test_replace_kernel_forward_from_hub_takes_a_condition_positionally(tmp_path):
    class ThirdParty(nn.Module):
        def forward(self, x):
            return x * 2

    seen = []
    kernelhub.replace_kernel_forward_from_hub(ThirdParty, "ThirdPartyCond", lambda m: seen.append(m) or False)
    module = ThirdParty()
    assert module.kernel_condition(module) is False  # a staticmethod: the instance is not bound twice
    repo = LocalLayerRepository(_kernel(tmp_path, _TRIPLE), layer_name="Triple")
    with use_kernel_mapping({"ThirdPartyCond": {"cpu": repo}}):
        kernelize(nn.Sequential(module), device="cpu")
    assert seen[-1] is module and module(torch.ones(1)).item() == 2.0

    class Child(ThirdParty):  # marked again without a condition: the parent's is not inherited
        pass

    kernelhub.replace_kernel_forward_from_hub(Child, "ThirdPartyCond")
    with use_kernel_mapping({"ThirdPartyCond": {"cpu": repo}}):
        model = kernelize(nn.Sequential(Child()), device="cpu")
    assert model(torch.ones(1)).item() == 3.0


def test_a_condition_applies_to_a_kernelized_function(tmp_path):
    @use_kernel_forward_from_hub("Quintuple", condition=lambda module: False)
    def quintuple(x):
        return x * 5

    @use_kernelized_func(quintuple)
    class Host(nn.Module):
        def forward(self, x):
            return quintuple(x)

    model = nn.Sequential(Host())
    with use_kernel_mapping({"Quintuple": {"cpu": LocalLayerRepository(_kernel(tmp_path, _TRIPLE),
                                                                           layer_name="Triple")}}):
        kernelize(model, device="cpu")
    assert model(torch.ones(1)).item() == 5.0


@pytest.mark.parametrize("mark", [
    lambda c: use_kernel_forward_from_hub("X", condition=c),
    lambda c: (lambda cls: kernelhub.replace_kernel_forward_from_hub(cls, "X", condition=c)),
])
def test_a_condition_that_is_not_callable_is_a_type_error(mark):
    with pytest.raises(TypeError, match=r"(use|replace)_kernel_forward_from_hub: `condition` must be a callable"):
        mark(True)(Double)


# -- kernels' other public names -------------------------------------------------------------------


def test_version_is_the_installed_distributions():
    import importlib.metadata

    assert kernelhub.__version__ == importlib.metadata.version("kernelhub")


def test_benchmark_is_kernels_base_class():
    class SiluBench(kernelhub.Benchmark):
        seed = 42

        def setup(self):
            self.x = torch.ones(2, 4, device=self.device)

    bench = SiluBench()
    assert (bench.kernel, bench.out, bench.device, kernelhub.Benchmark.seed) == (None, None, "cpu", None)
    bench.setup()
    assert bench.x.shape == (2, 4) and kernelhub.Benchmark().setup() is None


def test_metadata_reads_metadata_json(tmp_path):
    from kernelhub import Metadata

    text = ('{"id": "relu_cuda_abc", "name": "my-relu", "version": 2, "license": "MIT", '
            '"python-depends": ["einops"], "backend": {"type": "cuda", "archs": ["9.0"]}, "kernel-depends": []}')
    meta = Metadata.from_bytes(text.encode())
    assert (meta.id, meta.name, meta.name.python_name, meta.version, meta.license) == (
        "relu_cuda_abc", "my-relu", "my_relu", 2, "MIT")
    assert meta.python_depends == ("einops",) and meta.backend["archs"] == ["9.0"] and meta.kernel_depends == ()
    (tmp_path / "metadata.json").write_text(text)
    assert Metadata.read_from_file(tmp_path / "metadata.json") == meta
    for bad in (b"not json", b"[]", b'{"version": 1}', b'{"name": "x", "version": "1"}',
                b'{"name": "x", "python-depends": "einops"}'):
        with pytest.raises(ValueError, match="Cannot parse metadata"):
            Metadata.from_bytes(bad)
    with pytest.raises(OSError):
        Metadata.read_from_file(tmp_path / "missing.json")
    with pytest.raises(TypeError, match="Metadata.from_bytes: `bytes` must be bytes"):
        Metadata.from_bytes(text)


def test_a_loaded_kernels_metadata_is_a_metadata(tmp_path):
    path = _kernel(tmp_path, _TRIPLE, name="meta_kernel")
    (path / "build" / "torch-universal" / "meta_kernel" / "metadata.json").write_text(
        '{"name": "meta-kernel", "version": 1, "license": "MIT", "python-depends": [3, "einops"]}')
    kernel = kernelhub.get_local_kernel(path)
    (loaded,) = [k for k in kernelhub.get_loaded_kernels() if k.module is kernel]
    assert isinstance(loaded.metadata, kernelhub.Metadata)
    assert (loaded.metadata.name.python_name, loaded.metadata.license) == ("meta_kernel", "MIT")
    assert loaded.metadata.python_depends == ("einops",)  # loading keeps what it can read


def test_get_kernel_dep_works_only_while_a_kernel_loads(tmp_path):
    with pytest.raises(RuntimeError, match="`get_kernel_dep` only works during kernel loading"):
        kernelhub.get_kernel_dep("org/dep")
    pkg = tmp_path / "dep_user" / "build" / "torch-universal" / "dep_user"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        from kernelhub import get_kernel_dep

        try:
            get_kernel_dep("org/dep")
        except RuntimeError as e:
            ERROR = str(e)
    """))
    kernel = kernelhub.get_local_kernel(tmp_path / "dep_user")
    assert kernel.ERROR.startswith("Dependency 'org/dep' not found in kernel dependencies")


def test_devices_have_kernels_validate_methods():
    props = CUDAProperties(min_capability=80, max_capability=90)
    assert props.validate() is None and props.validate_capability_range() is None
    assert Device("cuda", props).validate() is None
    object.__setattr__(props, "min_capability", 95)  # what validate() is for: a field changed behind its back
    with pytest.raises(ValueError, match=r"`min_capability` \(95\) must be <="):
        props.validate_capability_range()
    with pytest.raises(ValueError, match="must be <="):
        props.validate()


# -- every public name of kernels, with a signature that takes kernels' arguments ------------------

# Where kernelhub's positional parameter differs from kernels' on purpose: (name, position) -> why.
# The test checks kernels' spelling still works for each.
# Defaults that differ from kernels' in spelling only: parameter -> (kernelhub's, kernels', why).
_DEFAULT_SPELLINGS = {
    "trust_remote_code": (None, False, "None is 'not given', refused as False is (checked below)"),
}
_POSITIONAL_ON_PURPOSE = {
    ("Device", 1): "kernelhub's Device(type, index, properties) keeps its per-index key; a CUDAProperties/"
                   "ROCMProperties given as the second argument is taken as `properties`, as kernels has it",
}


def _signature_problems(name: str, theirs: inspect.Signature, ours: inspect.Signature) -> list[str]:
    """Why a call that kernels' `theirs` accepts could fail against kernelhub's `ours`."""
    P = inspect.Parameter
    positional = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
    mine = list(ours.parameters.values())
    my_positional = [q for q in mine if q.kind in positional]
    by_name = {q.name: q for q in mine}
    kinds = {q.kind for q in mine}
    problems = []
    for i, p in enumerate(theirs.parameters.values()):
        if p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            if p.kind not in kinds:
                problems.append(f"takes no {p}")
            continue
        if p.kind in positional:
            q = my_positional[i] if i < len(my_positional) else None
            if q is None:
                if P.VAR_POSITIONAL not in kinds:
                    problems.append(f"has no positional parameter {i} ({p.name})")
                continue
            if p.kind is P.POSITIONAL_OR_KEYWORD and q.name != p.name and (name, i) not in _POSITIONAL_ON_PURPOSE:
                problems.append(f"positional parameter {i} is {q.name!r}, kernels' is {p.name!r}")
        else:
            q = by_name.get(p.name)
            if q is None or q.kind not in (P.KEYWORD_ONLY, P.POSITIONAL_OR_KEYWORD):
                if P.VAR_KEYWORD not in kinds:
                    problems.append(f"takes no keyword {p.name!r}")
                continue
        if p.default is not P.empty and q.default is P.empty:
            problems.append(f"{q.name!r} is required here, optional in kernels")
        elif p.default is not P.empty and not (p.default is q.default or p.default == q.default):
            if _DEFAULT_SPELLINGS.get(p.name, (None, None))[:2] != (q.default, p.default):
                problems.append(f"{q.name!r} defaults to {q.default!r} here, to {p.default!r} in kernels")
    required_here = {q.name for q in mine if q.default is P.empty and q.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)}
    for extra in sorted(required_here - set(theirs.parameters)):
        problems.append(f"requires {extra!r}, which kernels does not have")
    return problems


def _kernels_or_skip():
    return pytest.importorskip("kernels", reason="Hugging Face `kernels` is not installed (CI installs it)")


def test_kernelhub_has_every_kernels_name_with_a_signature_that_takes_its_arguments():
    kernels = _kernels_or_skip()
    problems = {}
    for name in kernels.__all__:
        if not hasattr(kernelhub, name):
            problems[name] = ["missing"]
            continue
        if name not in kernelhub.__all__:
            problems[name] = ["not in kernelhub.__all__"]
        theirs, ours = getattr(kernels, name), getattr(kernelhub, name)
        if not callable(theirs):
            assert isinstance(ours, type(theirs)), name
            continue
        try:
            sig_theirs = inspect.signature(theirs)
        except (TypeError, ValueError):  # a compiled class (kernels' Metadata): its methods are checked below
            sig_theirs = None
        if sig_theirs is not None:
            found = _signature_problems(name, sig_theirs, inspect.signature(ours))
            if found:
                problems[name] = found
        if isinstance(theirs, type):  # and each public method or attribute kernels' class has
            for member in (m for m in dir(theirs) if not m.startswith("_")):
                if not hasattr(ours, member) and member not in getattr(ours, "__dataclass_fields__", {}):
                    problems.setdefault(name, []).append(f"has no member {member!r}")
                    continue
                theirs_m = getattr(theirs, member)
                ours_m = getattr(ours, member, None)
                try:
                    sig = inspect.signature(theirs_m) if callable(theirs_m) else None
                except (TypeError, ValueError):  # a builtin without a text signature
                    sig = None
                if sig is not None:
                    found = _signature_problems(f"{name}.{member}", sig, inspect.signature(ours_m))
                    if found:
                        problems.setdefault(name, []).extend(f".{member}: {f}" for f in found)
    assert problems == {}
    # what _POSITIONAL_ON_PURPOSE lets through works as kernels calls it
    props = kernels.CUDAProperties(min_capability=80, max_capability=90)
    assert Device("cuda", CUDAProperties(80, 90)) == Device(type="cuda", properties=CUDAProperties(80, 90))
    assert kernels.Device("cuda", props).properties == props


def test_trust_remote_code_none_is_refused_as_false_is(monkeypatch):
    from kernelhub._trust import _check_trust

    monkeypatch.setenv("KERNELHUB_REQUIRE_TRUSTED", "1")  # the local list only: the Hub is not asked
    monkeypatch.delenv("KERNELHUB_TRUSTED_PUBLISHERS", raising=False)
    for untrusted in (None, False, ["someone/else"]):
        with pytest.raises(kernelhub.UntrustedKernelError, match="not from a trusted publisher"):
            _check_trust("someone/kernel", untrusted)
    assert _check_trust("someone/kernel", True) is None


def test_the_signature_check_finds_what_would_break_kernels_code():
    def kernels_fn(repo_id, *, layer_name, revision=None):
        pass

    def reordered(layer_name, repo_id, *, revision=None):
        pass

    def no_keyword(repo_id, *, layer_name):
        pass

    def required(repo_id, *, layer_name, revision):
        pass

    def extra_required(repo_id, config, *, layer_name, revision=None):
        pass

    def superset(repo_id, revision=None, *, layer_name, extra=1, **kw):
        pass

    def other_default(repo_id, *, layer_name, revision="main"):
        pass

    theirs = inspect.signature(kernels_fn)
    assert _signature_problems("f", theirs, inspect.signature(superset)) == []
    assert _signature_problems("f", theirs, inspect.signature(reordered)) == [
        "positional parameter 0 is 'layer_name', kernels' is 'repo_id'"]
    assert _signature_problems("f", theirs, inspect.signature(no_keyword)) == ["takes no keyword 'revision'"]
    assert _signature_problems("f", theirs, inspect.signature(required)) == [
        "'revision' is required here, optional in kernels"]
    assert _signature_problems("f", theirs, inspect.signature(extra_required)) == [
        "requires 'config', which kernels does not have"]
    assert _signature_problems("f", theirs, inspect.signature(other_default)) == [
        "'revision' defaults to 'main' here, to None in kernels"]


def test_metadata_reads_a_kernel_builder_metadata_json_as_kernels_does():
    kernels = _kernels_or_skip()
    text = (b'{"id": "_relu_cuda_2c1f9e1", "name": "relu", "version": 1, "license": "Apache-2.0", '
            b'"kernels-minver": "0.17.0", "python-depends": ["einops"], "kernel-depends": [], '
            b'"upstream": null, "backend": {"type": "cuda", "archs": ["8.0", "9.0"]}}')
    ours, theirs = kernelhub.Metadata.from_bytes(text), kernels.Metadata.from_bytes(text)
    for attr in ("id", "version", "license", "upstream", "source"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert (str(ours.name), ours.name.python_name) == (str(theirs.name), theirs.name.python_name)
    assert list(ours.python_depends) == theirs.python_depends and list(ours.kernel_depends) == theirs.kernel_depends
    assert ours.kernels_minver == str(theirs.kernels_minver) and ours.backend["archs"] == theirs.backend.archs
