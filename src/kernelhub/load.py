"""The rest of Hugging Face `kernels`' loading API: `install_kernel`, `load_kernel`,
`get_kernel_variants`, `get_loaded_kernels`, with its signatures and meanings."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from kernelhub._download import fetch_variant
from kernelhub._fetch import choose_variant, default_repo_type, list_variants, resolve_kernel, user_agent_scope
from kernelhub._loaded import LoadedKernel, RepoInfo, get_loaded_kernels, local_kernel_overrides
from kernelhub.hub import _check_ref, _check_repo_id, _check_trust, _check_trust_arg
from kernelhub.lock import _caller_distribution_lock, get_locked_kernel
from kernelhub.variants import Variant, VariantAccepted, VariantRejected, rank_variants, system_for_backend

__all__ = [
    "LoadedKernel",
    "RepoInfo",
    "get_kernel_variants",
    "get_loaded_kernels",
    "install_kernel",
    "load_kernel",
]


def install_kernel(
    repo_id: str,
    *,
    revision: str | None = None,
    version: int | None = None,
    backend: str | None = None,
    local_files_only: bool = False,
    user_agent: str | dict | None = None,
    trust_remote_code: bool | list[str] | None = None,
) -> Path:
    """Download the kernel's build variant for this system (or `backend`) into the cache, without
    importing it; returns the variant directory. Untrusted publishers are refused before anything is
    downloaded, as `kernels` does. `local_files_only`: from the cache only."""
    _check_repo_id("install_kernel", repo_id)
    _check_ref("install_kernel", revision, version)
    _check_trust_arg("install_kernel", trust_remote_code)
    system = system_for_backend("install_kernel", backend)
    _check_trust(repo_id, trust_remote_code)
    with user_agent_scope(user_agent):
        if not local_files_only:
            return resolve_kernel(repo_id, revision=revision, version=version, system=system).path
        repo_type = default_repo_type()
        ref, commit, names = list_variants(repo_id, revision=revision, version=version, repo_type=repo_type,
                                           local_only=True)
        variant = choose_variant(repo_id, commit, names, system)
        return fetch_variant(repo_id, repo_type, ref, commit, variant, local_only=True)


def load_kernel(repo_id: str, *, lockfile: str | Path | None, backend: str | None = None) -> ModuleType:
    """Import a locked kernel that is already in the cache; never downloads (as `kernels`).

    `lockfile=None`: the lock shipped in the calling package's distribution metadata.
    Raises KernelNotFoundError (not cached), KernelLockError (not locked, or files differ).
    """
    _check_repo_id("load_kernel", repo_id)
    if lockfile is None:
        lockfile = _caller_distribution_lock()
        if lockfile is None:
            raise ValueError(
                "load_kernel: Could not find a `kernels.lock` file in the caller's package metadata. Please lock "
                f"kernels with `kernelhub lock` (or `kernels lock <project>`) and then reinstall the project "
                f"(looking for {repo_id!r}), or pass `lockfile=`."
            )
    return get_locked_kernel(repo_id, lockfile=lockfile, backend=backend, local_only=True)


def get_kernel_variants(
    repo_id: str, *, revision: str | None = None, version: int | None = None, backend: str | None = None
) -> list[VariantAccepted | VariantRejected]:
    """Every build variant of the kernel, decided for this system (or `backend`): the usable ones
    first, best first, each a `VariantAccepted`; then each `VariantRejected` with its reason."""
    _check_repo_id("get_kernel_variants", repo_id)
    _check_ref("get_kernel_variants", revision, version)
    system = system_for_backend("get_kernel_variants", backend)
    local = local_kernel_overrides().get(repo_id)
    if local is not None:
        build = local / "build" if (local / "build").is_dir() else local
        names = sorted(p.name for p in build.iterdir() if p.is_dir())
    else:
        names = list_variants(repo_id, revision=revision, version=version)[2]
    usable, rejected = rank_variants(names, system)
    out: list[VariantAccepted | VariantRejected] = [VariantAccepted(Variant.parse(n)) for n in usable]
    for name, reason in sorted(rejected.items()):
        try:
            variant: Variant | str = Variant.parse(name)
        except ValueError:
            variant = name
        out.append(VariantRejected(variant, reason))
    return out
