"""`kernelhub build`, and `check` / `upload` on kernel-builder's layout (source in torch-ext/<name>/):
what a build writes, stale builds, and links or hostile manifests refused everywhere."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from hub_server import TINY, hub_fixture  # noqa: F401 - hub_fixture provides `hub`
from huggingface_hub import HfApi

from kernelhub._loader import load_kernel_from_dir
from kernelhub.cli import main
from kernelhub.cli._files import read_file

TINY_PKG = TINY / "build" / "torch-universal" / "tiny"
SOURCE_FILES = ["__init__.py", "layers.py", "ops.py"]


def source_repo(dest: Path) -> Path:
    """The tiny kernel laid out as kernel-builder lays out a source repository: torch-ext/tiny/, no build/."""
    dest.mkdir(parents=True)
    for name in ("kernel.toml", "README.md"):
        shutil.copy(TINY / name, dest / name)
    (dest / "torch-ext" / "tiny").mkdir(parents=True)
    for name in SOURCE_FILES:
        shutil.copy(TINY_PKG / name, dest / "torch-ext" / "tiny" / name)
    return dest


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_build_writes_the_package_kernel_toml_and_metadata(tmp_path, capsys):
    repo = source_repo(tmp_path / "tiny")
    (repo / "torch-ext" / "tiny" / "__pycache__").mkdir()
    (repo / "torch-ext" / "tiny" / "__pycache__" / "ops.cpython-311.pyc").write_bytes(b"\0")
    (repo / "torch-ext" / "tiny" / ".ops.py.swp").write_bytes(b"\0")
    assert main(["build", str(repo)]) == 0, capsys.readouterr().err
    variant = repo / "build" / "torch-universal"
    assert capsys.readouterr().out.strip() == str(variant)
    built = tree(variant)
    want = {f"tiny/{name}": (TINY_PKG / name).read_bytes() for name in SOURCE_FILES}
    want["tiny/kernel.toml"] = (repo / "kernel.toml").read_bytes()
    meta = json.loads(built.pop("metadata.json"))
    assert built == want  # no bytecode, no hidden file
    # kernel-builder's fields, in the variant directory where HF `kernels` reads them
    assert meta == {"name": "tiny", "id": meta["id"], "version": 1, "license": "unknown", "python-depends": [],
                    "backend": {"type": "cuda"}}
    assert meta["id"].startswith("_tiny_universal_") and meta["id"].isidentifier()
    assert main(["check", str(repo), "--import"]) == 0, capsys.readouterr().err
    assert "ok: tiny v1" in capsys.readouterr().out
    assert load_kernel_from_dir(repo).scale.__module__.endswith(".ops")  # the built package loads
    assert oct(variant.stat().st_mode & 0o777) == oct(0o777 & ~_umask())  # not mkdtemp's 0700


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_metadata_id_follows_the_content_and_license_comes_from_kernel_toml(tmp_path, capsys):
    repo = source_repo(tmp_path / "tiny")
    assert main(["build", str(repo)]) == 0
    first = json.loads((repo / "build" / "torch-universal" / "metadata.json").read_text())
    assert main(["build", str(repo)]) == 0  # the same source builds the same bytes
    assert json.loads((repo / "build" / "torch-universal" / "metadata.json").read_text()) == first
    with (repo / "torch-ext" / "tiny" / "ops.py").open("a") as f:
        f.write("# edited\n")
    (repo / "kernel.toml").write_text((repo / "kernel.toml").read_text().replace(
        'version = 1\n', 'version = 1\nlicense = "Apache-2.0"\n'))
    assert main(["build", str(repo)]) == 0
    second = json.loads((repo / "build" / "torch-universal" / "metadata.json").read_text())
    assert second["id"] != first["id"] and second["license"] == "Apache-2.0"
    (repo / "kernel.toml").write_text((repo / "kernel.toml").read_text().replace('"Apache-2.0"', "3"))
    assert main(["check", str(repo)]) == 2
    assert "`license` must be a license identifier" in capsys.readouterr().err


def test_rebuild_replaces_only_the_universal_variant(tmp_path, capsys):
    repo = source_repo(tmp_path / "tiny")
    assert main(["build", str(repo)]) == 0
    (repo / "build" / "torch-universal" / "tiny" / "removed_since.py").write_text("x = 1\n")
    compiled = repo / "build" / "torch27-cxx11-cu128-x86_64-linux"
    shutil.copytree(repo / "build" / "torch-universal", compiled)
    assert main(["build", str(repo)]) == 0
    assert not (repo / "build" / "torch-universal" / "tiny" / "removed_since.py").exists()
    assert (compiled / "tiny" / "removed_since.py").is_file()  # another variant is not build's output
    assert sorted(p.name for p in repo.iterdir()) == ["README.md", "build", "kernel.toml", "torch-ext"]


def test_a_failed_build_leaves_the_previous_build_whole(tmp_path, capsys):
    repo = source_repo(tmp_path / "tiny")
    assert main(["build", str(repo)]) == 0
    before = tree(repo / "build")
    (repo / "torch-ext" / "tiny" / "secret.txt").symlink_to(tmp_path / "elsewhere.txt")
    (tmp_path / "elsewhere.txt").write_text("not for publishing")
    capsys.readouterr()
    assert main(["build", str(repo)]) == 1
    assert "secret.txt: a symlink" in capsys.readouterr().err
    assert tree(repo / "build") == before
    assert sorted(p.name for p in repo.iterdir()) == ["README.md", "build", "kernel.toml", "torch-ext"]


def test_build_output_elsewhere_and_a_hub_style_repository_is_not_built(tmp_path, capsys):
    repo = source_repo(tmp_path / "tiny")
    assert main(["build", str(repo), "--output", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "torch-universal" / "tiny" / "kernel.toml").is_file()
    assert not (repo / "build").exists()
    assert main(["build", str(TINY)]) == 1  # build/ only: already built
    assert "has no source torch-ext/tiny/ to build" in capsys.readouterr().err


def test_check_of_a_source_without_build_passes_and_says_so(tmp_path, capsys):
    repo = source_repo(tmp_path / "tiny")
    assert main(["check", str(repo), "--import"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "note: no build/ yet" in out and "kernelhub build" in out and "ok: tiny v1" in out


def test_check_refuses_a_stale_build(tmp_path, capsys):
    repo = source_repo(tmp_path / "tiny")
    assert main(["build", str(repo)]) == 0
    with (repo / "torch-ext" / "tiny" / "ops.py").open("a") as f:
        f.write("# edited after the build\n")
    assert main(["check", str(repo)]) == 2
    err = capsys.readouterr().err
    assert "torch-universal: stale" in err and "tiny/ops.py" in err and "run `kernelhub build" in err
    (repo / "build" / "torch-universal").rename(repo / "build" / "torch-cuda")
    assert main(["check", str(repo)]) == 2
    assert "has no torch-universal/ built from torch-ext/" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("missing-layer", r"layers \['Ghost'\] named in kernel.toml are not defined"),
        ("metadata-in-source", "`kernelhub build` writes metadata.json; remove it from the source"),
        ("other-kernel-toml", r"tiny/kernel.toml: differs from .*kernel.toml"),
        ("two-packages", r"must hold exactly one package, tiny/.*\['other', 'tiny'\]"),
        ("wrong-package", r"torch-ext: missing tiny/__init__\.py"),
        ("nothing", r"no source \(torch-ext/tiny/\) and no build"),
    ],
)
def test_check_reports_each_source_problem(tmp_path, capsys, how, message):
    repo = source_repo(tmp_path / "tiny")
    pkg = repo / "torch-ext" / "tiny"
    if how == "missing-layer":
        (repo / "kernel.toml").write_text('name = "tiny"\nversion = 1\nlayers = ["TinyScale", "Ghost"]\n')
    elif how == "metadata-in-source":
        (pkg / "metadata.json").write_text("{}")
    elif how == "other-kernel-toml":
        (pkg / "kernel.toml").write_text('name = "tiny"\nversion = 2\nlayers = ["TinyScale"]\n')
    elif how == "two-packages":
        shutil.copytree(pkg, pkg.parent / "other")
    elif how == "wrong-package":
        pkg.rename(pkg.parent / "other")
    elif how == "nothing":
        shutil.rmtree(repo / "torch-ext")
    assert main(["check", str(repo)]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert main(["build", str(repo)]) == 1  # build checks the source first
    assert "fails `kernelhub check`" in capsys.readouterr().err and not (repo / "build").exists()


# --- links: nothing is read through one, so nothing outside the repository is published ---------------

SECRET = "root:x:0:0:secret-outside-the-repository\n"


def _plant_link(repo: Path, where: str, target: Path) -> None:
    path = repo / where
    if path.exists():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


LINK_PLACES = ["LICENSE", "README.md", "kernel.toml", "torch-ext/tiny/notes.txt", "torch-ext/tiny/.hidden",
               "torch-ext/tiny/sub", "build/torch-universal/tiny/LICENSE", "build"]


@pytest.mark.parametrize("where", LINK_PLACES)
def test_check_and_upload_refuse_a_link_anywhere_they_read(hub, tmp_path, capsys, where):
    secret = tmp_path / "passwd"
    secret.write_text(SECRET)
    target = tmp_path / "outside_dir" if where in ("torch-ext/tiny/sub", "build") else secret
    if target != secret:
        target.mkdir()
        (target / "passwd").write_text(SECRET)
    repo = source_repo(tmp_path / "tiny")
    if where.startswith("build/"):
        assert main(["build", str(repo)]) == 0
        capsys.readouterr()
    _plant_link(repo, where, target)
    assert main(["check", str(repo)]) == 2
    assert f"{repo / where}: a symlink" in capsys.readouterr().err
    assert main(["upload", str(repo), "--repo-id", "org/tiny"]) == 1
    assert f"{repo / where}: a symlink" in capsys.readouterr().err
    assert not hub.store.repos
    blobs = list((hub.store.root / "blobs").iterdir())
    assert not any(SECRET.encode() in b.read_bytes() for b in blobs)


def test_a_linked_license_beside_a_hub_style_build_is_refused_too(hub, tmp_path, capsys):
    """A repository with build/ only (no source) is checked and staged the same way."""
    (tmp_path / "passwd").write_text(SECRET)
    repo = tmp_path / "tiny"
    shutil.copytree(TINY, repo)
    (repo / "LICENSE").symlink_to(tmp_path / "passwd")
    assert main(["check", str(repo)]) == 2
    assert "LICENSE: a symlink" in capsys.readouterr().err
    assert main(["upload", str(repo), "--repo-id", "org/tiny"]) == 1 and not hub.store.repos


def test_a_fifo_is_refused_without_hanging(tmp_path, capsys):
    repo = source_repo(tmp_path / "tiny")
    os.mkfifo(repo / "torch-ext" / "tiny" / "pipe")
    os.mkfifo(repo / "LICENSE")
    assert main(["check", str(repo)]) == 2
    err = capsys.readouterr().err
    assert "pipe: not a regular file or directory" in err and "LICENSE: not a regular file" in err


def test_a_link_swapped_in_after_the_scan_is_not_followed(tmp_path):
    """Reads open each path component with O_NOFOLLOW: a directory replaced by a link between
    `check` and the copy is refused, not read through."""
    repo = source_repo(tmp_path / "tiny")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "ops.py").write_text(SECRET)
    assert read_file(repo, "torch-ext/tiny/ops.py") == (TINY_PKG / "ops.py").read_bytes()
    shutil.rmtree(repo / "torch-ext" / "tiny")
    (repo / "torch-ext" / "tiny").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"torch-ext/tiny: a symlink"):
        read_file(repo, "torch-ext/tiny/ops.py")


# --- hostile manifests: a clean problem each, never a crash -----------------------------------------------

DEEP = 200_000


HOSTILE = {  # id: (file, content, the problem reported)
    "deep-metadata-array": ("build/torch-universal/metadata.json", "[" * DEEP + "]" * DEEP,
                            "metadata.json: not valid JSON: nested too deeply"),
    "deep-metadata-object": ("build/torch-universal/metadata.json", '{"a":' * (DEEP // 2) + "1" + "}" * (DEEP // 2),
                             "metadata.json: not valid JSON: nested too deeply"),
    "metadata-version": ("build/torch-universal/metadata.json", '{"version": 2}',
                         r"`version` 2 differs from kernel.toml's 1"),
    "metadata-depends": ("build/torch-universal/metadata.json", '{"python-depends": "einops"}',
                         "`python-depends` must be a list"),
    "deep-kernel-toml": ("kernel.toml", "x = " + "[" * DEEP + "]" * DEEP,
                         "kernel.toml: not valid TOML: nested too deeply"),
    "huge-kernel-toml": ("kernel.toml", 'name = "tiny"\n#' + "x" * (1 << 20), "kernel.toml: larger than 1048576 bytes"),
    "deep-layers": ("build/torch-universal/tiny/layers.py", "x = a" + ".b" * DEEP,
                    "layers.py: not valid Python: nested too deeply"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_manifests_are_check_problems(tmp_path, capsys, case):
    where, content, message = HOSTILE[case]
    repo = tmp_path / "tiny"
    shutil.copytree(TINY, repo)  # a Hub-style repository: what a downloaded one looks like
    (repo / where).write_text(content)
    assert main(["check", str(repo)]) == 2
    assert re.search(message, capsys.readouterr().err)


# --- upload builds first ------------------------------------------------------------------------------------


def test_upload_builds_the_source_and_leaves_the_directory_unchanged(hub, tmp_path, capsys):
    repo = source_repo(tmp_path / "tiny")
    (repo / "LICENSE").write_text("Apache-2.0\n")
    before = tree(repo)
    assert main(["upload", str(repo), "--repo-id", "org/tiny"]) == 0, capsys.readouterr().err
    assert tree(repo) == before and not (repo / "build").exists()
    files = HfApi(endpoint=hub.url).list_repo_files("org/tiny", repo_type="kernel", revision="v1")
    assert sorted(f for f in files if f != ".gitattributes") == sorted(  # (the Hub's own file)
        ["LICENSE", "README.md", "kernel.toml", "build/torch-universal/metadata.json",
         "build/torch-universal/tiny/kernel.toml"] + [f"build/torch-universal/tiny/{n}" for n in SOURCE_FILES]
    )
    from kernelhub.hub import LayerRepository

    layer = LayerRepository("org/tiny", layer_name="TinyScale", version=1, trust_remote_code=True).load()
    assert "snapshots" in sys.modules[layer.__module__].__file__


def test_a_build_loads_with_hugging_face_kernels(tmp_path):
    """HF `kernels` 0.17 (the dev extra) reads the metadata `kernelhub build` writes."""
    kernels = pytest.importorskip("kernels")
    if not kernels.__version__.startswith("0.17."):
        pytest.skip(f"compatibility is checked against kernels 0.17, found {kernels.__version__}")
    repo = source_repo(tmp_path / "tiny")
    assert main(["build", str(repo)]) == 0
    module = kernels.get_local_kernel(repo, trust_remote_code=True)
    assert module.scale.__module__.endswith(".ops")
    loaded = kernels.get_loaded_kernels()[-1].metadata
    meta = json.loads((repo / "build" / "torch-universal" / "metadata.json").read_text())
    assert (loaded.id, str(loaded.name), loaded.version) == (meta["id"], "tiny", 1)


def test_upload_with_a_client_that_cannot_upload_to_kernel_repositories_is_refused_first(hub, tmp_path, capsys,
                                                                                        monkeypatch):
    """huggingface_hub 1.10-2.2 (transformers 5.17's) load `kernel` repositories but cannot upload to one."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "__version__", "1.33.0")
    before = len(hub.store.requests)
    assert main(["upload", str(TINY), "--repo-id", "org/tiny"]) == 1
    err = capsys.readouterr().err
    assert "huggingface_hub 1.33.0 cannot upload to a `kernel` repository (2.3 and later can)" in err
    assert len(hub.store.requests) == before and not hub.store.repos
    assert main(["upload", str(TINY), "--repo-id", "org/tiny", "--repo-type", "model"]) == 0


KERNELS_REPO = Path(__file__).resolve().parents[1] / "kernels_repo"


@pytest.mark.parametrize("kernel", sorted(p.name for p in KERNELS_REPO.iterdir()) if KERNELS_REPO.is_dir() else [])
def test_bundled_kernel_repositories_build_and_their_build_passes_check(kernel, tmp_path, capsys):
    repo = tmp_path / kernel
    shutil.copytree(KERNELS_REPO / kernel, repo, ignore=shutil.ignore_patterns("__pycache__", "build"))
    assert main(["build", str(repo)]) == 0, capsys.readouterr().err
    assert main(["check", str(repo)]) == 0, capsys.readouterr().err
    meta = json.loads((repo / "build" / "torch-universal" / "metadata.json").read_text())
    assert (meta["name"], meta["version"], meta["license"]) == (kernel, 1, "Apache-2.0")
