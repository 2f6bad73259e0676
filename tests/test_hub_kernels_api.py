"""The Hugging Face `kernels` 0.17 loading API as kernelhub offers it: signatures, defaults, layouts,
LOCAL_KERNELS, install/load, variants and the loaded-kernels registry, against the local Hub."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hub_server import TINY, hub_fixture, tiny_copy  # noqa: F401 - hub_fixture provides `hub`

import kernelhub
from kernelhub import (
    LayerRepository,
    LocalLayerRepository,
    LockedLayerRepository,
    VariantAccepted,
    VariantRejected,
    get_kernel,
    get_kernel_variants,
    get_loaded_kernels,
    get_local_kernel,
    has_kernel,
    install_kernel,
    load_kernel,
)
from kernelhub.cli.upload import upload_kernel
from kernelhub.hub import KernelNotFoundError, UntrustedKernelError
from kernelhub.lock import lock_kernel, write_lockfile
from kernelhub.variants import SystemInfo


def _publish(tmp_path: Path, repo_id: str, *, version: int = 1, factor: float = 2.0, **kw) -> str:
    src = tiny_copy(tmp_path / f"src-{repo_id.replace('/', '-')}-v{version}-{factor}", factor=factor, **kw)
    return upload_kernel(src, repo_id, version=version)[2]


def _scale_of(kernel) -> float:
    return float(kernel.scale(torch.ones(1))[0])


def test_get_kernel_takes_revision_and_version_positionally(hub, tmp_path):
    commit = _publish(tmp_path, "org/tiny")
    assert get_kernel("org/tiny", None, 1, trust_remote_code=True) is get_kernel("org/tiny", commit,
                                                                                 trust_remote_code=True)
    assert has_kernel("org/tiny", None, 1) and not has_kernel("org/tiny", None, 2)


def test_version_0_is_refused_when_loaded_with_the_kernels_message(hub, tmp_path):
    for version in (1, 2, 10):
        _publish(tmp_path, "org/tiny", version=version)
    repo = LayerRepository("org/tiny", layer_name="TinyScale", version=0, trust_remote_code=True)  # no error yet
    with pytest.raises(ValueError, match="Version 0 not found, available versions: 1, 2, 10"):
        repo.load()
    with pytest.raises(ValueError, match="Version 0 not found, available versions: 1, 2, 10"):
        get_kernel("org/tiny", version=0, trust_remote_code=True)


def test_backend_must_be_cpu_or_torchs_own(hub, tmp_path):
    _publish(tmp_path, "org/tiny", extra_variants={"torch-cpu": 4.0})
    assert _scale_of(get_kernel("org/tiny", version=1, backend="cpu", trust_remote_code=True)) == 4.0
    other = "metal" if SystemInfo.current().backend != "metal" else "cuda"
    with pytest.raises(ValueError, match=rf"get_kernel: Invalid backend {other!r}, system supported backends: cpu"):
        get_kernel("org/tiny", version=1, backend=other, trust_remote_code=True)
    with pytest.raises(ValueError, match="has_kernel: Invalid backend"):
        has_kernel("org/tiny", version=1, backend=other)


@pytest.mark.parametrize("user_agent", ["myapp/1.0", {"myapp": "1.0"}])
def test_user_agent_reaches_every_hub_request(hub, tmp_path, user_agent):
    _publish(tmp_path, "org/tiny")
    before = len(hub.store.user_agents)
    get_kernel("org/tiny", version=1, trust_remote_code=True, user_agent=user_agent)
    agents = hub.store.user_agents[before:]
    assert agents and all("myapp/1.0" in a for a in agents), agents


def test_local_kernels_env_loads_a_repository_from_disk(hub, tmp_path, monkeypatch):
    src = tiny_copy(tmp_path / "local", factor=5.0)
    monkeypatch.setenv("LOCAL_KERNELS", f"someone/tiny={src}:other/x={tmp_path}")
    before = len(hub.store.requests)
    assert _scale_of(get_kernel("someone/tiny", version=1)) == 5.0  # no Hub, no trust question
    assert has_kernel("someone/tiny", version=1)
    layer = LayerRepository("someone/tiny", layer_name="TinyScale", version=1).load()
    assert float(layer()(torch.ones(1))[0]) == 5.0
    assert len(hub.store.requests) == before
    monkeypatch.setenv("LOCAL_KERNELS", f"someone/tiny={tmp_path / 'absent'}")
    with pytest.raises(FileNotFoundError, match=r"Could not find kernel in .*absent"):
        get_kernel("someone/tiny", version=1)
    monkeypatch.setenv("LOCAL_KERNELS", "someone/tiny")
    with pytest.raises(ValueError, match="Invalid LOCAL_KERNELS entry: someone/tiny. Expected format"):
        get_kernel("someone/tiny", version=1)


def test_get_local_kernel_loads_the_layouts_kernels_loads(tmp_path):
    # repo/build given, build/<variant>/<package>/__init__.py (before flattening)
    assert _scale_of(get_local_kernel(TINY / "build")) == 2.0
    # a flattened variant, build/<variant>/__init__.py, given as the repository root
    flat = tmp_path / "flat"
    shutil.copytree(TINY / "build" / "torch-universal" / "tiny", flat / "build" / "torch-universal")
    assert _scale_of(get_local_kernel(flat)) == 2.0
    assert _scale_of(get_local_kernel(flat / "build", backend="cpu")) == 2.0
    # two packages in one variant: package_name chooses (positionally, as kernels once took it)
    two = tiny_copy(tmp_path / "two", factor=3.0)
    shutil.copytree(two / "build" / "torch-universal" / "tiny", two / "build" / "torch-universal" / "other")
    assert _scale_of(get_local_kernel(two, "tiny")) == 3.0
    repo = LocalLayerRepository(repo_path=two, package_name="other", layer_name="TinyScale")
    assert float(repo.load()()(torch.ones(1))[0]) == 3.0
    with pytest.raises(FileNotFoundError, match="has no kernel package 'nope'"):
        get_local_kernel(two, "nope")


def test_install_kernel_downloads_without_importing_and_load_kernel_never_downloads(hub, tmp_path):
    _publish(tmp_path, "org/tiny")
    with pytest.raises(UntrustedKernelError, match="is not from a trusted publisher"):
        install_kernel("org/tiny", version=1)
    lockfile = write_lockfile([lock_kernel("org/tiny", version=1)], tmp_path / "kernels.lock")
    shutil.rmtree(tmp_path / "cache")
    with pytest.raises(KernelNotFoundError):
        load_kernel("org/tiny", lockfile=lockfile)  # not in the cache, and it does not download
    path = install_kernel("org/tiny", version=1, trust_remote_code=True)
    assert (path / "tiny" / "ops.py").is_file() and path.name == "torch-universal"
    assert not any(k.path == path for k in get_loaded_kernels())
    assert install_kernel("org/tiny", version=1, trust_remote_code=True, local_files_only=True) == path
    hub.stop()
    kernel = load_kernel("org/tiny", lockfile=lockfile)
    assert _scale_of(kernel) == 2.0


def test_get_kernel_variants_decides_every_variant(hub, tmp_path):
    foreign = "torch27-cxx11-cu118-aarch64-linux"
    _publish(tmp_path, "org/tiny", extra_variants={"torch-cpu": 3.0, foreign: 4.0})
    decisions = get_kernel_variants("org/tiny", version=1)
    accepted = [d.variant.variant_str for d in decisions if isinstance(d, VariantAccepted)]
    rejected = {d.variant.variant_str: d.reason for d in decisions if isinstance(d, VariantRejected)}
    assert accepted == ["torch-cpu", "torch-universal"]
    assert "platform aarch64-linux" in rejected[foreign]


def test_get_loaded_kernels_lists_what_this_process_imported(hub, tmp_path):
    commit = _publish(tmp_path, "org/tiny")
    kernel = get_kernel("org/tiny", version=1, trust_remote_code=True)
    (loaded,) = [k for k in get_loaded_kernels() if k.module is kernel]
    assert loaded.repo_info == kernelhub.RepoInfo("org/tiny", commit)
    assert loaded.metadata.name == "tiny" and loaded.metadata.license == "Apache-2.0"
    local = get_local_kernel(TINY)
    (entry,) = [k for k in get_loaded_kernels() if k.module is local]
    assert entry.repo_info is None
    get_loaded_kernels().clear()  # a copy
    assert any(k.module is kernel for k in get_loaded_kernels())


def test_repository_classes_take_the_kernels_arguments(tmp_path):
    locked = LockedLayerRepository("org/tiny", layer_name="TinyScale", lockfile=tmp_path / "k.lock",
                                   trust_remote_code=["org/tiny"])
    assert locked.trust_remote_code == ["org/tiny"]
    repo = LayerRepository("org/tiny", layer_name="TinyScale", version=1, trust_remote_code=["org/tiny"],
                           user_agent={"app": "1"})
    assert hash(repo) == hash(repo.with_layer_name("TinyScale")) and repo.user_agent == {"app": "1"}


@pytest.mark.parametrize("user_agent", ["app/1\r\nX-Evil: 1", {"app": "1\n"}, 3])
def test_a_user_agent_that_is_no_header_value_is_refused(hub, tmp_path, user_agent):
    _publish(tmp_path, "org/tiny")
    with pytest.raises((ValueError, TypeError), match="`user_agent` must"):
        get_kernel("org/tiny", version=1, trust_remote_code=True, user_agent=user_agent)


def test_a_kernels_unreadable_metadata_does_not_break_loading(tmp_path):
    src = tiny_copy(tmp_path / "deep", factor=2.0)
    (src / "build" / "torch-universal" / "tiny" / "metadata.json").write_text("[" * 200_000 + "]" * 200_000)
    kernel = get_local_kernel(src)
    (entry,) = [k for k in get_loaded_kernels() if k.module is kernel]
    assert entry.metadata.name == "tiny" and entry.metadata.raw == {}


def test_func_repository_takes_a_list_of_trusted_repository_ids(hub, tmp_path):
    import warnings

    from kernelhub import FuncRepository

    _publish(tmp_path, "org/tiny", factor=3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # FuncRepository is deprecated, as in kernels
        trusted = FuncRepository("org/tiny", func_name="scale", version=1, trust_remote_code=["org/tiny"])
        others = FuncRepository("org/tiny", func_name="scale", version=1, trust_remote_code=["org/other"])
        with pytest.raises(TypeError, match="FuncRepository: `trust_remote_code` must be a bool or a list"):
            FuncRepository("org/tiny", func_name="scale", version=1, trust_remote_code="yes")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the list is honoured, not warned about and ignored
        layer = trusted.load()
    assert float(layer()(torch.ones(1))[0]) == 3.0
    with pytest.raises(UntrustedKernelError, match="not from a trusted publisher"):
        others.load()
