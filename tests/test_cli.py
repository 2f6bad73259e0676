"""The `kernelhub` command line: help, check, upload, download, variants (report: with kernelize)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hub_server import TINY, hub_fixture, tiny_copy  # noqa: F401 - hub_fixture provides `hub`
from huggingface_hub import HfApi

from kernelhub.cli import build_parser, main

SRC = Path(__file__).resolve().parents[1] / "src"
SUBCOMMANDS = ["check", "build", "upload", "download", "lock", "variants", "report"]


def test_help_lists_and_explains_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out
    for name in SUBCOMMANDS:
        with pytest.raises(SystemExit):
            main([name, "--help"])
        assert len(capsys.readouterr().out.splitlines()) > 5  # usage plus an explanation


def test_python_dash_m_runs_the_cli():
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run(
        [sys.executable, "-m", "kernelhub", "check", str(TINY)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok: tiny v1, layers TinyScale, TinyScaleDouble"


def test_check_accepts_the_fixture_and_imports_it(capsys):
    assert main(["check", str(TINY), "--import"]) == 0
    assert "ok: tiny v1" in capsys.readouterr().out


def _edit_first(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path} no longer holds {old!r}"
    path.write_text(text.replace(old, new, 1))


def _broken(tmp_path: Path, how: str) -> Path:
    repo = tiny_copy(tmp_path / how)
    pkg = repo / "build" / "torch-universal" / "tiny"
    if how == "missing-layer":
        (repo / "kernel.toml").write_text('name = "tiny"\nversion = 1\nlayers = ["TinyScale", "Ghost"]\n')
    elif how == "no-metadata":
        (pkg / "metadata.json").unlink()
    elif how == "bad-toml-version":
        (repo / "kernel.toml").write_text('name = "tiny"\nversion = "one"\nlayers = ["TinyScale"]\n')
    elif how == "bad-variant-name":
        shutil.move(repo / "build" / "torch-universal", repo / "build" / "universal")
    elif how == "no-package":
        shutil.rmtree(pkg)
    elif how == "two-packages":
        shutil.copytree(pkg, pkg.parent / "other")
    elif how == "symlinked-file":
        (pkg / "notes.txt").symlink_to("/etc/hostname")
    elif how == "symlinked-package":
        shutil.move(pkg, repo / "pkgsrc")
        pkg.symlink_to(repo / "pkgsrc")
    elif how == "general-not-a-table":
        (repo / "kernel.toml").write_text('general = 1\nname = "tiny"\nversion = 1\nlayers = ["TinyScale"]\n')
    elif how == "non-utf8-layers":
        (pkg / "layers.py").write_bytes(b"x = '\xff'\n")
    elif how == "metadata-not-an-object":
        (pkg / "metadata.json").write_text("[]")
    elif how == "stateful-layer":  # TinyScale gets an __init__ taking an argument
        _edit_first(pkg / "layers.py", "    def forward(self, x):\n",
                    "    def __init__(self, n):\n        super().__init__()\n\n    def forward(self, x):\n")
    elif how == "no-backward-attribute":  # TinyScale loses has_backward
        _edit_first(pkg / "layers.py", "    has_backward = True\n", "")
    elif how == "named-build":
        (repo / "kernel.toml").write_text('name = "build"\nversion = 1\nlayers = ["TinyScale"]\n')
    return repo


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("missing-layer", r"layers \['Ghost'\] named in kernel.toml are not defined"),
        ("no-metadata", "missing metadata.json"),
        ("bad-toml-version", "`version` must be an int >= 1, got 'one'"),
        ("bad-variant-name", "'universal' is not a build variant name"),
        ("no-package", r"missing tiny/__init__\.py"),
        # what the loader or upload would get wrong, and what used to crash `check` itself
        ("two-packages", r"must hold exactly one package, tiny/.*\['other', 'tiny'\]"),
        ("symlinked-file", r"notes\.txt: a symlink"),
        ("symlinked-package", r"tiny: a symlink"),
        ("general-not-a-table", r"`general` must be a table"),
        ("non-utf8-layers", r"layers\.py: not valid UTF-8 Python"),
        ("metadata-not-an-object", r"metadata\.json: must hold a JSON object"),
        ("stateful-layer", r"layers\.TinyScale defines __init__"),
        ("no-backward-attribute", r"layers\.TinyScale\.has_backward must be True or False, got None"),
        ("named-build", r"`name` must be a Python identifier \(the package name\) other than 'build'"),
    ],
)
def test_check_reports_each_layout_problem(tmp_path, capsys, how, message):
    assert main(["check", str(_broken(tmp_path, how)), "--import"]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_check_reads_layers_defined_in_blocks_and_tuples(tmp_path, capsys):
    """Layer classes defined inside `if` / `try` blocks or by tuple assignment are defined."""
    repo = tiny_copy(tmp_path / "blocks")
    (repo / "build" / "torch-universal" / "tiny" / "layers.py").write_text(
        "from torch import nn\n\nfrom .ops import scale\n\n"
        "try:\n    import math\nexcept ImportError:\n    math = None\n\n"
        "if math is not None:\n"
        "    class TinyScale(nn.Module):\n        has_backward = True\n        can_torch_compile = True\n\n"
        "        def forward(self, x):\n            return scale(x)\n\n\n"
        "class _Double(nn.Module):\n    has_backward = True\n    can_torch_compile = True\n\n"
        "    def forward(self, x):\n        return scale(scale(x))\n\n\n"
        "TinyScaleDouble, _unused = _Double, None\n")
    assert main(["check", str(repo), "--import"]) == 0, capsys.readouterr().err


def test_upload_creates_branch_tag_and_prints_the_commit(hub, tmp_path, capsys):
    repo = tiny_copy(tmp_path / "tiny")
    assert main(["upload", str(repo), "--repo-id", "org/tiny"]) == 0
    commit = capsys.readouterr().out.strip()
    api = HfApi(endpoint=hub.url)
    refs = api.list_repo_refs("org/tiny", repo_type="kernel")
    assert {b.name: b.target_commit for b in refs.branches}["v1"] == commit
    assert {t.name: t.target_commit for t in refs.tags} == {"v1.0": commit}
    files = api.list_repo_files("org/tiny", repo_type="kernel", revision="v1")
    assert "kernel.toml" in files and "build/torch-universal/tiny/layers.py" in files
    assert not any("__pycache__" in f for f in files)
    # A second release of v1 with a file removed: new tag, stale file deleted.
    (repo / "build" / "torch-universal" / "tiny" / "metadata.json").rename(
        repo / "build" / "torch-universal" / "metadata.json"
    )
    assert main(["upload", str(repo), "--repo-id", "org/tiny", "--version", "1"]) == 0
    second = capsys.readouterr().out.strip()
    tags = {t.name: t.target_commit for t in api.list_repo_refs("org/tiny", repo_type="kernel").tags}
    assert tags == {"v1.0": commit, "v1.1": second}
    files = api.list_repo_files("org/tiny", repo_type="kernel", revision="v1")
    assert "build/torch-universal/metadata.json" in files
    assert "build/torch-universal/tiny/metadata.json" not in files


def test_upload_refuses_a_broken_repository(hub, tmp_path, capsys):
    assert main(["upload", str(_broken(tmp_path, "missing-layer")), "--repo-id", "org/tiny"]) == 1
    assert "fails `kernelhub check`" in capsys.readouterr().err
    assert not hub.store.repos  # nothing was created


@pytest.mark.parametrize("command", [["upload", str(TINY), "--repo-id", "tiny"], ["download", "tiny"],
                                     ["variants", "no spaces/allowed"]])
def test_a_bad_repo_id_is_named_before_any_request(hub, capsys, command):
    before = len(hub.store.requests)
    assert main(command) == 1
    assert "`repo_id` must look like 'org/name'" in capsys.readouterr().err
    assert len(hub.store.requests) == before and not hub.store.repos


def test_upload_private_model_type(hub, tmp_path, capsys):
    assert main(["upload", str(TINY), "--repo-id", "org/tiny", "--private", "--repo-type", "model"]) == 0
    repo = hub.store.repos[("model", "org/tiny")]
    assert repo.private and "v1" in repo.branches


def test_download_and_variants(hub, tmp_path, capsys):
    assert (
        main(
            [
                "upload",
                str(tiny_copy(tmp_path / "t", extra_variants={"torch27-cxx11-cu118-aarch64-linux": 3.0})),
                "--repo-id",
                "org/tiny",
            ]
        )
        == 0
    )
    commit = capsys.readouterr().out.strip()
    assert main(["download", "org/tiny", "--version", "1"]) == 0
    repo_id, ref, got, variant, path = capsys.readouterr().out.split()
    assert (repo_id, ref, got, variant) == ("org/tiny", "v1", commit, "torch-universal")
    assert (Path(path) / "tiny" / "layers.py").is_file()
    assert main(["variants", "org/tiny", "--version", "1"]) == 0
    out = capsys.readouterr().out
    assert "torch-universal: selected" in out
    assert "torch27-cxx11-cu118-aarch64-linux: rejected: platform aarch64-linux" in out
    assert main(["variants"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("torch-universal")


def test_download_from_config(hub, tmp_path, monkeypatch, capsys):
    main(["upload", str(TINY), "--repo-id", "org/tiny"])
    capsys.readouterr()
    (tmp_path / "kernelhub.toml").write_text('[layers.S]\nrepo = "org/tiny"\nversion = 1\n')
    monkeypatch.chdir(tmp_path)
    assert main(["download"]) == 0
    assert capsys.readouterr().out.startswith("org/tiny v1 ")


def test_errors_are_one_line_with_the_reason(hub, capsys):
    assert main(["download", "org/absent"]) == 1
    err = capsys.readouterr().err
    assert re.match(r"kernelhub download: error: (Hub)?KernelNotFoundError", err) and "'org/absent'" in err


def test_parser_builds_without_side_effects():
    parser = build_parser()
    args = parser.parse_args(["upload", "d", "--repo-id", "o/n", "--version", "3"])
    assert (args.command, args.version, args.private) == ("upload", 3, False)


def test_report_prints_what_each_module_gets_per_device(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 128,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    pins = tmp_path / "kernelhub.toml"
    pins.write_text(f'[layers.SwiGLUMLP]\npath = "{TINY}"\nlayer = "TinyScale"\n')
    argv = ["report", "--model-config", str(tmp_path / "config.json"), "--device", "cpu",
            "--kernelhub-config", str(pins)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "== cpu ==" in out
    assert out.count("mlp") >= 2  # both decoder layers' MLPs are listed
    assert "TinyScale" in out  # the config's choice reached kernelize


def test_report_for_a_capability_this_machine_need_not_have(tmp_path, capsys):
    pytest.importorskip("transformers")
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    pins = tmp_path / "kernelhub.toml"
    pins.write_text('[layers.SwiGLUMLP.capability."9.0"]\nlayer = "SwiGLUMLPReference"\n')
    argv = ["report", "--config", str(tmp_path / "config.json"), "--kernelhub-config", str(pins)]
    assert main([*argv, "--capability", "9.0", "--capability", "8.6"]) == 0
    out = capsys.readouterr().out
    sm90, sm86 = out.split("== a CUDA GPU of capability 8.6 ==")
    assert "== a CUDA GPU of capability 9.0 ==" in sm90
    rows90 = [line.split() for line in sm90.splitlines() if ".mlp" in line]
    rows86 = [line.split() for line in sm86.splitlines() if ".mlp" in line]
    assert len(rows90) == len(rows86) == 2
    assert all(r[4:6] == ["90", "SwiGLUMLPReference"] for r in rows90)  # the capability pin
    assert all(r[4:6] == ["86", "SwiGLUMLPSm80"] for r in rows86)  # the default mapping
    assert all(r[3] == "cuda:?" for r in rows90 + rows86)  # an assumed GPU, not a made-up index
    assert main([*argv, "--capability", "9"]) == 1
    assert "`--capability` must look like '9.0'" in capsys.readouterr().err
    absent = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
    assert main([*argv, "--device", absent]) == 1
    assert "--capability 9.0` reports for a GPU of that capability" in capsys.readouterr().err


KERNELS_REPO = Path(__file__).resolve().parents[1] / "kernels_repo"


@pytest.mark.parametrize("kernel", sorted(p.name for p in KERNELS_REPO.iterdir()) if KERNELS_REPO.is_dir() else [])
def test_bundled_kernel_repositories_pass_check(kernel, capsys):
    assert main(["check", str(KERNELS_REPO / kernel)]) == 0, capsys.readouterr().err


def test_bundled_swiglu_publishes_and_loads_from_the_hub(hub, tmp_path, monkeypatch):
    if not (KERNELS_REPO / "swiglu").is_dir():
        pytest.skip("kernels_repo/swiglu not on this branch")
    from kernelhub.hub import LayerRepository

    src = tmp_path / "swiglu"
    shutil.copytree(KERNELS_REPO / "swiglu", src, ignore=shutil.ignore_patterns("__pycache__"))
    assert main(["upload", str(src), "--repo-id", "kernels-community/swiglu"]) == 0
    layer = LayerRepository("kernels-community/swiglu", layer_name="SwiGLUMLPReference", version=1).load()
    assert layer.__name__ == "SwiGLUMLPReference" and "snapshots" in sys.modules[layer.__module__].__file__


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["report", "--config", "LIST", "--device", "cpu"], "`--config` .* must hold a JSON object"),
        (["report", "--model-type", "llama", "--device", "bogus"], r"`--device`: not a device: 'bogus'"),
        (["variants", "org/tiny", "--version", "0"], r"`version` must be an int >= 1"),
    ],
)
def test_bad_arguments_are_one_line_errors_naming_them(hub, tmp_path, capsys, argv, message):
    (tmp_path / "list.json").write_text("[1, 2]")
    argv = [str(tmp_path / "list.json") if a == "LIST" else a for a in argv]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert re.search(message, err), err


# --- option spellings: --kernelhub-config is the kernelhub config and --model-config a transformers config
# in every subcommand; --config, which meant either, still works with a deprecation note ------------------


@pytest.mark.parametrize(("argv", "dest"), [(["download"], "kernelhub_config"), (["lock"], "kernelhub_config"),
                                            (["report", "--model-type", "llama"], "kernelhub_config")])
def test_kernelhub_config_is_spelled_one_way_everywhere(argv, dest):
    assert getattr(build_parser().parse_args([*argv, "--kernelhub-config", "k.toml"]), dest) == "k.toml"


def test_the_earlier_config_spelling_keeps_its_meaning_with_a_note(capsys):
    parser = build_parser()
    assert parser.parse_args(["download", "--config", "k.toml"]).kernelhub_config == "k.toml"
    assert "`--config` is deprecated" in capsys.readouterr().err
    assert parser.parse_args(["lock", "--config", "k.toml"]).kernelhub_config == "k.toml"
    assert "use `--kernelhub-config`" in capsys.readouterr().err
    args = parser.parse_args(["report", "--config", "config.json"])  # report's meant the transformers config
    assert (args.model_config, args.kernelhub_config) == ("config.json", None)
    assert "use `--model-config`" in capsys.readouterr().err
    assert parser.parse_args(["report", "--model-config", "config.json"]).model_config == "config.json"
    assert capsys.readouterr().err == ""  # the current spelling: no note
    with pytest.raises(SystemExit):
        parser.parse_args(["report", "--config", "a.json", "--model-config", "b.json"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_download_and_lock_read_the_kernelhub_config_given(hub, tmp_path, monkeypatch, capsys):
    assert main(["upload", str(TINY), "--repo-id", "org/tiny"]) == 0
    config = tmp_path / "project" / "kernelhub.toml"
    config.parent.mkdir()
    config.write_text('[layers.S]\nrepo = "org/tiny"\nversion = 1\n')
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # no config here: only the option names it
    capsys.readouterr()
    for spelling in ("--kernelhub-config", "--config"):
        assert main(["download", spelling, str(config)]) == 0
        captured = capsys.readouterr()
        assert captured.out.startswith("org/tiny v1 ")
        assert ("deprecated" in captured.err) == (spelling == "--config")
        assert main(["lock", spelling, str(config)]) == 0
        assert (config.parent / "kernels.lock").is_file()  # written next to the config
        (config.parent / "kernels.lock").unlink()
        capsys.readouterr()


def test_report_model_config_that_is_not_json_names_the_option(tmp_path, capsys):
    pytest.importorskip("transformers")
    (tmp_path / "deep.json").write_text("[" * 200_000 + "]" * 200_000)
    (tmp_path / "latin1.json").write_bytes(b'{"model_type": "caf\xe9"}')
    assert main(["report", "--model-config", str(tmp_path / "deep.json"), "--device", "cpu"]) == 1
    assert "`--model-config` " in (err := capsys.readouterr().err) and "not valid JSON: nested too deeply" in err
    assert main(["report", "--config", str(tmp_path / "latin1.json"), "--device", "cpu"]) == 1
    assert "`--config` " in (err := capsys.readouterr().err) and "not valid UTF-8 JSON" in err
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    assert main(["report", "--checkpoint", str(tmp_path / "ckpt"), "--device", "cpu"]) == 1
    assert "`--checkpoint` " in (err := capsys.readouterr().err) and "nested too deeply" in err
