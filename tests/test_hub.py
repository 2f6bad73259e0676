"""kernelhub.hub against a local Hub server driven by the real huggingface_hub client."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hub_server import TINY, hub_fixture, tiny_copy  # noqa: F401 - hub_fixture provides `hub`

import kernelhub.hub as hubmod
from kernelhub.cli.upload import upload_kernel
from kernelhub.hub import (
    KernelHubError,
    KernelNotFoundError,
    KernelVariantNotFoundError,
    KernelVersionNotFoundError,
    LayerRepository,
    LocalLayerRepository,
    LockedLayerRepository,
    UntrustedKernelError,
    get_kernel,
    get_local_kernel,
    has_kernel,
)
from kernelhub.variants import SystemInfo, Variant, rank_variants

SRC = Path(__file__).resolve().parents[1] / "src"


def _publish(tmp_path: Path, repo_id: str, *, version: int = 1, factor: float = 2.0, **kw) -> str:
    src = tiny_copy(tmp_path / f"src-{repo_id.replace('/', '-')}-v{version}-{factor}", factor=factor, **kw)
    return upload_kernel(src, repo_id, version=version)[2]


def _scale_of(kernel) -> float:
    return float(kernel.scale(torch.ones(1))[0])


def test_upload_then_get_by_version_by_revision_and_by_tag(hub, tmp_path):
    commit = _publish(tmp_path, "org/tiny", factor=2.0)
    by_version = get_kernel("org/tiny", version=1, trust_remote_code=True)
    assert _scale_of(by_version) == 2.0
    assert by_version.__kernelhub_source__.commit == commit
    assert by_version.__kernelhub_source__.variant == "torch-universal"
    by_commit = get_kernel("org/tiny", revision=commit, trust_remote_code=True)
    by_tag = get_kernel("org/tiny", revision="v1.0", trust_remote_code=True)
    assert by_commit is by_version and by_tag is by_version  # one snapshot, imported once


def test_second_version_loads_beside_the_first_in_one_process(hub, tmp_path, caplog):
    _publish(tmp_path, "org/tiny", version=1, factor=2.0)
    _publish(tmp_path, "org/tiny", version=2, factor=3.0)
    with caplog.at_level(logging.WARNING, logger="kernelhub.hub"):
        v1 = get_kernel("org/tiny", version=1, trust_remote_code=True)
    v2 = get_kernel("org/tiny", version=2, trust_remote_code=True)
    assert v1 is not v2 and v1.__name__ != v2.__name__
    assert (_scale_of(v1), _scale_of(v2)) == (2.0, 3.0)
    assert any("but version 2 is available" in r.getMessage() for r in caplog.records)
    latest = get_kernel("org/tiny", trust_remote_code=True)  # neither given: newest vN
    assert latest is v2
    # The layer classes of both versions are live at once.
    l1 = LayerRepository("org/tiny", layer_name="TinyScale", version=1, trust_remote_code=True).load()
    l2 = LayerRepository("org/tiny", layer_name="TinyScale", version=2, trust_remote_code=True).load()
    assert float(l1()(torch.ones(1))[0]) == 2.0 and float(l2()(torch.ones(1))[0]) == 3.0


def test_only_the_best_variant_for_this_system_is_downloaded(hub, tmp_path):
    s = SystemInfo.current()
    native = f"torch{s.torch_version[0]}{s.torch_version[1]}-cxx11-{s.backend}-{s.cpu}-{s.os}"
    foreign = "torch27-cxx11-cu118-aarch64-linux"
    _publish(tmp_path, "org/tiny", factor=2.0, extra_variants={native: 5.0, foreign: 7.0})
    kernel = get_kernel("org/tiny", version=1, trust_remote_code=True)
    assert kernel.__kernelhub_source__.variant == native
    assert _scale_of(kernel) == 5.0
    build = kernel.__kernelhub_source__.path.parent
    assert sorted(p.name for p in build.iterdir()) == [native]


def test_offline_reload_from_cache_in_a_fresh_process(hub, tmp_path):
    _publish(tmp_path, "org/tiny", factor=2.0)
    get_kernel("org/tiny", version=1, trust_remote_code=True)
    hub.stop()  # nothing answers any more: the fresh process must use the cache only
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(SRC)}
    code = (
        "import torch; from kernelhub.hub import get_kernel; "
        "k = get_kernel('org/tiny', version=1, trust_remote_code=True); "
        "print(float(k.scale(torch.ones(1))[0]))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2.0"


def test_offline_without_cache_says_so(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(KernelNotFoundError, match="offline"):
        get_kernel("org/tiny", version=1, trust_remote_code=True)


def test_missing_repo_revision_and_version_are_clear_errors(hub, tmp_path):
    with pytest.raises(KernelNotFoundError, match=r"'org/nothing'.*not found"):
        get_kernel("org/nothing", version=1, trust_remote_code=True)
    _publish(tmp_path, "org/tiny")
    with pytest.raises(KernelVersionNotFoundError, match=r"Version 7 not found, available versions: 1 "):
        get_kernel("org/tiny", version=7, trust_remote_code=True)
    with pytest.raises(KernelNotFoundError, match="no revision 'nope'"):
        get_kernel("org/tiny", revision="nope", trust_remote_code=True)


def test_missing_variant_names_the_variants_and_why(hub, tmp_path):
    foreign = "torch27-cxx11-cu118-aarch64-linux"
    _publish(tmp_path, "org/tiny", extra_variants={foreign: 7.0}, universal=False)
    with pytest.raises(KernelVariantNotFoundError, match=rf"no build variant for this system.*{foreign}: platform"):
        get_kernel("org/tiny", version=1, trust_remote_code=True)
    assert not has_kernel("org/tiny", version=1)


def test_has_kernel(hub, tmp_path):
    _publish(tmp_path, "org/tiny")
    assert has_kernel("org/tiny", version=1)
    assert not has_kernel("org/tiny", version=2)
    assert not has_kernel("org/absent")


def _downloads(hub) -> list[tuple[str, str]]:
    """Requests other than the trust question (the organization overview, which `kernels` asks too)."""
    return [r for r in hub.store.requests if not r[1].startswith("/api/organizations/")]


def test_untrusted_publisher_is_refused_by_default_before_any_download(hub, tmp_path, monkeypatch):
    """As Hugging Face `kernels` 0.17: a ValueError whose message says "is not from a trusted publisher"."""
    _publish(tmp_path, "someone/tiny")
    before = len(_downloads(hub))
    refused = r"Kernel repository 'someone/tiny' is not from a trusted publisher.*Set trust_remote_code=True"
    for trust in (None, False, ["other/tiny"]):
        with pytest.raises(UntrustedKernelError, match=refused):
            get_kernel("someone/tiny", version=1, trust_remote_code=trust)
    with pytest.raises(ValueError, match=refused):  # the exception type `kernels` users catch
        get_kernel("someone/tiny", version=1)
    with pytest.raises(UntrustedKernelError):
        LayerRepository("someone/tiny", layer_name="TinyScale", version=1).load()
    monkeypatch.setenv("KERNELHUB_REQUIRE_TRUSTED", "1")
    with pytest.raises(UntrustedKernelError, match="KERNELHUB_REQUIRE_TRUSTED is set"):
        get_kernel("someone/tiny", version=1)
    assert len(_downloads(hub)) == before
    monkeypatch.delenv("KERNELHUB_REQUIRE_TRUSTED")
    assert _scale_of(get_kernel("someone/tiny", version=1, trust_remote_code=["someone/tiny"])) == 2.0
    monkeypatch.setenv("KERNELHUB_TRUSTED_PUBLISHERS", "other, someone")
    trusted = LayerRepository("someone/tiny", layer_name="TinyScale", version=1)
    assert trusted.load().__name__ == "TinyScale"
    # imported (and cached) while trusted: the cache does not let a refusal through afterwards
    monkeypatch.delenv("KERNELHUB_TRUSTED_PUBLISHERS")
    with pytest.raises(UntrustedKernelError, match="not from a trusted publisher"):
        trusted.load()


def test_a_publisher_the_hub_marks_trusted_is_trusted_online_only(hub, tmp_path, monkeypatch):
    """`kernels` asks the Hub's organization overview (`trustedKernelPublisher`); offline it cannot."""
    _publish(tmp_path, "vendor/tiny")
    hub.store.trusted_orgs.add("vendor")
    assert _scale_of(get_kernel("vendor/tiny", version=1)) == 2.0
    monkeypatch.setenv("KERNELHUB_REQUIRE_TRUSTED", "1")  # the local list only
    with pytest.raises(UntrustedKernelError, match="KERNELHUB_REQUIRE_TRUSTED is set, so the Hub is not asked"):
        get_kernel("vendor/tiny", version=1)
    monkeypatch.delenv("KERNELHUB_REQUIRE_TRUSTED")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UntrustedKernelError, match="offline, so the Hub cannot vouch for it"):
        get_kernel("vendor/tiny", version=1)


def test_kernelize_decides_trust_per_use_even_for_a_layer_it_has_loaded(hub, tmp_path, monkeypatch):
    """kernelize keeps loaded layer classes; a publisher no longer trusted must not be reached
    through that cache: kernelize refuses it (a module marked with a layer name raises what loading
    its repository raised, as in Hugging Face `kernels`)."""
    from torch import nn

    from kernelhub import kernelize, kernelize_report, use_kernel_forward_from_hub, use_kernel_mapping

    _publish(tmp_path, "someone/tiny")

    @use_kernel_forward_from_hub("TinyScale")
    class Scale(nn.Module):
        def forward(self, x):
            return x

    repo = LayerRepository("someone/tiny", layer_name="TinyScale", version=1)
    monkeypatch.setenv("KERNELHUB_TRUSTED_PUBLISHERS", "someone")
    with use_kernel_mapping({"TinyScale": {"cpu": repo}}, inherit_mapping=False):
        (entry,) = kernelize_report(kernelize(Scale(), device="cpu")).entries
        assert entry.layer == "TinyScale", entry.fallback_reason
        monkeypatch.delenv("KERNELHUB_TRUSTED_PUBLISHERS")
        with pytest.raises(UntrustedKernelError, match="not from a trusted publisher"):
            kernelize(Scale(), device="cpu")


def test_get_kernel_trust_remote_code_must_be_a_bool_or_a_list(hub, tmp_path):
    with pytest.raises(TypeError, match="get_kernel: `trust_remote_code` must be a bool or a list"):
        get_kernel("someone/tiny", version=1, trust_remote_code="false")


def test_concurrent_processes_share_one_download(hub, tmp_path):
    _publish(tmp_path, "org/tiny", factor=2.0)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    code = (
        "import torch; from kernelhub.hub import get_kernel; "
        "k = get_kernel('org/tiny', version=1, trust_remote_code=True); "
        "print(float(k.scale(torch.ones(1))[0]), k.__kernelhub_source__.commit)"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    results = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    assert len({out.strip() for out, _ in results}) == 1 and results[0][0].startswith("2.0 ")
    snapshots = list((tmp_path / "cache").glob("*--org--tiny/snapshots/*"))
    assert len(snapshots) == 1


def test_layer_repository_interface(hub, tmp_path):
    _publish(tmp_path, "org/tiny")
    repo = LayerRepository("org/tiny", layer_name="TinyScale", version=1, trust_remote_code=True)
    assert repo.load().__name__ == "TinyScale"
    other = repo.with_layer_name("TinyScaleDouble")
    assert isinstance(other, LayerRepository) and other.version == 1 and other.trust_remote_code
    assert other.load().__name__ == "TinyScaleDouble"
    assert repo.describe() == "hub:org/tiny@v1/TinyScale"
    assert repo == LayerRepository("org/tiny", layer_name="TinyScale", version=1, trust_remote_code=True)
    assert repo != other and len({repo, other, other.with_layer_name("TinyScale")}) == 2
    with pytest.raises(AttributeError, match="no layer 'Missing'.*TinyScale"):
        repo.with_layer_name("Missing").load()


@pytest.mark.parametrize(
    ("kwargs", "exc", "pattern"),
    [
        ({"repo_id": "noslash", "layer_name": "X"}, ValueError, "LayerRepository: `repo_id`"),
        ({"repo_id": "a/b", "layer_name": "not an id"}, ValueError, "LayerRepository: `layer_name`"),
        ({"repo_id": "a/b", "layer_name": "X", "version": 1, "revision": "main"}, ValueError, "not both"),
        ({"repo_id": "a/b", "layer_name": "X", "version": "1"}, TypeError, "`version` must be an int"),
        ({"repo_id": "a/b", "layer_name": "X", "revision": 3}, TypeError, "`revision` must be a non-empty"),
        ({"repo_id": "a/b", "layer_name": "X", "revision": ""}, ValueError, "`revision` must be a non-empty"),
    ],
)
def test_layer_repository_validates_arguments(kwargs, exc, pattern):
    repo_id = kwargs.pop("repo_id")
    with pytest.raises(exc, match=pattern):
        LayerRepository(repo_id, **kwargs)


def test_get_kernel_validates_arguments():
    with pytest.raises(ValueError, match="get_kernel: Either a revision or a version must be specified, not both"):
        get_kernel("a/b", version=1, revision="main")
    with pytest.raises(ValueError, match="get_kernel: `repo_id`"):
        get_kernel("a", version=1)


def test_local_and_locked_repositories_share_the_interface(tmp_path):
    local = LocalLayerRepository(TINY, layer_name="TinyScale")
    assert local.load() is get_local_kernel(TINY).layers.TinyScale
    assert local.with_layer_name("TinyScaleDouble") == LocalLayerRepository(TINY, layer_name="TinyScaleDouble")
    assert local.describe().startswith("local:") and local.describe().endswith("/TinyScale")
    locked = LockedLayerRepository("org/tiny", layer_name="TinyScale", lockfile=tmp_path / "k.lock", version=1)
    assert locked.with_layer_name("TinyScaleDouble").layer_name == "TinyScaleDouble"
    assert locked == LockedLayerRepository("org/tiny", layer_name="TinyScale", lockfile=tmp_path / "k.lock", version=1)
    assert locked.describe() == "locked:org/tiny@v1/TinyScale"
    assert hash(locked) != hash(local)


H100_BOX = SystemInfo((2, 7), "cuda", (12, 6), "x86_64", "linux", True)


def test_variant_ranking_follows_cuda_compatibility_then_noarch_then_universal():
    names = [
        "torch-universal",
        "torch-cuda",
        "torch27-cxx11-cu118-x86_64-linux",  # other CUDA major
        "torch27-cxx11-cu124-x86_64-linux",
        "torch27-cxx11-cu126-x86_64-linux",
        "torch27-cxx11-cu128-x86_64-linux",  # newer minor than the system's 12.6
        "torch26-cxx11-cu126-x86_64-linux",
        "torch27-cxx98-cu126-x86_64-linux",
        "torch27-cxx11-cu126-aarch64-linux",
        "torch27-cxx11-rocm63-x86_64-linux",
        "torch-cpu",
        "weird",
    ]
    usable, rejected = rank_variants(names, H100_BOX)
    assert usable == [
        "torch27-cxx11-cu126-x86_64-linux",
        "torch27-cxx11-cu124-x86_64-linux",
        "torch-cuda",
        "torch-universal",
    ]
    assert "not compatible with system CUDA 12.6" in rejected["torch27-cxx11-cu128-x86_64-linux"]
    assert "not compatible" in rejected["torch27-cxx11-cu118-x86_64-linux"]
    assert rejected["torch26-cxx11-cu126-x86_64-linux"] == "built for torch 2.6, this is torch 2.7"
    assert "C++ ABI cxx98" in rejected["torch27-cxx98-cu126-x86_64-linux"]
    assert "platform aarch64-linux" in rejected["torch27-cxx11-cu126-aarch64-linux"]
    assert "backend rocm" in rejected["torch27-cxx11-rocm63-x86_64-linux"]
    assert "backend cpu" in rejected["torch-cpu"]
    assert "not a build variant name" in rejected["weird"]


def test_variant_parse_reads_every_field():
    v = Variant.parse("torch210-cxx11-cu128-x86_64-linux")
    assert (v.torch_version, v.backend, v.backend_version, v.cpu, v.os, v.cxx11_abi) == (
        (2, 10),
        "cuda",
        (12, 8),
        "x86_64",
        "linux",
        True,
    )
    assert Variant.parse("torch-universal").backend == "universal"
    with pytest.raises(ValueError, match="unknown backend 'tpu9'"):
        Variant.parse("torch27-tpu9-x86_64-linux")


def test_offline_resolves_versions_and_default_from_cached_refs(hub, tmp_path, monkeypatch):
    _publish(tmp_path, "org/tiny", version=1, factor=2.0)
    _publish(tmp_path, "org/tiny", version=2, factor=3.0)
    v1 = get_kernel("org/tiny", version=1, trust_remote_code=True)
    v2 = get_kernel("org/tiny", version=2, trust_remote_code=True)
    hub.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert get_kernel("org/tiny", version=1, trust_remote_code=True) is v1
    assert get_kernel("org/tiny", trust_remote_code=True) is v2  # newest cached vN
    assert get_kernel("org/tiny", revision=v1.__kernelhub_source__.commit, trust_remote_code=True) is v1
    assert has_kernel("org/tiny", version=2) and not has_kernel("org/tiny", version=3)


def test_an_unreachable_hub_is_named(monkeypatch, tmp_path):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(KernelHubError, match=rf"could not reach the Hub at http://127.0.0.1:{port} .*'org/tiny'"):
        get_kernel("org/tiny", version=1, trust_remote_code=True)


# -- edges found by fuzzing ----------------------------------------------------------------------
def test_a_zero_padded_branch_is_not_a_version(hub, tmp_path):
    """"v02" is not the branch of version 2 (the newest-version lookup rebuilt it as "v2", a KeyError)."""
    from huggingface_hub import HfApi

    commit = _publish(tmp_path, "org/tiny")
    HfApi(endpoint=hub.url).create_branch("org/tiny", branch="v02", repo_type="kernel", revision=commit)
    assert _scale_of(get_kernel("org/tiny", trust_remote_code=True)) == 2.0
    assert has_kernel("org/tiny")


def test_a_release_after_a_deleted_tag_takes_the_next_free_number(hub, tmp_path):
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.url)
    for factor in (2.0, 3.0, 4.0):
        _publish(tmp_path, "org/tiny", factor=factor)
    del hub.store.repo("kernel", "org/tiny").tags["v1.1"]  # (the local server has no tag deletion)
    _publish(tmp_path, "org/tiny", factor=5.0)
    tags = {t.name for t in api.list_repo_refs("org/tiny", repo_type="kernel").tags}
    assert tags == {"v1.0", "v1.2", "v1.3"}


def test_a_variant_the_loader_cannot_use_is_a_kernel_hub_error(hub, tmp_path):
    """Two packages in one variant: `check` (so `upload`) refuses it, and one published by other
    means loads as a KernelHubError naming the kernel, not the loader's bare FileNotFoundError."""
    import shutil

    from huggingface_hub import HfApi

    src = tiny_copy(tmp_path / "two", factor=2.0)
    pkg = src / "build" / "torch-universal" / "tiny"
    shutil.copytree(pkg, pkg.parent / "other")
    with pytest.raises(ValueError, match="must hold exactly one package"):
        upload_kernel(src, "org/two", version=1)
    api = HfApi(endpoint=hub.url)
    api.create_repo("org/two", repo_type="kernel")
    api.create_branch("org/two", branch="v1", repo_type="kernel")
    api.upload_folder(repo_id="org/two", folder_path=str(src), repo_type="kernel", revision="v1")
    with pytest.raises(KernelHubError, match="kernel 'org/two' at .*exactly one kernel package"):
        get_kernel("org/two", version=1, trust_remote_code=True)


def test_offline_with_a_cached_ref_but_no_snapshot_says_not_cached(hub, tmp_path, monkeypatch):
    import shutil

    _publish(tmp_path, "org/tiny")
    get_kernel("org/tiny", version=1, trust_remote_code=True)
    for snapshots in (tmp_path / "cache").rglob("snapshots"):
        shutil.rmtree(snapshots)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(KernelNotFoundError, match="offline and kernel 'org/tiny' .* is not cached"):
        hubmod.resolve_kernel("org/tiny", version=1)


def test_local_kernels_choose_their_variant_as_hub_kernels_do(hub, tmp_path):
    """A repository holding torch-universal and torch-cpu: a CPU machine runs the backend build,
    from the Hub and from disk alike."""
    repo = tiny_copy(tmp_path / "variants", factor=2.0, extra_variants={"torch-cpu": 4.0})
    assert _scale_of(get_local_kernel(repo)) == 4.0
    upload_kernel(repo, "org/variants", version=1)
    assert _scale_of(get_kernel("org/variants", version=1, trust_remote_code=True)) == 4.0


@pytest.mark.parametrize("repo_id", ["org/a..b", "org/a--b", "org/name-", "org/x.git"])
def test_repo_ids_the_hub_refuses_are_value_errors_before_any_request(hub, repo_id):
    with pytest.raises(ValueError, match="`repo_id` .* is not a valid Hub id"):
        get_kernel(repo_id)
    with pytest.raises(ValueError, match="`repo_id` .* is not a valid Hub id"):
        LayerRepository(repo_id, layer_name="TinyScale")



# -- hardening (issue 30) ------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["on", "ON", " Yes ", "TRUE", "1"])
def test_require_trusted_understands_every_spelling_of_on(hub, tmp_path, monkeypatch, value):
    """`KERNELHUB_REQUIRE_TRUSTED=ON` was not understood, so untrusted code was imported."""
    _publish(tmp_path, "someone/tiny")
    monkeypatch.setenv("KERNELHUB_REQUIRE_TRUSTED", value)
    with pytest.raises(UntrustedKernelError, match="KERNELHUB_REQUIRE_TRUSTED is set"):
        get_kernel("someone/tiny", version=1)


@pytest.mark.parametrize("var", ["KERNELHUB_REQUIRE_TRUSTED", "HF_HUB_OFFLINE"])
def test_an_unknown_boolean_value_is_an_error_naming_the_variable_never_off(hub, tmp_path, monkeypatch, var):
    _publish(tmp_path, "someone/tiny")
    monkeypatch.setenv(var, "enabled")
    with pytest.raises(ValueError, match=rf"{var}='enabled' is not a boolean"):
        get_kernel("someone/tiny", version=1)


def test_env_flag_parses_every_boolean_the_same_way(monkeypatch):
    from kernelhub._env import env_flag

    cases = [("1", True), ("On", True), ("yes", True), ("0", False), ("OFF", False), ("No", False), ("", True)]
    for raw, want in cases:
        monkeypatch.setenv("KERNELHUB_X", raw)
        assert env_flag("KERNELHUB_X", default=True) is want, raw
    monkeypatch.delenv("KERNELHUB_X")
    assert env_flag("KERNELHUB_X") is False


@pytest.mark.parametrize(
    "revision", ["../../../../SOMEWHERE", "v1/../../x", "/etc/passwd", "a\\b", ".hidden", "x.lock"]
)
def test_a_revision_that_could_leave_the_cache_is_refused_before_any_io(hub, tmp_path, monkeypatch, revision):
    """`refs/<revision>` was joined unchecked: online a server that resolved it made kernelhub write
    outside the cache; offline the same join read any file as a ref."""
    _publish(tmp_path, "org/tiny")
    before = len(hub.store.requests)
    for call in (lambda: get_kernel("org/tiny", revision=revision, trust_remote_code=True),
                 lambda: has_kernel("org/tiny", revision=revision),
                 lambda: LayerRepository("org/tiny", layer_name="TinyScale", revision=revision)):
        with pytest.raises(ValueError, match="`revision` .* is not a valid git revision"):
            call()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="`revision` .* is not a valid git revision"):
        get_kernel("org/tiny", revision=revision, trust_remote_code=True)
    assert len(hub.store.requests) == before


def test_offline_a_traversing_revision_does_not_read_a_file_outside_the_cache(hub, tmp_path, monkeypatch):
    """A file outside the cache that looks like a ref (40 hex digits) must not become the commit."""
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    (tmp_path / "FAKE").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="not a valid git revision"):
        hubmod.resolve_kernel("org/tiny", revision="../../../FAKE")


def test_branch_names_with_slashes_stay_valid_revisions(hub, tmp_path):
    from huggingface_hub import HfApi

    commit = _publish(tmp_path, "org/tiny")
    HfApi(endpoint=hub.url).create_branch("org/tiny", branch="release/2", repo_type="kernel", revision=commit)
    assert _scale_of(get_kernel("org/tiny", revision="release/2", trust_remote_code=True)) == 2.0


def _files_outside(tmp_path: Path) -> set[Path]:
    """Files under tmp_path that are neither the local Hub's storage nor the cache."""
    return {p for p in tmp_path.rglob("*") if p.relative_to(tmp_path).parts[0] not in ("cache", "hubdata")}


def _hostile_commit(endpoint_name: str):
    def rewrite(endpoint, body):
        if endpoint == endpoint_name == "revision":
            return {**body, "sha": "../../../x"}
        if endpoint == endpoint_name == "refs":
            return {**body, "branches": [{**b, "targetCommit": "../../../x"} for b in body["branches"]]}
        return body

    return rewrite


@pytest.mark.parametrize(("endpoint", "kwargs"), [("revision", {"revision": "v1"}), ("refs", {"version": 1})])
def test_a_commit_id_from_the_hub_that_is_not_40_hex_is_refused(hub, tmp_path, endpoint, kwargs):
    """A commit id "../../../x" from the server made a lock file outside the cache."""
    _publish(tmp_path, "org/tiny")
    before = _files_outside(tmp_path)
    hub.store.rewrite_json = _hostile_commit(endpoint)
    with pytest.raises(KernelHubError, match=r"sent the commit of .*'\.\./\.\./\.\./x'.* not a 40-hex-digit"):
        get_kernel("org/tiny", trust_remote_code=True, **kwargs)
    assert _files_outside(tmp_path) == before


def test_an_etag_that_would_place_a_blob_outside_the_cache_is_refused(hub, tmp_path):
    """huggingface_hub writes blobs/<ETag> unchecked: a hostile ETag wrote outside the cache."""
    _publish(tmp_path, "org/tiny")
    before = _files_outside(tmp_path)
    hub.store.rewrite_file = lambda method, path, data, headers: (data, {**headers, "ETag": '"../../../PWNED"'})
    with pytest.raises(KernelHubError, match=r"ETag '\"\.\./\.\./\.\./PWNED\"'.*outside the cache"):
        get_kernel("org/tiny", version=1, trust_remote_code=True)
    assert _files_outside(tmp_path) == before


@pytest.mark.parametrize(
    ("entry", "pattern"),
    [
        ({"type": "directory", "path": "build/..", "oid": "0" * 40}, "listed 'build/..' under build/"),
        ({"type": "file", "path": "build/torch-universal/../../../x.py", "size": 1, "oid": "0" * 40},
         r"listed file 'build/torch-universal/\.\./\.\./\.\./x\.py'"),
        ({"type": "file", "path": "build/torch-universal/tiny/big.py", "size": -3, "oid": "0" * 40},
         "gave 'build/torch-universal/tiny/big.py' .* the size -3"),
    ],
)
def test_names_and_sizes_in_a_tree_listing_are_checked(hub, tmp_path, entry, pattern):
    _publish(tmp_path, "org/tiny")
    before = _files_outside(tmp_path)
    hub.store.rewrite_json = lambda endpoint, body: body + [entry] if endpoint == "tree" else body
    with pytest.raises(KernelHubError, match=pattern):
        get_kernel("org/tiny", version=1, trust_remote_code=True)
    assert _files_outside(tmp_path) == before


def test_a_truncated_download_is_a_kernel_hub_error(hub, tmp_path):
    _publish(tmp_path, "org/tiny")
    hub.store.rewrite_file = lambda method, path, data, headers: (data[:5] if method == "GET" else data, headers)
    with pytest.raises(KernelHubError, match="failed for kernel repository 'org/tiny'.*Consistency check failed"):
        get_kernel("org/tiny", version=1, trust_remote_code=True)


def test_a_file_removed_from_a_complete_snapshot_is_downloaded_again_online(hub, tmp_path):
    """The completion marker was trusted: a file deleted afterwards gave a raw ModuleNotFoundError."""
    _publish(tmp_path, "org/tiny")
    path = hubmod.resolve_kernel("org/tiny", version=1).path
    ops = path / "tiny" / "ops.py"
    ops.unlink()
    assert hubmod.resolve_kernel("org/tiny", version=1).path == path
    assert ops.is_file() and "FACTOR = 2.0" in ops.read_text()


def test_offline_a_file_removed_from_a_complete_snapshot_is_named(hub, tmp_path, monkeypatch):
    _publish(tmp_path, "org/tiny")
    path = hubmod.resolve_kernel("org/tiny", version=1).path
    (path / "tiny" / "ops.py").unlink()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(KernelHubError, match=r"offline .* lost build/torch-universal/tiny/ops\.py from the cache"):
        get_kernel("org/tiny", version=1, trust_remote_code=True)


def test_a_build_of_empty_directories_does_not_hide_the_source(tmp_path):
    """Empty `build/<variant>/` directories (a checkout or copy that removed the files it tracked)
    are no build: the repository still loads from torch-ext/."""
    import shutil

    src = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "kernels" / "tiny"
    repo = tmp_path / "tiny"
    (repo / "torch-ext").mkdir(parents=True)
    shutil.copytree(src / "build" / "torch-universal" / "tiny", repo / "torch-ext" / "tiny")
    (repo / "build" / "torch-universal" / "tiny").mkdir(parents=True)
    assert get_local_kernel(repo).__file__.startswith(str((repo / "torch-ext").resolve()))
