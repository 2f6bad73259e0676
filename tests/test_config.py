"""kernelhub.config: TOML schema, validation messages, and repository_for precedence."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from hub_server import hub_fixture  # noqa: F401 - hub_fixture provides `hub`

from kernelhub.config import ConfigError, KernelhubConfig, load_config
from kernelhub.hub import LayerRepository, LocalLayerRepository, LockedLayerRepository

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)

EXAMPLE = """
[tool.kernelhub.layers.SwiGLUMLP]
repo = "kernels-community/swiglu"
version = 1

[tool.kernelhub.layers.SwiGLUMLP.capability."9.0"]
layer = "SwiGLUMLPSm80"

[tool.kernelhub.layers.SwiGLUMLP.capability."8.0"]
revision = "abc123"

[tool.kernelhub.layers.SwiGLUMLP.device."cuda:1"]
layer = "SwiGLUMLPReference"
"""


def _config(text: str, tmp_path: Path, name: str = "pyproject.toml") -> KernelhubConfig:
    (tmp_path / name).write_text(text)
    return load_config(tmp_path / name)


def test_load_from_pyproject_kernelhub_toml_and_cwd_search(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config() is None
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert load_config() is None  # a pyproject without [tool.kernelhub] is not a config
    (tmp_path / "pyproject.toml").write_text(EXAMPLE)
    assert set(load_config().layers) == {"SwiGLUMLP"}
    (tmp_path / "kernelhub.toml").write_text('[layers.Other]\npath = "kernels_repo/other"\n')
    assert set(load_config().layers) == {"Other"}  # kernelhub.toml wins
    assert set(load_config(tmp_path / "pyproject.toml").layers) == {"SwiGLUMLP"}


def test_precedence_device_then_capability_then_general(tmp_path):
    config = _config(EXAMPLE, tmp_path)
    general = LayerRepository("kernels-community/swiglu", layer_name="SwiGLUMLP", version=1)
    # cuda:1 has an index override: it beats the 9.0 pin.
    assert config.repository_for("SwiGLUMLP", CUDA1, 90, None) == general.with_layer_name("SwiGLUMLPReference")
    assert config.repository_for("SwiGLUMLP", CUDA0, 90, None) == general.with_layer_name("SwiGLUMLPSm80")
    assert config.repository_for("SwiGLUMLP", CUDA0, 80, None) == LayerRepository(
        "kernels-community/swiglu", layer_name="SwiGLUMLP", revision="abc123"
    )
    assert config.repository_for("SwiGLUMLP", CUDA0, 86, None) == general
    assert config.repository_for("SwiGLUMLP", torch.device("cpu"), None, None) == general
    assert config.repository_for("MoEExperts", CUDA0, 90, None) is None


def test_pins_apply_on_top_of_the_registry_default(tmp_path):
    config = KernelhubConfig.from_dict(
        {"layers": {"SwiGLUMLP": {"capability": {"9.0": {"layer": "SwiGLUMLPSm80"}}}}}, base_dir=tmp_path
    )
    default = LocalLayerRepository("kernels_repo/swiglu", layer_name="SwiGLUMLPSm90")
    assert config.repository_for("SwiGLUMLP", CUDA1, 90, default) == default.with_layer_name("SwiGLUMLPSm80")
    assert config.repository_for("SwiGLUMLP", CUDA0, 80, default) is default
    with pytest.raises(ConfigError, match=r"capability\.9\.0 chooses layer 'SwiGLUMLPSm80' but no repository"):
        config.repository_for("SwiGLUMLP", CUDA1, 90, None)
    versioned = KernelhubConfig.from_dict({"layers": {"SwiGLUMLP": {"capability": {"9.0": {"version": 2}}}}})
    hub_default = LayerRepository("org/swiglu", layer_name="SwiGLUMLP", version=1)
    assert versioned.repository_for("SwiGLUMLP", CUDA1, 90, hub_default) == LayerRepository(
        "org/swiglu", layer_name="SwiGLUMLP", version=2
    )
    with pytest.raises(ConfigError, match="not a Hub repository"):
        versioned.repository_for("SwiGLUMLP", CUDA1, 90, default)


def test_local_path_resolves_against_the_config_file(tmp_path):
    config = _config('[layers.SwiGLUMLP]\npath = "kernels_repo/swiglu"\n', tmp_path, "kernelhub.toml")
    repo = config.repository_for("SwiGLUMLP", CUDA0, 80, None)
    assert repo == LocalLayerRepository(tmp_path / "kernels_repo" / "swiglu", layer_name="SwiGLUMLP")


def test_trusted_publishers_and_lockfile_change_the_repository_kind(tmp_path):
    trusted = KernelhubConfig.from_dict({"trusted_publishers": ["org"], "layers": {"A": {"repo": "org/a"}}})
    assert trusted.repository_for("A", CUDA0, 90, None).trust_remote_code is True
    untrusted = KernelhubConfig.from_dict({"layers": {"A": {"repo": "org/a"}}})
    assert untrusted.repository_for("A", CUDA0, 90, None).trust_remote_code is None  # get_kernel's default
    strict = KernelhubConfig.from_dict({"layers": {"A": {"repo": "org/a", "trust_remote_code": False}}})
    assert strict.repository_for("A", CUDA0, 90, None).trust_remote_code is False
    locked = KernelhubConfig.from_dict(
        {"lockfile": "kernels.lock", "layers": {"A": {"repo": "org/a", "version": 1}}}, base_dir=tmp_path
    )
    assert locked.repository_for("A", CUDA0, 90, None) == LockedLayerRepository(
        "org/a", layer_name="A", lockfile=tmp_path / "kernels.lock", version=1
    )


@pytest.mark.parametrize(
    ("table", "pattern"),
    [
        (
            {"layers": {"A": {"capability": {"9x": {"layer": "B"}}}}},
            r"layers\.A\.capability: .*'9x'.*like '9\.0'",
        ),
        ({"layers": {"A": {"device": {"gpu1": {"layer": "B"}}}}}, r"device key 'gpu1'.*'cuda:1'"),
        (
            {"layers": {"A": {"repo": "a/b", "colour": 1}}},
            r"layers\.A: unknown key 'colour'; allowed keys: .*'repo'",
        ),
        (
            {"layerz": {}},
            r"unknown key 'layerz'; allowed keys: \['layers', 'lockfile', 'trusted_publishers'\]",
        ),
        (
            {"layers": {"A": {"repo": "a/b", "version": 1, "revision": "x"}}},
            "`version` or `revision`, not both",
        ),
        ({"layers": {"A": {"repo": "a/b", "path": "p"}}}, "`repo` .* or `path` .*not both"),
        ({"layers": {"A": {"path": "p", "version": 1}}}, "not to a local `path`"),
        ({"layers": {"A": {"repo": "not-a-repo-id"}}}, r"layers\.A\.repo: `repo` must be a Hub id"),
        ({"layers": {"A": {"repo": "a/b", "version": 0}}}, r"`version` must be an int >= 1"),
        ({"layers": {"A": {"repo": "a/b", "version": True}}}, r"layers\.A\.version: .*valid integer"),
        ({"layers": {"A": {"repo": "a/b", "version": "1"}}}, r"layers\.A\.version: .*valid integer"),
        ({"layers": {"A": {"repo": "a/b", "trust_remote_code": "yes"}}},
         r"layers\.A\.trust_remote_code: .*valid boolean"),
        ({"layers": {"not valid": {"repo": "a/b"}}}, r"layer name 'not valid'"),
        (
            {"layers": {"A": {"capability": {"9.0": {"layer": "B", "extra": 1}}}}},
            r"capability\.9\.0: unknown key",
        ),
        # CPU tensors are on "cpu", never "cpu:0": such an override would never apply
        ({"layers": {"A": {"device": {"cpu:0": {"layer": "B"}}}}}, r"device key 'cpu:0'.*CPU tensors have no"),
        # two spellings of one capability: one of them would be dropped without a word
        (
            {"layers": {"A": {"capability": {"9.0": {"layer": "B"}, "09.0": {"layer": "C"}}}}},
            r"capability keys '9\.0' and '09\.0' name the same capability",
        ),
        ({"layers": {"A": {"repo": "a/b", "revision": ""}}}, r"layers\.A\.revision: .*non-empty string"),
        ({"layers": {"A": {"path": " "}}}, r"layers\.A\.path: .*non-empty string"),
        # accepted before and never applied: torch spells the index "1"
        ({"layers": {"A": {"device": {"cuda:01": {"layer": "B"}}}}}, r"device key 'cuda:01'.*leading zeros: cuda:1"),
        # the Hub's own id rules: these failed only when the kernel was fetched
        ({"layers": {"A": {"repo": "a/b--c"}}}, r"layers\.A\.repo: `repo` must be a Hub id.*'a/b--c': Cannot have --"),
        ({"layers": {"A": {"repo": "a/b."}}}, r"layers\.A\.repo: `repo` must be a Hub id"),
        ({"lockfile": ""}, r"lockfile: `lockfile` must be a non-empty string"),
        ({"lockfile": "a\x00b"}, r"lockfile: `lockfile` must be a non-empty string"),
        ({"layers": {"A": {"path": "p\x00"}}}, r"layers\.A\.path: `path` must be a non-empty string"),
        # a revision is joined into cache paths: nothing that can leave them
        ({"layers": {"A": {"repo": "a/b", "revision": "../../etc/passwd"}}}, r"layers\.A\.revision: .*'\.\.'"),
        ({"layers": {"A": {"repo": "a/b", "revision": "/etc/passwd"}}}, r"layers\.A\.revision: .*empty"),
        ({"layers": {"A": {"repo": "a/b", "revision": "main\\x"}}}, r"layers\.A\.revision: .*control"),
        ({"layers": {"A": {"repo": "a/b", "revision": " main"}}}, r"layers\.A\.revision: .*surrounding spaces"),
        ({"layers": {"A": {"capability": {"9.0": {"revision": "a/./b"}}}}},
         r"layers\.A\.capability\.9\.0\.revision: .*'\.'-leading"),
        ({"layers": {"A": {"repo": "a/b", "revision": 1}}}, r"layers\.A\.revision: .*valid string"),
        # a publisher no repo id can have trusts nothing, silently
        ({"trusted_publishers": [""]}, r"trusted_publishers: .*Hub user or org names.*got ''"),
        ({"trusted_publishers": [" org"]}, r"trusted_publishers: .*got ' org'"),
        ({"trusted_publishers": ["org/name"]}, r"trusted_publishers: .*got 'org/name'"),
        ({"layers": {"A": {"repo": "a/b", "layer": "class"}}}, r"layers\.A\.layer: `layer` must be a layer class"),
        ({"layers": {"class": {"repo": "a/b"}}}, r"layer name 'class'"),
    ],
)
def test_invalid_config_names_the_key_and_allowed_values(table, pattern):
    with pytest.raises(ConfigError, match=pattern):
        KernelhubConfig.from_dict(table, source="test")


def test_valid_spellings_still_load():
    config = KernelhubConfig.from_dict(
        {
            "trusted_publishers": ["my-org", "kernels-community", "user_1"],
            "layers": {
                "A": {
                    "repo": "org/a.b_c-d",
                    "revision": "refs/pr/1",
                    "capability": {"9.0": {"revision": "v1.2"}, "8.0": {"revision": "0" * 40}},
                    "device": {"cuda:0": {"layer": "B"}, "cuda:10": {"layer": "C"}},
                }
            },
        }
    )
    assert config.repository_for("A", torch.device("cuda", 10), 90, None).layer_name == "C"
    assert config.repository_for("A", CUDA1, 90, None).revision == "v1.2"


@pytest.mark.parametrize("text", ['tool = "kernelhub"\n', "tool = 1\n", "tool = [1]\n"])
def test_a_tool_key_that_is_not_a_table_is_a_config_error(tmp_path, monkeypatch, text):
    """`tool = ...` is valid TOML: it raised a raw TypeError (string indices / `in` an int)."""
    (tmp_path / "pyproject.toml").write_text(text)
    with pytest.raises(ConfigError, match=r"pyproject\.toml: `tool` must be a table"):
        load_config(tmp_path / "pyproject.toml")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"pyproject\.toml: `tool` must be a table"):
        load_config(None)  # the search of the current directory reads `tool` too
    (tmp_path / "kernelhub.toml").write_text(text)
    with pytest.raises(ConfigError, match=r"kernelhub\.toml: `tool` must be a table"):
        load_config(tmp_path / "kernelhub.toml")


def test_a_file_that_is_not_utf8_is_a_config_error_naming_it(tmp_path):
    (tmp_path / "kernelhub.toml").write_bytes(b'[layers.A]\nrepo = "org/\xff"\n')
    with pytest.raises(ConfigError, match=r"kernelhub\.toml is not UTF-8 text \(byte 23\)"):
        load_config(tmp_path / "kernelhub.toml")
    with pytest.raises(ConfigError, match=r"kernelhub\.toml is not UTF-8"):
        load_config(tmp_path)


def test_a_file_nested_too_deeply_is_a_config_error_naming_it(tmp_path):
    (tmp_path / "kernelhub.toml").write_text("a = " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=r"kernelhub\.toml is not valid TOML: nested too deeply"):
        load_config(tmp_path / "kernelhub.toml")


def test_a_lockfile_that_is_a_directory_and_an_empty_path_are_refused(tmp_path):
    (tmp_path / "locks").mkdir()
    with pytest.raises(ConfigError, match=r"lockfile: `lockfile` 'locks' is a directory"):
        KernelhubConfig.from_dict({"lockfile": "locks"}, base_dir=tmp_path, source="t")
    with pytest.raises(ValueError, match="load_config: `path` must name a file or directory"):
        load_config("")  # Path("") is ".": it searched the current directory
    with pytest.raises(TypeError, match="from_dict: `base_dir` must be a str or Path"):
        KernelhubConfig.from_dict({}, base_dir=3)


def test_invalid_files_are_reported(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        _config("[tool.kernelhub\n", tmp_path)
    with pytest.raises(ConfigError, match=r"has no \[tool\.kernelhub\] table"):
        _config("[tool.other]\nx = 1\n", tmp_path)
    with pytest.raises(FileNotFoundError, match="load_config: `path`"):
        load_config(tmp_path / "absent.toml")
    with pytest.raises(TypeError, match="load_config: `path`"):
        load_config(3)


def test_hub_kernels_lists_each_repo_and_ref_once(tmp_path):
    config = _config(EXAMPLE, tmp_path)
    assert config.hub_kernels() == [
        ("kernels-community/swiglu", 1, None),
        ("kernels-community/swiglu", None, "abc123"),
    ]


def test_kernelize_binds_what_the_config_pins_per_device(hub, tmp_path, fake_gpus):
    """cuda:0 is sm80, cuda:1 sm90 (fake_gpus): the same module gets a different Hub kernel on each."""
    from hub_server import tiny_copy
    from torch import nn

    from kernelhub import kernelize, kernelize_report, use_kernel_forward_from_hub
    from kernelhub.cli.upload import upload_kernel

    upload_kernel(tiny_copy(tmp_path / "v1", factor=2.0), "org/tiny", version=1)
    upload_kernel(tiny_copy(tmp_path / "v2", factor=3.0), "org/tiny", version=2)
    (tmp_path / "kernelhub.toml").write_text(
        'trusted_publishers = ["org"]\n'
        '[layers.Scale]\nrepo = "org/tiny"\nversion = 1\nlayer = "TinyScale"\n'
        '[layers.Scale.capability."9.0"]\nversion = 2\n'
        '[layers.Scale.device."cuda:0"]\nlayer = "TinyScaleDouble"\n'
    )

    @use_kernel_forward_from_hub("Scale")
    class Scale(nn.Module):
        def forward(self, x):
            return x

    model = nn.Sequential(Scale())
    config = tmp_path / "kernelhub.toml"
    chosen = {}
    for device in ("cuda:0", "cuda:1", "cpu"):
        (entry,) = kernelize_report(kernelize(model, device=device, config=config)).entries
        chosen[device] = (entry.layer, entry.repository)
    assert chosen == {
        "cuda:0": ("TinyScaleDouble", "hub:org/tiny@v1/TinyScaleDouble"),
        "cuda:1": ("TinyScale", "hub:org/tiny@v2/TinyScale"),
        "cpu": ("TinyScale", "hub:org/tiny@v1/TinyScale"),
    }
    assert float(model(torch.ones(1))[0]) == 2.0  # bound for cpu: v1's TinyScale ran


def test_a_misspelt_tool_table_is_warned_about_not_silently_ignored(tmp_path, monkeypatch):
    (tmp_path / "pyproject.toml").write_text('[tool.kernelhubb.layers.SwiGLUMLP]\nlayer = "SwiGLUMLPSm80"\n'
                                             '[tool.ruff]\nline-length = 100\n')
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match=r"has \[tool.kernelhubb\] but no \[tool.kernelhub\]"):
        assert load_config(None) is None
    (tmp_path / "pyproject.toml").write_text('[tool.ruff]\nline-length = 100\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(None) is None
