"""kernels.lock: resolved commits and per-file sha256, verified on load."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest
import torch
from hub_server import TINY, hub_fixture, tiny_copy  # noqa: F401 - hub_fixture provides `hub`

from kernelhub.cli import main
from kernelhub.cli.upload import upload_kernel
from kernelhub.hub import LockedLayerRepository
from kernelhub.lock import KernelLockError, get_locked_kernel, lock_kernel, read_lockfile, write_lockfile


def _publish(tmp_path: Path, repo_id: str, *, version: int = 1, factor: float = 2.0) -> str:
    src = tiny_copy(tmp_path / f"src-{repo_id.replace('/', '-')}-{version}-{factor}", factor=factor)
    return upload_kernel(src, repo_id, version=version)[2]


def _scale_of(kernel) -> float:
    return float(kernel.scale(torch.ones(1))[0])


def _write_v1(entries: list[dict], path: Path) -> Path:
    """A lock file in kernelhub's earlier format (still read)."""
    path.write_text(json.dumps({"lockfile_version": 1, "kernels": entries}))
    return path


def test_lock_records_commit_and_sha256_of_every_variant_file(hub, tmp_path):
    commit = _publish(tmp_path, "org/tiny")
    entry = lock_kernel("org/tiny", version=1)
    assert entry["commit"] == commit and entry["version"] == 1
    files = entry["variants"]["torch-universal"]
    source = TINY / "build" / "torch-universal"
    expected_names = {
        f"build/torch-universal/{p.relative_to(source).as_posix()}"
        for p in source.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert set(files) == expected_names
    init = (source / "tiny" / "__init__.py").read_bytes()
    assert files["build/torch-universal/tiny/__init__.py"] == hashlib.sha256(init).hexdigest()


def test_lock_without_a_version_records_the_branch_it_resolved_to(hub, tmp_path):
    _publish(tmp_path, "org/tiny", version=1)
    newest = _publish(tmp_path, "org/tiny", version=2, factor=2.0)
    entry = lock_kernel("org/tiny")
    assert entry["version"] is None and entry["ref"] == "v2" and entry["commit"] == newest
    assert lock_kernel("org/tiny", version=1)["ref"] == "v1"


def test_locked_kernel_loads_the_locked_commit_after_the_branch_moves(hub, tmp_path):
    _publish(tmp_path, "untrusted/tiny", factor=2.0)
    lockfile = write_lockfile([lock_kernel("untrusted/tiny", version=1)], tmp_path / "kernels.lock")
    _publish(tmp_path, "untrusted/tiny", factor=4.0)  # v1 now points elsewhere
    # A lock is the user's review of that code: no trust_remote_code needed.
    assert _scale_of(get_locked_kernel("untrusted/tiny", lockfile=lockfile)) == 2.0
    layer = LockedLayerRepository("untrusted/tiny", layer_name="TinyScale", lockfile=lockfile).load()
    assert float(layer()(torch.ones(1))[0]) == 2.0


def test_tampered_file_is_refused_naming_it(hub, tmp_path):
    _publish(tmp_path, "org/tiny")
    lockfile = write_lockfile([lock_kernel("org/tiny", version=1)], tmp_path / "kernels.lock")
    kernel = get_locked_kernel("org/tiny", lockfile=lockfile)
    ops = kernel.__kernelhub_source__.path / "tiny" / "ops.py"
    real = ops.resolve()  # the cache stores the file as a blob behind a symlink
    real.write_text(real.read_text() + "\nimport os  # injected\n")
    with pytest.raises(KernelLockError, match=r"sha256 of build/torch-universal/tiny/ops\.py .*refusing"):
        get_locked_kernel("org/tiny", lockfile=lockfile)


def test_unlocked_extra_file_is_refused_naming_it(hub, tmp_path):
    _publish(tmp_path, "org/tiny")
    lockfile = write_lockfile([lock_kernel("org/tiny", version=1)], tmp_path / "kernels.lock")
    path = get_locked_kernel("org/tiny", lockfile=lockfile).__kernelhub_source__.path
    (path / "tiny" / "evil.py").write_text("x = 1\n")
    with pytest.raises(KernelLockError, match=r"build/torch-universal/tiny/evil\.py is not in the lock"):
        LockedLayerRepository("org/tiny", layer_name="TinyScale", lockfile=lockfile).load()


def test_lock_errors_name_the_problem(hub, tmp_path):
    with pytest.raises(KernelLockError, match="does not exist.*kernelhub lock"):
        read_lockfile(tmp_path / "missing.lock")
    (tmp_path / "bad.lock").write_text("{not json")
    with pytest.raises(KernelLockError, match="not valid JSON"):
        read_lockfile(tmp_path / "bad.lock")
    lockfile = write_lockfile([], tmp_path / "empty.lock")
    with pytest.raises(KernelLockError, match="no entry for 'org/tiny'"):
        get_locked_kernel("org/tiny", lockfile=lockfile)


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"variants": "torch-universal"}, r"`variants` must map variant names"),
        ({"variants": ["torch-universal"]}, r"`variants` must map variant names"),
        ({"variants": {"torch-universal": {"build/x.py": 5}}}, r"`variants\.torch-universal` must map"),
        ({"commit": 1234}, r"`commit` must be a full 40-hex-digit"),
        ({"commit": "abc123"}, r"`commit` must be a full 40-hex-digit"),
        ({"repo_type": 7}, r"`repo_type` must be a non-empty string"),
        ({"version": "1"}, r"`version` must be an int or null"),
    ],
)
def test_a_malformed_lock_entry_is_a_lock_error_naming_the_field(hub, tmp_path, change, pattern):
    _publish(tmp_path, "org/tiny")
    entry = {**lock_kernel("org/tiny", version=1), **change}
    lockfile = _write_v1([entry], tmp_path / "kernels.lock")
    with pytest.raises(KernelLockError, match=rf"entry 0 \('org/tiny'\): {pattern}"):
        get_locked_kernel("org/tiny", lockfile=lockfile)


def test_a_planted_bytecode_file_cannot_replace_the_locked_source(hub, tmp_path):
    """The lock hashes sources; Python would run a `__pycache__/*.pyc` instead of its source (an
    unchecked-hash one without even comparing). Kernel modules are compiled from source only."""
    import py_compile
    import sys

    _publish(tmp_path, "org/tiny", factor=2.0)
    lockfile = write_lockfile([lock_kernel("org/tiny", version=1)], tmp_path / "kernels.lock")
    sources = sorted((tmp_path / "cache").rglob("build/torch-universal/tiny/ops.py"))
    assert sources, "the locked download is in the cache"
    ops = sources[0]
    evil = tmp_path / "evil.py"
    evil.write_text(ops.read_text().replace("FACTOR = 2.0", "FACTOR = 1000.0"))
    assert "FACTOR = 1000.0" in evil.read_text()
    package = ops.parent
    pyc = package / "__pycache__" / f"ops.{sys.implementation.cache_tag}.pyc"
    py_compile.compile(str(evil), cfile=str(pyc), dfile=str(ops),
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    assert _scale_of(get_locked_kernel("org/tiny", lockfile=lockfile)) == 2.0
    assert not any(p != pyc for p in package.rglob("*.pyc"))  # and loading wrote no bytecode there


def test_cli_lock_writes_the_config_kernels(hub, tmp_path, monkeypatch, capsys):
    c1 = _publish(tmp_path, "org/tiny", version=1, factor=2.0)
    c2 = _publish(tmp_path, "org/tiny", version=2, factor=3.0)
    (tmp_path / "kernelhub.toml").write_text(
        '[layers.Scale]\nrepo = "org/tiny"\nversion = 1\nlayer = "TinyScale"\n'
        '[layers.Scale.capability."9.0"]\nversion = 2\n'
    )
    monkeypatch.chdir(tmp_path)
    assert main(["lock"]) == 0
    data = json.loads((tmp_path / "kernels.lock").read_text())  # the `kernels` 0.17 format
    commits = {(e["dependency"]["repo-id"], e["dependency"]["version"]): e["lock"]["commit"] for e in data}
    assert commits == {("org/tiny", 1): c1, ("org/tiny", 2): c2}
    files = json.loads((tmp_path / "kernels.lock.sha256").read_text())["kernels"]  # kernelhub's per-file hashes
    assert {(e["repo_id"], e["version"]): e["commit"] for e in files} == commits
    assert "wrote" in capsys.readouterr().out
    # Several entries for one repo: the version chooses.
    assert _scale_of(get_locked_kernel("org/tiny", lockfile=tmp_path / "kernels.lock", version=2)) == 3.0
    with pytest.raises(KernelLockError, match="2 entries for 'org/tiny'"):
        get_locked_kernel("org/tiny", lockfile=tmp_path / "kernels.lock")


def test_extra_variants_are_locked_beside_this_systems(hub, tmp_path):
    foreign = "torch27-cxx11-cu118-aarch64-linux"
    src = tiny_copy(tmp_path / "src", extra_variants={foreign: 3.0})
    upload_kernel(src, "org/tiny", version=1)
    entry = lock_kernel("org/tiny", version=1, variants=[foreign])
    assert sorted(entry["variants"]) == sorted(["torch-universal", foreign])
    ops = f"build/{foreign}/tiny/ops.py"
    assert entry["variants"][foreign][ops] == hashlib.sha256((src / ops).read_bytes()).hexdigest()


# -- what a locked load may import (issue 30) ------------------------------------------------------
_EVIL_OPS = "def scale(x):\n    return x * 1000.0\n"


def _locked(hub, tmp_path) -> tuple[Path, Path]:
    _publish(tmp_path, "org/tiny", factor=2.0)
    lockfile = write_lockfile([lock_kernel("org/tiny", version=1)], tmp_path / "kernels.lock")
    package = sorted((tmp_path / "cache").rglob("build/torch-universal/tiny"))[0]
    return lockfile, package


def test_a_linked_package_planted_beside_a_locked_module_is_refused(hub, tmp_path):
    """A symlinked `ops/` (with an __init__.py) beside the locked `ops.py` was verified and imported
    (the scan did not descend into linked directories, and a package beats a module)."""
    lockfile, package = _locked(hub, tmp_path)
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "__init__.py").write_text(_EVIL_OPS)
    (package / "ops").symlink_to(planted, target_is_directory=True)
    with pytest.raises(KernelLockError, match=r"build/torch-universal/tiny/ops is a link to .*planted"):
        get_locked_kernel("org/tiny", lockfile=lockfile)


@pytest.mark.parametrize("plant", ["empty_dir", "dir_with_init", "file_link", "fifo"])
def test_anything_unlisted_in_a_locked_variant_is_refused(hub, tmp_path, plant):
    import os

    lockfile, package = _locked(hub, tmp_path)
    if plant == "empty_dir":  # a namespace package candidate
        (package / "ops2").mkdir()
        pattern = r"directory build/torch-universal/tiny/ops2 holds no locked file"
    elif plant == "dir_with_init":
        (package / "ops").mkdir()
        (package / "ops" / "__init__.py").write_text(_EVIL_OPS)
        pattern = r"file build/torch-universal/tiny/ops/__init__\.py is not in the lock"
    elif plant == "file_link":  # the locked bytes, but through a link leaving the cache's blobs/
        copy = tmp_path / "ops_copy.py"
        copy.write_bytes((package / "ops.py").read_bytes())
        (package / "ops.py").unlink()
        (package / "ops.py").symlink_to(copy)
        pattern = r"tiny/ops\.py is a link to .*ops_copy\.py"
    else:
        os.mkfifo(package / "pipe")
        pattern = r"tiny/pipe is neither a file nor a directory"
    with pytest.raises(KernelLockError, match=pattern):
        get_locked_kernel("org/tiny", lockfile=lockfile)


def test_a_locked_import_cannot_pick_up_a_file_planted_after_verification(hub, tmp_path):
    """Verification and import are two steps: the import itself takes only verified files, and
    checks each one's sha256 as it reads it."""
    from kernelhub._loader import load_kernel_from_dir
    from kernelhub.lock import hash_variant

    _lockfile, package = _locked(hub, tmp_path)
    variant = package.parent
    verified = {name.removeprefix("build/torch-universal/"): digest
                for name, digest in hash_variant(variant, blobs=variant.parents[3] / "blobs").items()}
    (package / "ops").mkdir()  # planted after the check: a package would beat ops.py
    (package / "ops" / "__init__.py").write_text(_EVIL_OPS)
    assert _scale_of(load_kernel_from_dir(variant, verified=verified)) == 2.0
    # a verified file swapped before it is read
    layers = (package / "layers.py").resolve()
    layers.write_text(layers.read_text() + "\nEVIL = 1\n")
    other_lock = {**verified, "tiny/extra.py": "0" * 64}  # another lock: imported afresh, not from sys.modules
    with pytest.raises(KernelLockError, match=r"layers\.py: sha256 .* is not the locked one"):
        load_kernel_from_dir(variant, verified=other_lock)


def test_a_lock_file_that_is_not_utf8_is_a_lock_error(tmp_path):
    (tmp_path / "kernels.lock").write_bytes(b'{"lockfile_version": 1, "kernels": [\xff\xfe]}')
    with pytest.raises(KernelLockError, match="kernels.lock is not UTF-8 text"):
        read_lockfile(tmp_path / "kernels.lock")


def test_a_deeply_nested_lock_file_is_a_lock_error(tmp_path):
    (tmp_path / "kernels.lock").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(KernelLockError, match="not valid JSON"):
        read_lockfile(tmp_path / "kernels.lock")


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"variants": {"..": {"build/../x.py": "0" * 64}}}, r"`variants` has '\.\.'"),
        ({"variants": {"torch-universal": {"build/torch-universal/../../x.py": "0" * 64}}}, "not a plain path"),
        ({"revision": "../../etc"}, r"`revision`: .* is not a valid git revision"),
        ({"repo_id": "org/a..b"}, r"is not a valid Hub id"),
    ],
)
def test_paths_and_names_in_a_lock_entry_are_checked(tmp_path, change, pattern):
    entry = {"repo_id": "org/tiny", "repo_type": "kernel", "commit": "0" * 40,
             "variants": {"torch-universal": {"build/torch-universal/tiny/__init__.py": "0" * 64}}, **change}
    lockfile = _write_v1([entry], tmp_path / "kernels.lock")
    with pytest.raises(KernelLockError, match=pattern):
        read_lockfile(lockfile)


# -- the lock formats of Hugging Face kernels ------------------------------------------------------
def _legacy_kernels_lock(hub, repo_id: str, commit: str) -> list[dict]:
    """An older `kernels` lock, its git_lfs_concat variant hash computed as `kernels` computed it:
    from the Hub's listing (git blob ids, LFS sha256), not from files on disk."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    files: dict[str, list] = {}
    for f in HfApi(endpoint=hub.url).list_repo_tree(repo_id, repo_type="kernel", revision=commit, recursive=True):
        if isinstance(f, RepoFile) and f.path.startswith("build/torch"):
            variant, rel = f.path.split("/")[1], "/".join(f.path.split("/")[2:])
            files.setdefault(variant, []).append((rel.encode(), f.lfs.sha256 if f.lfs else f.blob_id))
    variants = {}
    for variant, entries in files.items():
        m = hashlib.sha256()
        for rel, digest in sorted(entries):
            m.update(rel)
            m.update(bytes.fromhex(digest))
        variants[variant] = {"hash": f"sha256-{m.hexdigest()}", "hash_type": "git_lfs_concat"}
    return [{"repo_id": repo_id, "sha": commit, "variants": variants}]


def test_an_older_kernels_lock_is_verified_by_its_variant_hash(hub, tmp_path):
    commit = _publish(tmp_path, "org/tiny", factor=2.0)
    lockfile = tmp_path / "kernels.lock"
    lockfile.write_text(json.dumps(_legacy_kernels_lock(hub, "org/tiny", commit)))
    _publish(tmp_path, "org/tiny", factor=4.0)
    kernel = get_locked_kernel("org/tiny", lockfile=lockfile)
    assert _scale_of(kernel) == 2.0
    ops = (kernel.__kernelhub_source__.path / "tiny" / "ops.py").resolve()
    ops.write_text(ops.read_text().replace("FACTOR = 2.0", "FACTOR = 9.0"))
    with pytest.raises(KernelLockError, match=r"git_lfs_concat hash of build/torch-universal/ is .* the lock says"):
        get_locked_kernel("org/tiny", lockfile=lockfile)


def test_a_commit_only_lock_still_imports_nothing_unlisted(hub, tmp_path):
    """A `kernels` 0.17 lock pins the commit only: the files are those of that commit as downloaded,
    and links or planted packages are refused as for any locked load."""
    commit = _publish(tmp_path, "org/tiny", factor=2.0)
    lockfile = tmp_path / "kernels.lock"
    lockfile.write_text(json.dumps([{"dependency": {"repo-id": "org/tiny", "version": 1},
                                     "lock": {"commit": commit}}]))
    kernel = get_locked_kernel("org/tiny", lockfile=lockfile, version=1)
    assert _scale_of(kernel) == 2.0
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "__init__.py").write_text(_EVIL_OPS)
    (kernel.__kernelhub_source__.path / "tiny" / "ops").symlink_to(planted, target_is_directory=True)
    with pytest.raises(KernelLockError, match=r"tiny/ops is a link"):
        get_locked_kernel("org/tiny", lockfile=lockfile)


def test_kernelhub_writes_the_kernels_format_and_its_file_hashes_beside_it(hub, tmp_path):
    commit = _publish(tmp_path, "org/tiny")
    lockfile = write_lockfile([lock_kernel("org/tiny", version=1), lock_kernel("org/tiny")], tmp_path / "k.lock")
    assert json.loads(lockfile.read_text()) == [
        {"dependency": {"repo-id": "org/tiny", "revision": "v1"}, "lock": {"commit": commit}},
        {"dependency": {"repo-id": "org/tiny", "version": 1}, "lock": {"commit": commit}},
    ]
    (entry, _), = [(e, 0) for e in read_lockfile(lockfile) if e["version"] == 1]
    assert entry["variants"]["torch-universal"]["build/torch-universal/tiny/ops.py"]
    Path(f"{lockfile}.sha256").unlink()  # without kernelhub's hashes: the commit still pins
    assert _scale_of(get_locked_kernel("org/tiny", lockfile=lockfile, version=1)) == 2.0


# -- as Hugging Face `kernels` does it (issue 29) ----------------------------------------------------
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # LockedFuncRepository is deprecated, as in `kernels`
def test_a_kernel_the_lock_does_not_hold_is_refused_when_the_repository_is_built(hub, tmp_path):
    from kernelhub.func import LockedFuncRepository

    _publish(tmp_path, "org/tiny")
    lockfile = write_lockfile([lock_kernel("org/tiny", version=1)], tmp_path / "kernels.lock")
    with pytest.raises(KernelLockError, match="LockedFuncRepository: Kernel `org/other` is not locked"):
        LockedFuncRepository("org/other", func_name="scale", lockfile=lockfile)
    with pytest.raises(KernelLockError, match="LockedLayerRepository: Kernel `org/other` is not locked"):
        LockedLayerRepository("org/other", layer_name="TinyScale", lockfile=lockfile)
    with pytest.raises(ValueError, match="Kernel `org/other` is not locked"):
        get_locked_kernel("org/other", lockfile=lockfile)
    LockedFuncRepository("org/tiny", func_name="scale", lockfile=lockfile)
    # a lock file that does not exist yet is read when the layer loads, as before
    LockedLayerRepository("org/other", layer_name="TinyScale", lockfile=tmp_path / "later.lock")


def _installed_caller(site: Path, lockfile: Path) -> None:
    """An installed package `lockedcaller` shipping `lockfile` (and its sidecar) in its metadata, as
    `kernels`' setuptools hook ships a project's kernels.lock."""
    pkg = site / "lockedcaller"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from kernelhub import LockedLayerRepository, get_locked_kernel, load_kernel\n\n"
        "def layer(repo_id):\n    return LockedLayerRepository(repo_id, layer_name='TinyScale')\n\n"
        "def kernel(repo_id):\n    return get_locked_kernel(repo_id)\n\n"
        "def cached(repo_id):\n    return load_kernel(repo_id, lockfile=None)\n"
    )
    info = site / "lockedcaller-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lockedcaller\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("lockedcaller\n")
    (info / "kernels.lock").write_text(lockfile.read_text())
    (info / "kernels.lock.sha256").write_text(Path(f"{lockfile}.sha256").read_text())


def test_without_a_lockfile_the_calling_packages_shipped_lock_is_read(hub, tmp_path, monkeypatch):
    import importlib
    import sys

    _publish(tmp_path, "org/tiny", factor=2.0)
    lockfile = write_lockfile([lock_kernel("org/tiny", version=1)], tmp_path / "kernels.lock")
    _publish(tmp_path, "org/tiny", factor=4.0)  # v1 moved on: the shipped lock still means the first commit
    _installed_caller(tmp_path / "site", lockfile)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # no ./kernels.lock to fall back on
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    try:
        caller = importlib.import_module("lockedcaller")
        assert _scale_of(caller.kernel("org/tiny")) == 2.0
        layer = caller.layer("org/tiny")
        assert layer.load().__name__ == "TinyScale"
        assert _scale_of(caller.cached("org/tiny")) == 2.0
        with pytest.raises(KernelLockError, match="Kernel `org/other` is not locked"):
            caller.layer("org/other")
        sys.modules.pop("lockedcaller")
        (tmp_path / "site" / "lockedcaller-1.0.dist-info" / "kernels.lock").unlink()  # a package shipping none
        caller = importlib.import_module("lockedcaller")
        with pytest.raises(ValueError, match="Could not find a `kernels.lock` file in the caller's package metadata"):
            caller.kernel("org/tiny")
    finally:
        sys.modules.pop("lockedcaller", None)


def _two_variant_kernel(tmp_path: Path, foreign: str) -> str:
    return upload_kernel(tiny_copy(tmp_path / "src2", extra_variants={foreign: 3.0}), "org/tiny", version=1)[2]


def test_cli_download_of_a_project_checks_the_locked_variants(hub, tmp_path, capsys):
    foreign = "torch27-cxx11-cu118-aarch64-linux"
    commit = _two_variant_kernel(tmp_path, foreign)
    project = tmp_path / "project"
    project.mkdir()
    lock = _legacy_kernels_lock(hub, "org/tiny", commit)
    (project / "kernels.lock").write_text(json.dumps(lock))
    assert main(["download", str(project), "--all-variants"]) == 0
    out = capsys.readouterr().out
    assert f"build/{foreign}" in out and "build/torch-universal" in out
    lock[0]["variants"][foreign]["hash"] = "sha256-" + "0" * 64
    (project / "kernels.lock").write_text(json.dumps(lock))
    assert main(["download", str(project)]) == 0  # this system's variant only: still as locked
    assert main(["download", str(project), "--all-variants"]) == 1
    assert f"git_lfs_concat hash of build/{foreign}/ is" in capsys.readouterr().err
    (project / "kernels.lock").unlink()
    assert main(["download", str(project)]) == 1
    assert "No kernels.lock file found in" in capsys.readouterr().err


def test_cli_lock_of_a_project_locks_its_kernels_dependencies(hub, tmp_path, monkeypatch, capsys):
    _publish(tmp_path, "org/tiny", version=1, factor=2.0)
    c2 = _publish(tmp_path, "org/tiny", version=2, factor=3.0)
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text('[tool.kernels.dependencies]\n"org/tiny" = 2\n')
    monkeypatch.chdir(tmp_path)
    assert main(["lock", str(project)]) == 0
    assert json.loads((project / "kernels.lock").read_text()) == [
        {"dependency": {"repo-id": "org/tiny", "version": 2}, "lock": {"commit": c2}}
    ]
    assert _scale_of(get_locked_kernel("org/tiny", lockfile=project / "kernels.lock")) == 3.0
    (project / "kernels.lock").unlink()
    monkeypatch.chdir(project)  # `kernels lock .`, spelled `kernelhub lock`
    assert main(["lock"]) == 0
    assert json.loads((project / "kernels.lock").read_text())[0]["lock"]["commit"] == c2
    (project / "kernels.lock").unlink()
    from kernelhub.cli import lock_kernels

    lock_kernels(argparse.Namespace(project_dir=project))  # `kernels.cli.lock_kernels`, as `kernels` code calls it
    assert json.loads((project / "kernels.lock").read_text())[0]["lock"]["commit"] == c2
    (project / "pyproject.toml").write_text('[tool.kernels.dependencies]\n"org/tiny" = "2"\n')
    assert main(["lock", str(project)]) == 1
    assert "[tool.kernels.dependencies] 'org/tiny' must be an int version, got '2'" in capsys.readouterr().err


def test_a_config_lock_lacking_the_kernel_fails_when_the_layer_loads(hub, tmp_path):
    """kernelize builds the config's locked repositories while it chooses, outside its load-failure
    handling (a layer recognised by its class falls back when its kernel fails to load): a kernel
    the lock does not hold fails at load there, not when the repository is built."""
    from kernelhub.config import KernelhubConfig

    _publish(tmp_path, "org/tiny")
    write_lockfile([lock_kernel("org/tiny", version=1)], tmp_path / "kernels.lock")
    config = KernelhubConfig.from_dict(
        {"lockfile": "kernels.lock", "layers": {"Scale": {"repo": "org/other", "version": 1, "layer": "TinyScale"}}},
        base_dir=tmp_path,
    )
    repo = config.repository_for("Scale", torch.device("cpu"), None, None)
    with pytest.raises(KernelLockError, match="Kernel `org/other` is not locked"):
        repo.load()
    renamed = repo.with_layer_name("TinyScaleDouble")  # as the registry renames a layer
    with pytest.raises(KernelLockError, match="Kernel `org/other` is not locked"):
        renamed.load()
