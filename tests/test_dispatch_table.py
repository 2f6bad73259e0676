"""kernel.toml as the one home of capability -> variant: the default mapping, each kernel's own
automatic choice and `kernelhub report` all read it, and agree for every capability."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import fake_cuda_tensor
from kernelhub import Mode, use_kernel_mapping
from kernelhub.cli import main
from kernelhub.default_mapping import bundled_kernels_dir, default_kernel_mapping, home_repository
from kernelhub.device import clear_device_caches
from kernelhub.dispatch_table import read_dispatch_table
from kernelhub.hub import get_local_kernel
from kernelhub.layer import layer_problem
from kernelhub.registry import resolve_repository

CAPABILITIES = range(70, 121)
# a model with both layers kernelhub finds by shape: Qwen2-MoE's experts and its shared-expert MLPs
QWEN2_MOE = {"model_type": "qwen2_moe", "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 24,
             "shared_expert_intermediate_size": 40, "num_experts": 4, "num_experts_per_tok": 2,
             "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64}
# ... and the same model as an fp8 checkpoint declares it: transformers loads its experts as FP8Experts
# (I = 128: with I <= 64 transformers gives gate_up two scale rows, not the 128x128 block layout the
# fp8 kernels serve, and kernelize rightly keeps the eager forward)
QWEN2_MOE_FP8 = {**QWEN2_MOE, "moe_intermediate_size": 128,
                 "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                         "activation_scheme": "dynamic"}}
# the layers whose rows the report shows, per model config
REPORTED = {"qwen2_moe": ({"SwiGLUMLP", "MoEExperts"}, QWEN2_MOE),
            "qwen2_moe_fp8": ({"SwiGLUMLP", "MoEExpertsFP8"}, QWEN2_MOE_FP8)}


def _copy_kernels(dst: Path) -> Path:
    for name in ("swiglu", "moe"):
        shutil.copytree(bundled_kernels_dir() / name, dst / name,
                        ignore=shutil.ignore_patterns("__pycache__", "tests", "benchmarks", "build"))
    return dst


def _report_kernels(root: Path, tmp_path: Path, capsys) -> dict[object, dict[str, set[str]]]:
    """{capability (None: cpu): {layer: kernels the report shows}} from `kernelhub report` on each
    model config of REPORTED."""
    pins = tmp_path / "kernelhub.toml"
    pins.write_text("")  # no pins: the mapping alone decides (not the working directory's config)
    caps = [a for c in CAPABILITIES for a in ("--capability", f"{c // 10}.{c % 10}")]
    shown: dict[object, dict[str, set[str]]] = {}
    for name, (layers, model_config) in REPORTED.items():
        config = tmp_path / f"{name}.json"
        config.write_text(json.dumps(model_config))
        argv = ["report", "--config", str(config), "--kernelhub-config", str(pins)]
        with use_kernel_mapping(default_kernel_mapping(root), inherit_mapping=False):
            for args in (caps, ["--device", "cpu"]):
                capsys.readouterr()
                assert main([*argv, *args]) == 0
                where = None
                for line in capsys.readouterr().out.splitlines():
                    if line.startswith("=="):
                        where = None if "cpu" in line else round(float(line.split()[-2]) * 10)
                        shown.setdefault(where, {}).update({layer: set() for layer in layers})
                    cells = line.split()
                    if len(cells) > 5 and cells[2] in layers:
                        shown[where][cells[2]].add(cells[5])
    return shown


def _automatic(kernels: dict, fake_gpus, capability: int | None, monkeypatch) -> dict[str, str]:
    """{layer: the variant its kernel's own automatic choice runs} on a (fake) GPU of `capability`."""
    dispatch, moe = kernels["swiglu"]._dispatch, kernels["moe"]
    if capability is None:  # the CPU outside the test's Triton interpreter
        with monkeypatch.context() as m:
            m.setattr(dispatch, "_INTERPRET", False)
            swiglu = dispatch._resolve("swiglu", torch.ones(2, 8), None)
        device = torch.device("cpu")
    else:
        fake_gpus.specs[0]["capability"] = capability
        clear_device_caches()
        swiglu = dispatch._resolve("swiglu", fake_cuda_tensor((2, 8), 0), None)
        device = torch.device("cuda", 0)
    swiglu = "reference" if swiglu is None else swiglu[0].name
    # fused_experts' own choices: 16-bit weights, and fp8 weights, by the table its fp8 layer names
    fp8 = moe.select_variant_fp8(device)
    assert fp8 == moe._variants.auto_variant(capability, moe._variants.layer_table("MoEExpertsFP8"))
    return {"SiluAndMul": swiglu, "SwiGLUMLP": swiglu, "MoEExperts": moe.select_variant(device), "MoEExpertsFP8": fp8}


def _assert_agreement(root: Path, fake_gpus, tmp_path: Path, capsys, monkeypatch) -> dict:
    """Mapping, automatic choice and report agree on every capability (and the CPU); returns, per
    capability, {layer: variant} as the mapping has it."""
    tables = {name: read_dispatch_table(root / name) for name in ("swiglu", "moe")}
    kernels = {name: get_local_kernel(root / name) for name in tables}
    mapping = default_kernel_mapping(root)
    shown = _report_kernels(root, tmp_path, capsys)
    assert set(shown) == {*CAPABILITIES, None}
    reported = {layer for layers, _ in REPORTED.values() for layer in layers}
    assert kernels["moe"]._variants.layer_table("MoEExpertsFP8") == tables["moe"].dispatch_of("MoEExpertsFP8")
    chosen = {}
    for capability in [*CAPABILITIES, None]:
        auto = _automatic(kernels, fake_gpus, capability, monkeypatch)
        device = torch.device("cpu") if capability is None else torch.device("cuda", 0)
        chosen[capability] = {}
        for table in tables.values():
            for layer in table.layers:
                with use_kernel_mapping(mapping, inherit_mapping=False):
                    repository = resolve_repository(layer, device, capability, Mode.INFERENCE).repository
                where = (layer, capability)
                if repository is None:  # no range declares it: kernelize keeps the module, impl=None still runs
                    other_cuda = table.ranges_for(layer).other_cuda
                    assert capability is not None and table.variant_for(capability, layer) == other_cuda, where
                    assert auto[layer] == other_cuda, where
                    mapped = None
                else:
                    mapped = table.variant_of(repository.layer_name)
                    assert mapped == auto[layer] == table.variant_for(capability, layer), where
                chosen[capability][layer] = mapped
                if layer in reported:
                    want = {"eager"} if mapped is None else {repository.layer_name}
                    assert shown[capability][layer] == want, where
    return chosen


def test_mapping_automatic_choice_and_report_agree_for_every_capability(fake_gpus, tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    chosen = _assert_agreement(bundled_kernels_dir(), fake_gpus, tmp_path, capsys, monkeypatch)
    # what kernel.toml declares today, spelled out once
    # (the fp8 layer from [dispatch_fp8]: fp8 tensor cores from sm89, where 16-bit experts run sm80)
    assert chosen[75] == {"SiluAndMul": None, "SwiGLUMLP": None, "MoEExperts": None, "MoEExpertsFP8": None}
    assert chosen[86] == {"SiluAndMul": "sm80", "SwiGLUMLP": "sm80", "MoEExperts": "sm80", "MoEExpertsFP8": "sm80"}
    assert chosen[89] == {"SiluAndMul": "sm80", "SwiGLUMLP": "sm80", "MoEExperts": "sm80", "MoEExpertsFP8": "sm90"}
    assert chosen[90] == {"SiluAndMul": "sm80", "SwiGLUMLP": "sm80", "MoEExperts": "sm90", "MoEExpertsFP8": "sm90"}
    assert chosen[100] == {"SiluAndMul": "sm80", "SwiGLUMLP": "sm80", "MoEExperts": "sm80", "MoEExpertsFP8": "sm80"}
    assert chosen[None] == {"SiluAndMul": "reference", "SwiGLUMLP": "reference", "MoEExperts": "reference",
                            "MoEExpertsFP8": "reference"}


def test_which_kernel_sm90_gets_is_one_line_of_kernel_toml(fake_gpus, tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    root = _copy_kernels(tmp_path / "kernels_repo")
    toml = root / "swiglu" / "kernel.toml"
    before = toml.read_text().splitlines()
    toml.write_text(toml.read_text().replace('{ capability = [90, 129], variant = "sm80" }',
                                             '{ capability = [90, 129], variant = "sm90" }'))
    after = toml.read_text().splitlines()
    assert len(before) == len(after) and sum(a != b for a, b in zip(before, after)) == 1
    chosen = _assert_agreement(root, fake_gpus, tmp_path, capsys, monkeypatch)
    for capability in (90, 100, 120):
        assert chosen[capability]["SwiGLUMLP"] == chosen[capability]["SiluAndMul"] == "sm90"
    assert chosen[89]["SwiGLUMLP"] == "sm80"
    assert get_local_kernel(root / "swiglu")._dispatch._AUTO_SM90 == "sm90"
    # the bundled kernel still runs what its own kernel.toml says
    assert get_local_kernel(bundled_kernels_dir() / "swiglu")._dispatch._AUTO_SM90 == "sm80"


def test_the_fp8_layer_follows_its_own_table_and_the_16_bit_one_stays(fake_gpus, tmp_path, capsys, monkeypatch):
    """Moving sm89 from fp8 tensor cores to W8A16 is two lines of [dispatch_fp8]: the fp8 layer's
    mapping, fused_experts' fp8 choice and the report follow; MoEExperts ([dispatch]) does not move."""
    pytest.importorskip("transformers")
    root = _copy_kernels(tmp_path / "kernels_repo")
    toml = root / "moe" / "kernel.toml"
    text = toml.read_text()
    fp8 = text.index("[dispatch_fp8]")
    edited = text[fp8:].replace("[80, 88]", "[80, 89]", 1).replace("[89, 99]", "[90, 99]", 1)
    assert edited != text[fp8:]
    toml.write_text(text[:fp8] + edited)
    chosen = _assert_agreement(root, fake_gpus, tmp_path, capsys, monkeypatch)
    assert chosen[89]["MoEExpertsFP8"] == "sm80" and chosen[90]["MoEExpertsFP8"] == "sm90"
    assert chosen[89]["MoEExperts"] == "sm80" and chosen[90]["MoEExperts"] == "sm90"
    assert chosen[100]["MoEExperts"] == "sm80" and chosen[100]["MoEExpertsFP8"] == "sm80"


def test_the_fp8_choice_reads_the_table_its_layer_names(fake_gpus, tmp_path, capsys, monkeypatch):
    """The fp8 layer's table is data (its `dispatch` key): renamed in kernel.toml, fused_experts' own
    fp8 choice follows it as the mapping does, rather than asking for a [dispatch_fp8] that is gone."""
    pytest.importorskip("transformers")
    root = _copy_kernels(tmp_path / "kernels_repo")
    toml = root / "moe" / "kernel.toml"
    toml.write_text(toml.read_text().replace("[dispatch_fp8]", "[dispatch_w8]", 1)
                    .replace('dispatch = "dispatch_fp8"', 'dispatch = "dispatch_w8"', 1))
    assert read_dispatch_table(root / "moe").dispatch_of("MoEExpertsFP8") == "dispatch_w8"
    chosen = _assert_agreement(root, fake_gpus, tmp_path, capsys, monkeypatch)
    assert chosen[86]["MoEExpertsFP8"] == "sm80" and chosen[89]["MoEExpertsFP8"] == "sm90"


def test_a_layer_naming_a_missing_table_is_refused_by_every_reader(tmp_path, capsys):
    """A typo in a layer's `dispatch` must not fall back to [dispatch] (16-bit ranges for fp8 weights)."""
    repo = _copy_kernels(tmp_path / "kernels_repo") / "moe"
    toml = repo / "kernel.toml"
    toml.write_text(toml.read_text().replace('dispatch = "dispatch_fp8"', 'dispatch = "dispatch_fp9"', 1))
    assert main(["check", str(repo)]) == 2
    assert "`layers.MoEExpertsFP8.dispatch` must be the name of a dispatch table" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"\[layers.MoEExpertsFP8\] `dispatch` must name a table of this file, "
                                         r"got 'dispatch_fp9'"):
        get_local_kernel(repo)  # the kernel's own reader: its layers read kernel.toml at import


class _LlamaLikeMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = torch.nn.Linear(8, 12, bias=False)
        self.up_proj = torch.nn.Linear(8, 12, bias=False)
        self.down_proj = torch.nn.Linear(12, 8, bias=False)
        self.act_fn = torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_generated_swiglu_layers_are_module_level_classes_that_pass_layer_validation():
    table = read_dispatch_table(bundled_kernels_dir() / "swiglu")
    layers = get_local_kernel(bundled_kernels_dir() / "swiglu").layers
    assert layers.__all__ == [c.name for c in table.classes] and len(table.classes) == 8
    host = _LlamaLikeMLP()
    for c in table.classes:
        cls = getattr(layers, c.name)
        assert cls.__name__ == c.name and cls.__module__ == layers.__name__
        assert pickle.loads(pickle.dumps(cls)) is cls  # found again by module and name
        assert (cls.has_backward, cls.can_torch_compile) == (c.has_backward, c.can_torch_compile)
        assert cls.__doc__ == c.description
        if c.layer == "SwiGLUMLP":
            assert layer_problem(cls, host, Mode.TRAINING | Mode.TORCH_COMPILE) is None


def test_moe_layers_take_their_attributes_from_kernel_toml(tmp_path):
    root = _copy_kernels(tmp_path / "kernels_repo")
    toml = root / "moe" / "kernel.toml"
    text = toml.read_text()
    at = text.index("[layers.MoEExpertsSm90]")
    toml.write_text(text[:at] + text[at:].replace("can_torch_compile = true", "can_torch_compile = false", 1))
    table = read_dispatch_table(root / "moe")
    layers = get_local_kernel(root / "moe").layers
    for c in table.classes:
        cls = getattr(layers, c.name)
        assert (cls.has_backward, cls.can_torch_compile) == (c.has_backward, c.can_torch_compile), c.name
    assert layers.MoEExpertsSm90.can_torch_compile is False and layers.MoEExperts.can_torch_compile is True


def test_each_kernel_reads_kernel_toml_with_the_same_reader():
    root = bundled_kernels_dir()
    assert ((root / "swiglu/torch-ext/swiglu/_variants.py").read_bytes()
            == (root / "moe/torch-ext/moe/_variants.py").read_bytes())


def test_a_built_kernel_reads_kernel_toml_beside_its_package(tmp_path, fake_gpus):
    """The built layout (build/torch-universal/<name>/ with kernel.toml copied in) has no source tree
    two levels up: the reader finds the copy in its own directory."""
    package = tmp_path / "swiglu" / "build" / "torch-universal" / "swiglu"
    shutil.copytree(bundled_kernels_dir() / "swiglu" / "torch-ext" / "swiglu", package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    text = (bundled_kernels_dir() / "swiglu" / "kernel.toml").read_text()
    (package / "kernel.toml").write_text(text.replace('other_cuda = "sm80"', 'other_cuda = "reference"'))
    kernel = get_local_kernel(package)
    assert kernel._variants.kernel_toml() == (package / "kernel.toml").resolve()
    fake_gpus.specs[0]["capability"] = 75
    clear_device_caches()
    assert kernel._dispatch._resolve("swiglu", fake_cuda_tensor((2, 8), 0), None) is None  # its reference


def test_home_repository_is_the_one_declaring_the_layer():
    root = bundled_kernels_dir()
    assert home_repository("SwiGLUMLP") == root / "swiglu" and home_repository("SiluAndMul") == root / "swiglu"
    assert home_repository("MoEExperts") == root / "moe"
    assert home_repository("NoSuchLayer") is None


_GOOD = """
[dispatch]
cpu = "reference"
other_cuda = "a"
cuda = [ { capability = [80, 89], variant = "a" }, { capability = [90, 99], variant = "b" } ]
[dispatch_x]
cpu = "reference"
cuda = [ { capability = [80, 129], variant = "c" } ]
[layers.L]
has_backward = true
can_torch_compile = true
[layers.LA]
layer = "L"
variant = "a"
has_backward = true
can_torch_compile = false
[layers.LB]
layer = "L"
variant = "b"
has_backward = true
can_torch_compile = true
[layers.LRef]
layer = "L"
variant = "reference"
has_backward = false
can_torch_compile = true
[layers.MC]
layer = "M"
variant = "c"
dispatch = "dispatch_x"
has_backward = true
can_torch_compile = true
[layers.MRef]
layer = "M"
variant = "reference"
has_backward = true
can_torch_compile = true
"""


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("[90, 99]", "[85, 99]", r"ranges \[80, 89\] and \[85, 99\] overlap"),
        ("[90, 99]", "[99, 90]", r"`dispatch.cuda\[1\].capability` must be \[min, max\]"),
        ("[90, 99]", '["9.0", 99]', r"`dispatch.cuda\[1\].capability` must be"),
        ('variant = "b" }', 'variant = "c" }', r"no \[layers.<class>\] of layer 'L' for variant 'c'"),
        ('cpu = "reference"', 'cpu = "reference"\ngpu = "a"', r"unknown key\(s\) \['gpu'\] in \[dispatch\]"),
        ('layer = "L"\nvariant = "a"', 'variant = "a"', r"`layers.LA` must set both `layer` and `variant`"),
        ("has_backward = false", 'has_backward = "no"', r"`layers.LRef.has_backward` must be true or false"),
        ("cuda = [", "cuda = 5 #", r"`dispatch.cuda` must be a list"),
        ("[layers.L]\n", '[layers.L]\ndispatch = "dispatch_fp8"\n',
         r"`layers.L.dispatch` must be the name of a dispatch table of this file "
         r"\['dispatch', 'dispatch_x'\], got 'dispatch_fp8'"),
        ("[layers.L]\n", '[layers.L]\ndispatch = "dispatch_x"\n', r"no \[layers.<class>\] of layer 'L' for "
         r"variant 'c'"),
        ("[layers.MRef]\n", '[layers.MRef]\ndispatch = "dispatch"\n',
         r"the classes of layer 'M' name different dispatch tables"),
        ('variant = "c"\ndispatch', 'variant = "d"\ndispatch', r"no \[layers.<class>\] of layer 'M' for variant 'c'"),
        ("[dispatch_x]\n", '[dispatch_x]\ngpu = "a"\n', r"unknown key\(s\) \['gpu'\] in \[dispatch_x\]"),
        ("[80, 129]", "[90, 80]", r"`dispatch_x.cuda\[0\].capability` must be \[min, max\]"),
    ],
)
def test_bad_declarations_are_errors_naming_the_file_and_key(tmp_path, old, new, message):
    (tmp_path / "kernel.toml").write_text(_GOOD.replace(old, new, 1))
    with pytest.raises(ValueError, match=r"read_dispatch_table: .*kernel.toml: .*" + message):
        read_dispatch_table(tmp_path)


def test_a_kernel_toml_nested_too_deeply_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "kernel.toml").write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match=r"read_dispatch_table: .*kernel.toml: not valid TOML: nested too deeply"):
        read_dispatch_table(tmp_path)


def test_a_good_declaration_reads_back(tmp_path):
    (tmp_path / "kernel.toml").write_text(_GOOD)
    table = read_dispatch_table(tmp_path)
    assert table.layers == ["L", "M"]
    assert [table.variant_for(c) for c in (None, 75, 80, 89, 90, 99, 100)] == [
        "reference", "a", "a", "a", "b", "b", "a"]
    assert table.class_for("L", "b") == "LB" and table.variant_of("L") is None
    # layer M chooses from [dispatch_x], which its class MC names for every class of M
    assert table.dispatch_of("L") == "dispatch" and table.dispatch_of("M") == "dispatch_x"
    assert [table.variant_for(c, "M") for c in (None, 75, 80, 129)] == ["reference", None, "c", "c"]
    assert table.class_for("M", "reference") == "MRef"
    with pytest.raises(TypeError, match="read_dispatch_table: `repo`"):
        read_dispatch_table(5)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match="read_dispatch_table: `repo`: no kernel.toml"):
        read_dispatch_table(tmp_path / "absent")


def test_check_accepts_layers_generated_through_globals_and_still_imports_them(tmp_path, capsys):
    """A layers module that defines its classes through globals() (as swiglu's does, from kernel.toml)
    cannot be read statically: `check` leaves the names to `--import`, which still finds a missing one."""
    def copy(where: str, names: str) -> Path:
        repo = tmp_path / where
        shutil.copytree(Path(__file__).parent / "fixtures" / "kernels" / "tiny", repo,
                        ignore=shutil.ignore_patterns("__pycache__"))
        (repo / "build" / "torch-universal" / "tiny" / "layers.py").write_text(generated.replace("NAMES", names))
        return repo

    generated = ("from torch import nn\n\nfrom .ops import scale\n\n\n"
                 "def _forward(self, x):\n    return scale(x)\n\n\n"
                 "for _name in NAMES:\n"
                 "    globals()[_name] = type(_name, (nn.Module,), {'has_backward': True, 'can_torch_compile': True,\n"
                 "                                                 'forward': _forward})\n")
    repo = copy("both", "('TinyScale', 'TinyScaleDouble')")
    assert main(["check", str(repo)]) == 0, capsys.readouterr().err
    assert main(["check", str(repo), "--import"]) == 0, capsys.readouterr().err
    repo = copy("one", "('TinyScale',)")
    assert main(["check", str(repo)]) == 0  # statically unreadable: not a problem by itself ...
    capsys.readouterr()
    assert main(["check", str(repo), "--import"]) == 2  # ... and the import finds what is missing
    assert "layers.TinyScaleDouble is not an nn.Module subclass" in capsys.readouterr().err


def test_check_reports_a_bad_dispatch_table(tmp_path, capsys):
    repo = _copy_kernels(tmp_path / "kernels_repo") / "moe"
    toml = repo / "kernel.toml"
    toml.write_text(toml.read_text().replace("capability = [90, 99]", "capability = [85, 99]"))
    assert main(["check", str(repo)]) == 2
    assert re.search(r"error: read_dispatch_table: .*kernel.toml: `dispatch.cuda` ranges \[80, 89\] and "
                     r"\[85, 99\] overlap", capsys.readouterr().err)


@pytest.mark.parametrize("name", ["swiglu", "moe"])
def test_bundled_layers_pass_check_import_when_built(tmp_path, capsys, name):
    """As `kernelhub build` lays a kernel out (the package and kernel.toml in build/torch-universal/,
    no source tree): check --import finds every class kernel.toml declares, generated or written."""
    repo = tmp_path / name
    package = repo / "build" / "torch-universal" / name
    shutil.copytree(bundled_kernels_dir() / name / "torch-ext" / name, package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    for where in (repo, package):
        shutil.copy(bundled_kernels_dir() / name / "kernel.toml", where / "kernel.toml")
    (package.parent / "metadata.json").write_text("{}")
    assert main(["check", str(repo), "--import"]) == 0, capsys.readouterr().err
    assert f"ok: {name} v1, layers " in capsys.readouterr().out
