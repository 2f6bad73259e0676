"""Function kernels: a mapping entry whose implementation is a function of a kernel, not a layer.

Hugging Face `kernels` (0.17) keeps these names for code written against earlier releases and
deprecates them in favour of layer repositories; kernelhub has them with the same semantics: the
function is wrapped in a stateless layer class (`create_func_module`) that kernelize binds like any
other layer. Loading goes through `kernelhub.hub`, so trust, caching and lock checks are the same.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import nn

from kernelhub.hub import LayerRepository, LockedLayerRepository, _check_repo_id, get_local_kernel
from kernelhub.layer import create_func_module, use_kernel_forward_from_hub
from kernelhub.lock import repository_lockfile

__all__ = ["FuncRepository", "LocalFuncRepository", "LockedFuncRepository", "use_kernel_func_from_hub"]


def _deprecated(what: str, instead: str) -> None:
    warnings.warn(
        f"{what} is deprecated (as in Hugging Face kernels, where it will be removed in kernels 0.17). "
        f"Use {instead} instead.",
        DeprecationWarning,
        stacklevel=3,
    )


def _check_func_name(owner: str, func_name: object) -> str:
    if not isinstance(func_name, str) or not func_name.isidentifier():
        raise ValueError(f"{owner}: `func_name` must be a Python identifier, got {func_name!r}")
    return func_name


def _func_layer(kernel: ModuleType, func_name: str, where: str) -> type[nn.Module]:
    func = getattr(kernel, func_name, None)
    if func is None or not callable(func):
        raise ValueError(f"Function `{func_name}` not found in `{where}`")
    return create_func_module(func)


class FuncRepository:
    """A function of a Hub kernel, by version (branch `vN`) or revision; `version` or `revision` is
    required, as in Hugging Face `kernels`."""

    def __init__(
        self,
        repo_id: str,
        *,
        func_name: str,
        revision: str | None = None,
        version: int | None = None,
        trust_remote_code: bool | list[str] = False,
    ):
        _deprecated("FuncRepository", "LayerRepository")
        if revision is not None and version is not None:
            raise ValueError("FuncRepository: Either a revision or a version must be specified, not both.")
        if revision is None and version is None:
            raise ValueError("FuncRepository: Either a revision or a version must be specified.")
        self.func_name = _check_func_name("FuncRepository", func_name)
        from kernelhub._trust import _check_trust_arg

        _check_trust_arg("FuncRepository", trust_remote_code)
        if isinstance(trust_remote_code, list):  # (a copy, as `kernels` keeps: later edits change nothing)
            trust_remote_code = list(trust_remote_code)
        # the Hub side (repo_id/ref checks, trust, the per-process kernel cache) is LayerRepository's
        self._hub = LayerRepository(
            repo_id, layer_name=func_name, revision=revision, version=version,
            trust_remote_code=trust_remote_code,  # a list: the repository ids trusted, as in `kernels`
        )
        self.repo_id, self.revision, self.version = repo_id, revision, version
        self.trust_remote_code = trust_remote_code

    def load(self) -> type[nn.Module]:
        return _func_layer(self._hub.load_kernel(), self.func_name, str(self))

    def check_trust(self) -> None:
        self._hub.check_trust()

    def describe(self) -> str:
        ref = f"@v{self.version}" if self.version is not None else f"@{self.revision}"
        return f"hub:{self.repo_id}{ref}/{self.func_name}()"

    def __str__(self) -> str:
        ref = self.revision if self.revision is not None else f"v{self.version}"
        return f"`{self.repo_id}` (revision: {ref}), function `{self.func_name}`"

    def _key(self) -> tuple:
        return (self.repo_id, self.func_name, self.revision, self.version, repr(self.trust_remote_code))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FuncRepository) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(("func",) + self._key())

    def __repr__(self) -> str:
        return (f"FuncRepository({self.repo_id!r}, func_name={self.func_name!r}, revision={self.revision!r}, "
                f"version={self.version!r})")


class LocalFuncRepository:
    """A function of a kernel repository on disk."""

    def __init__(self, repo_path: str | Path, *, func_name: str):
        _deprecated("LocalFuncRepository", "LocalLayerRepository")
        if not isinstance(repo_path, (str, Path)) or not str(repo_path):
            raise TypeError(f"LocalFuncRepository: `repo_path` must be a str or Path, got {repo_path!r}")
        self.path = Path(repo_path)
        self.func_name = _check_func_name("LocalFuncRepository", func_name)

    def load(self) -> type[nn.Module]:
        return _func_layer(get_local_kernel(self.path), self.func_name, str(self))

    def describe(self) -> str:
        return f"local:{self.path}/{self.func_name}()"

    def __str__(self) -> str:
        return f"`{self.path}` (function `{self.func_name}`)"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, LocalFuncRepository) and self.func_name == other.func_name
                and self.path.resolve() == other.path.resolve())

    def __hash__(self) -> int:
        return hash(("local-func", str(self.path.resolve()), self.func_name))

    def __repr__(self) -> str:
        return f"LocalFuncRepository({str(self.path)!r}, func_name={self.func_name!r})"


class LockedFuncRepository:
    """A function of a Hub kernel pinned in a lock file (verified as LockedLayerRepository is)."""

    def __init__(
        self,
        repo_id: str,
        *,
        func_name: str,
        lockfile: str | Path | None = None,
        trust_remote_code: bool | list[str] | None = None,
    ):
        _deprecated("LockedFuncRepository", "LockedLayerRepository")
        self.func_name = _check_func_name("LockedFuncRepository", func_name)
        # locked code is trusted: the lock is the review of that exact code, so the flag is kept only
        # for `kernels`' signature
        self.trust_remote_code = trust_remote_code
        _check_repo_id("LockedFuncRepository", repo_id)
        # resolved and checked here, as `kernels` does: a kernel the lock does not hold is refused now
        lockfile = repository_lockfile("LockedFuncRepository", repo_id, lockfile)
        self._locked = LockedLayerRepository(repo_id, layer_name=func_name, lockfile=lockfile)
        self.repo_id, self.lockfile = repo_id, self._locked.lockfile

    def load(self) -> type[nn.Module]:
        return _func_layer(self._locked.load_kernel(), self.func_name, str(self))

    def describe(self) -> str:
        return f"locked:{self.repo_id}/{self.func_name}()"

    def __str__(self) -> str:
        return f"`{self.repo_id}` (locked), function `{self.func_name}`"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, LockedFuncRepository) and self.func_name == other.func_name
                and self._locked == other._locked)

    def __hash__(self) -> int:
        return hash(("locked-func", self.func_name, self._locked))

    def __repr__(self) -> str:
        return f"LockedFuncRepository({self.repo_id!r}, func_name={self.func_name!r}, lockfile={self.lockfile!r})"


def use_kernel_func_from_hub(func_name: str) -> Callable[[Any], Any]:
    """Deprecated spelling of `use_kernel_forward_from_hub` for functions (as in `kernels`)."""
    _deprecated("use_kernel_func_from_hub", "use_kernel_forward_from_hub")
    return use_kernel_forward_from_hub(func_name)
