"""Kernel repositories: where a layer's implementation comes from (a local directory, the Hub, a lock).

Every repository kind has the same interface, used by the registry and `kernelize`:
`.layer_name`, `load() -> type[nn.Module]`, `with_layer_name(name)`, `describe()`, value equality.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from torch import nn

from kernelhub._fetch import (
    KernelHubError,
    KernelNotFoundError,
    KernelVariantNotFoundError,
    KernelVersionNotFoundError,
    ResolvedKernel,
    check_repo_id,
    check_revision,
    default_repo_type,
    endpoint,
    list_variants,
    offline,
    resolve_kernel,
    user_agent_scope,
)
from kernelhub._loaded import RepoInfo, local_kernel_overrides, record_loaded
from kernelhub._loader import _package_dir, load_kernel_from_dir
from kernelhub._trust import (
    DEFAULT_TRUSTED_PUBLISHERS,
    UntrustedKernelError,
    UntrustedKernelWarning,
    _check_trust,
    _check_trust_arg,
    trusted_publishers,
)
from kernelhub.variants import rank_variants, system_for_backend

__all__ = [
    "DEFAULT_TRUSTED_PUBLISHERS",
    "KernelHubError",
    "KernelNotFoundError",
    "KernelVariantNotFoundError",
    "KernelVersionNotFoundError",
    "LayerRepository",
    "LocalLayerRepository",
    "LockedLayerRepository",
    "UntrustedKernelError",
    "UntrustedKernelWarning",
    "get_kernel",
    "get_local_kernel",
    "has_kernel",
    "trusted_publishers",
]

_kernel_cache: dict[tuple, ModuleType] = {}
_cache_lock = threading.Lock()


def _check_repo_id(func: str, repo_id: object) -> str:
    return check_repo_id(func, repo_id)


def _check_ref(func: str, revision: object, version: object) -> None:
    if revision == "":
        raise ValueError(f"{func}: `revision` must be a non-empty str, got ''")
    if revision is not None:
        check_revision(func, revision)
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise TypeError(f"{func}: `version` must be an int, got {version!r}")
    # version 0 (or any absent one) is no error here: as in `kernels`, the load says
    # "Version 0 not found, available versions: ..."
    if revision is not None and version is not None:
        raise ValueError(f"{func}: Either a revision or a version must be specified, not both "
                         f"(got {revision!r} and {version!r})")


def _check_layer_name(func: str, layer_name: object) -> str:
    if not isinstance(layer_name, str) or not layer_name.isidentifier():
        raise ValueError(f"{func}: `layer_name` must be a Python identifier, got {layer_name!r}")
    return layer_name


def _layer_from(kernel: ModuleType, layer_name: str, where: str) -> type[nn.Module]:
    layers = getattr(kernel, "layers", None)
    layer = getattr(layers, layer_name, None) if layers is not None else None
    if layer is None:
        found = sorted(n for n in dir(layers) if not n.startswith("_")
                       and isinstance(getattr(layers, n), type) and issubclass(getattr(layers, n), nn.Module)
                       ) if layers is not None else []
        raise AttributeError(f"kernel {where} has no layer {layer_name!r} in its `layers` (found {found})")
    return layer


def get_local_kernel(
    repo_path: str | Path,
    package_name: str | None = None,
    *,
    backend: str | None = None,
    trust_remote_code: bool | list[str] | None = None,
    user_agent: str | dict | None = None,
) -> ModuleType:
    """Import a kernel from disk: a repository root, its `build/` directory, a variant directory or a
    package directory (every layout Hugging Face `kernels` loads, and kernelhub's `torch-ext/` source).

    Args:
        repo_path: where the kernel is.
        package_name: the package to import where a variant holds several (optional, as `kernels`
            once required it).
        backend: load the variant for "cpu" or torch's own backend (default: this system's).
        trust_remote_code, user_agent: accepted as `kernels` takes them; a local kernel needs no trust.
    """
    if not isinstance(repo_path, (str, os.PathLike)):
        raise TypeError(
            f"get_local_kernel: `repo_path` must be a str or os.PathLike, got {type(repo_path).__name__}"
        )
    if package_name is not None and (not isinstance(package_name, str) or not package_name.isidentifier()):
        raise ValueError(f"get_local_kernel: `package_name` must be a Python identifier, got {package_name!r}")
    _check_trust_arg("get_local_kernel", trust_remote_code)
    system = system_for_backend("get_local_kernel", backend)
    kernel = load_kernel_from_dir(repo_path, package_name=package_name, system=system)
    record_loaded(kernel, Path(repo_path).resolve(), None)
    return kernel


def _local_override(func: str, repo_id: str, system) -> ModuleType | None:
    """The kernel `LOCAL_KERNELS` maps `repo_id` to, imported (None where it maps nothing)."""
    path = local_kernel_overrides().get(repo_id)
    if path is None:
        return None
    try:
        return get_local_kernel(path, backend=None if system is None else system.backend)
    except FileNotFoundError as e:  # FileNotFoundError and its phrase, as `kernels` raises
        raise FileNotFoundError(
            f"Could not find kernel in {path} ({func}: LOCAL_KERNELS maps {repo_id!r} there: {e})"
        ) from e


def get_kernel(
    repo_id: str,
    revision: str | None = None,
    version: int | None = None,
    *,
    backend: str | None = None,
    user_agent: str | dict | None = None,
    trust_remote_code: bool | list[str] | None = None,
    check_arch: bool = True,
) -> ModuleType:
    """Download (only the build variant this system runs) and import a kernel from the Hub.

    Args:
        repo_id: "org/name". `LOCAL_KERNELS` ("org/name=/path:...") loads it from disk instead.
        revision: a branch, tag or commit. Exclusive with `version`.
        version: N selects branch `vN` (a log warning says when a newer version exists).
            Neither given: the newest `vN` branch, else `main`.
        backend: load the variant for "cpu" or torch's own backend (default: this system's).
        user_agent: added to the Hub requests' user agent (a str or a dict of name -> version).
        trust_remote_code: True, or a list of repository ids holding `repo_id`, imports code from a
            publisher that is not trusted; otherwise such code is refused (UntrustedKernelError),
            as in Hugging Face `kernels`. Trusted publishers: see `trusted_publishers()`.
        check_arch: accepted as `kernels` takes it (variants are ranked by capability elsewhere).

    Raises:
        UntrustedKernelError, KernelNotFoundError (repo/revision), KernelVersionNotFoundError,
        KernelVariantNotFoundError.
    """
    _check_repo_id("get_kernel", repo_id)
    _check_ref("get_kernel", revision, version)
    _check_trust_arg("get_kernel", trust_remote_code)
    system = system_for_backend("get_kernel", backend)
    local = _local_override("get_kernel", repo_id, system)
    if local is not None:
        return local
    _check_trust(repo_id, trust_remote_code)
    with user_agent_scope(user_agent):
        resolved = resolve_kernel(repo_id, revision=revision, version=version, system=system)
    return _import_resolved(resolved)


def _import_resolved(resolved: ResolvedKernel, *, verified: dict[str, str] | None = None) -> ModuleType:
    try:
        kernel = load_kernel_from_dir(resolved.path, verified=verified)
    except FileNotFoundError as e:  # a variant directory the loader cannot use (no single package)
        raise KernelHubError(f"kernel {resolved.repo_id!r} at {resolved.commit[:12]}: {e}") from e
    if not hasattr(kernel, "__kernelhub_source__"):
        kernel.__kernelhub_source__ = resolved  # for reports: which commit and variant this module is
    record_loaded(kernel, resolved.path, RepoInfo(resolved.repo_id, resolved.commit))
    return kernel


def has_kernel(
    repo_id: str,
    revision: str | None = None,
    version: int | None = None,
    *,
    backend: str | None = None,
    trust_remote_code: bool | list[str] | None = None,
    check_arch: bool = True,
) -> bool:
    """Whether `repo_id` at that revision/version has a build variant this system (or `backend`) can
    run; nothing is downloaded or imported, so no trust is needed (`trust_remote_code` and
    `check_arch` are accepted as `kernels` takes them)."""
    _check_repo_id("has_kernel", repo_id)
    _check_ref("has_kernel", revision, version)
    _check_trust_arg("has_kernel", trust_remote_code)
    system = system_for_backend("has_kernel", backend)
    local = local_kernel_overrides().get(repo_id)
    if local is not None:
        try:
            _package_dir(local, None, system)
        except (FileNotFoundError, OSError):
            return False
        return True
    try:
        _ref, _commit, names = list_variants(repo_id, revision=revision, version=version)
    except KernelNotFoundError:
        return False
    return bool(rank_variants(names, system)[0])


class LocalLayerRepository:
    """A layer class from a kernel repository on disk (e.g. the bundled `kernels_repo/swiglu`).

    `LocalLayerRepository(repo_path, package_name=None, *, layer_name)`: the `kernels` spellings,
    positional or keyword (kernelhub's earlier `path=` too); any layout `get_local_kernel` loads.
    """

    def __init__(
        self,
        repo_path: str | Path | None = None,
        package_name: str | None = None,
        *,
        layer_name: str,
        path: str | Path | None = None,
    ):
        if (repo_path is None) == (path is None):
            raise TypeError("LocalLayerRepository: give the repository directory once, as `repo_path` (or `path`)")
        repo_path = repo_path if path is None else path
        if not isinstance(repo_path, (str, Path)) or not str(repo_path):
            raise TypeError(f"LocalLayerRepository: `repo_path` must be a str or Path, got {repo_path!r}")
        if package_name is not None and (not isinstance(package_name, str) or not package_name.isidentifier()):
            raise ValueError(f"LocalLayerRepository: `package_name` must be a Python identifier, got {package_name!r}")
        self.path = Path(repo_path)
        self.package_name = package_name
        self.layer_name = _check_layer_name("LocalLayerRepository", layer_name)

    @property
    def repo_path(self) -> Path:
        return self.path

    def load(self) -> type[nn.Module]:
        return _layer_from(get_local_kernel(self.path, self.package_name), self.layer_name, f"at {self.path}")

    def with_layer_name(self, name: str) -> LocalLayerRepository:
        return LocalLayerRepository(self.path, self.package_name, layer_name=name)

    def describe(self) -> str:
        return f"local:{self.path}/{self.layer_name}"

    def __repr__(self) -> str:
        return f"LocalLayerRepository({str(self.path)!r}, layer_name={self.layer_name!r})"

    def _key(self) -> tuple:
        """What it loads: the package directory where the path resolves to one (so `package_name`
        given or left to the loader to find compares equal), else the path and the name as given."""
        try:
            where = str(_package_dir(self.path, self.package_name))
        except (OSError, ValueError):
            where = f"{self.path.resolve()}:{self.package_name}"
        return where, self.layer_name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LocalLayerRepository) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(("local",) + self._key())


class LayerRepository:
    """A layer class from a kernel on the Hub, by version (branch `vN`) or revision (branch/tag/commit).

    The kernel is resolved and imported once per process and endpoint; several versions of one
    kernel load side by side (each snapshot imports under its own module name).
    """

    def __init__(
        self,
        repo_id: str,
        *,
        layer_name: str,
        revision: str | None = None,
        version: int | None = None,
        trust_remote_code: bool | list[str] | None = None,
        user_agent: str | dict | None = None,
    ):
        self.repo_id = _check_repo_id("LayerRepository", repo_id)
        self.layer_name = _check_layer_name("LayerRepository", layer_name)
        _check_ref("LayerRepository", revision, version)
        _check_trust_arg("LayerRepository", trust_remote_code)
        if user_agent is not None and not isinstance(user_agent, (str, dict)):
            raise TypeError(f"LayerRepository: `user_agent` must be a str, a dict or None, got {user_agent!r}")
        if isinstance(trust_remote_code, list):
            trust_remote_code = list(trust_remote_code)  # (a copy: the caller's list may change)
        self.revision, self.version, self.trust_remote_code = revision, version, trust_remote_code
        self.user_agent = user_agent

    def load_kernel(self) -> ModuleType:
        # every load decides trust anew: a kernel imported once (trusted then) must not reach a
        # repository object that is not trusted, or a process whose trusted list changed, through the cache
        local = local_kernel_overrides().get(self.repo_id)
        if local is None:  # (a LOCAL_KERNELS path is the user's own code, as in `kernels`)
            _check_trust(self.repo_id, self.trust_remote_code)
        key = (endpoint(), offline(), default_repo_type(), self.repo_id, self.revision, self.version,
               str(local) if local is not None else None)
        with _cache_lock:
            kernel = _kernel_cache.get(key)
        if kernel is None:
            kernel = get_kernel(
                self.repo_id,
                revision=self.revision,
                version=self.version,
                trust_remote_code=self.trust_remote_code,
                user_agent=self.user_agent,
            )
            with _cache_lock:
                _kernel_cache[key] = kernel
        return kernel

    def load(self) -> type[nn.Module]:
        return _layer_from(self.load_kernel(), self.layer_name, self.describe())

    def check_trust(self) -> None:
        """Raise UntrustedKernelError where this repository may not be imported now (for callers
        that keep the loaded layer: the trust decision is made per use, as `load_kernel` does)."""
        if self.repo_id not in local_kernel_overrides():
            _check_trust(self.repo_id, self.trust_remote_code)

    def with_layer_name(self, name: str) -> LayerRepository:
        return LayerRepository(
            self.repo_id,
            layer_name=name,
            revision=self.revision,
            version=self.version,
            trust_remote_code=self.trust_remote_code,
            user_agent=self.user_agent,
        )

    def _ref(self) -> str:
        return (
            f"@v{self.version}"
            if self.version is not None
            else (f"@{self.revision}" if self.revision else "")
        )

    def describe(self) -> str:
        return f"hub:{self.repo_id}{self._ref()}/{self.layer_name}"

    def _key(self) -> tuple:
        trust = self.trust_remote_code
        return (self.repo_id, self.layer_name, self.revision, self.version,
                tuple(trust) if isinstance(trust, list) else trust)

    def __repr__(self) -> str:
        return (
            f"LayerRepository({self.repo_id!r}, layer_name={self.layer_name!r}, revision={self.revision!r}, "
            f"version={self.version!r})"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LayerRepository) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(("hub",) + self._key())


_DEFER_LOCK_CHECK: contextvars.ContextVar[bool] = contextvars.ContextVar("kernelhub_defer_lock_check", default=False)


@contextlib.contextmanager
def deferred_lock_check() -> Iterator[None]:
    """LockedLayerRepository built here reads its lock only when it loads: kernelize builds the
    config's repositories while choosing, and reports a kernel the lock lacks as a load failure."""
    token = _DEFER_LOCK_CHECK.set(True)
    try:
        yield
    finally:
        _DEFER_LOCK_CHECK.reset(token)


class LockedLayerRepository:
    """A layer class from a Hub kernel pinned in a lock file (`kernels.lock`): exact commit, hashed files.

    Loading refuses files whose sha256 differs from the lock. Locked kernels are trusted: the lock
    is the user's review of that exact code (`trust_remote_code` is accepted, as `kernels` takes it).
    `lockfile` defaults to `KERNELHUB_LOCKFILE`, else the `kernels.lock` the calling package ships in
    its distribution metadata (as `kernels`), else `./kernels.lock`; `version`/`revision` choose among
    several lock entries of one repository. A kernel an existing lock does not hold is refused here.
    """

    def __init__(
        self,
        repo_id: str,
        *,
        layer_name: str,
        lockfile: str | Path | None = None,
        version: int | None = None,
        revision: str | None = None,
        trust_remote_code: bool | list[str] | None = None,
    ):
        self.repo_id = _check_repo_id("LockedLayerRepository", repo_id)
        _check_trust_arg("LockedLayerRepository", trust_remote_code)
        # accepted as `kernels` takes it; a lock is the review of that exact code, so it is not needed
        self.trust_remote_code = list(trust_remote_code) if isinstance(trust_remote_code, list) else trust_remote_code
        self.layer_name = _check_layer_name("LockedLayerRepository", layer_name)
        _check_ref("LockedLayerRepository", revision, version)
        from kernelhub.lock import repository_lockfile

        self.lockfile = repository_lockfile("LockedLayerRepository", self.repo_id, lockfile, version=version,
                                            revision=revision, check=not _DEFER_LOCK_CHECK.get())
        self.version, self.revision = version, revision

    def load_kernel(self) -> ModuleType:
        from kernelhub.lock import get_locked_kernel

        return get_locked_kernel(
            self.repo_id, lockfile=self.lockfile, version=self.version, revision=self.revision
        )

    def load(self) -> type[nn.Module]:
        return _layer_from(self.load_kernel(), self.layer_name, self.describe())

    def with_layer_name(self, name: str) -> LockedLayerRepository:
        with deferred_lock_check():  # same kernel and lock: checked (or deferred) when this one was built
            return LockedLayerRepository(
                self.repo_id,
                layer_name=name,
                lockfile=self.lockfile,
                version=self.version,
                revision=self.revision,
                trust_remote_code=self.trust_remote_code,
            )

    def describe(self) -> str:
        ref = (
            f"@v{self.version}"
            if self.version is not None
            else (f"@{self.revision}" if self.revision else "")
        )
        return f"locked:{self.repo_id}{ref}/{self.layer_name}"

    def _key(self) -> tuple:
        lock = str(self.lockfile.resolve()) if self.lockfile is not None else None
        return (self.repo_id, self.layer_name, lock, self.version, self.revision)

    def __repr__(self) -> str:
        return (
            f"LockedLayerRepository({self.repo_id!r}, layer_name={self.layer_name!r}, "
            f"lockfile={str(self.lockfile) if self.lockfile else None!r})"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LockedLayerRepository) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(("locked",) + self._key())
