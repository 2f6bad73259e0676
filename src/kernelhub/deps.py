"""`get_kernel_dep`: how a kernel reaches another kernel it depends on, as in Hugging Face `kernels`.

A kernel calls it while it is being imported; kernelhub's loader opens that window around every
kernel import. kernelhub does not resolve `kernel-depends` from metadata.json (none of its kernels
has any), so inside the window every dependency is reported missing, with `kernels`' message.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import ModuleType

__all__ = ["get_kernel_dep", "use_kernel_deps"]

# None: no kernel is being imported (a ContextVar: one thread's import is not another's)
_KERNEL_DEPS: ContextVar[dict[str, ModuleType] | None] = ContextVar("kernelhub_kernel_deps", default=None)


@contextmanager
def use_kernel_deps(deps: dict[str, ModuleType]) -> Iterator[None]:
    """Within this block a kernel being imported gets `deps` ({repo_id: module}) from get_kernel_dep."""
    token = _KERNEL_DEPS.set(deps)
    try:
        yield
    finally:
        _KERNEL_DEPS.reset(token)


def get_kernel_dep(repo_id: str) -> ModuleType:
    """The kernel `repo_id` that the kernel now being imported depends on (RuntimeError otherwise)."""
    if not isinstance(repo_id, str):
        raise TypeError(f"get_kernel_dep: `repo_id` must be a str, got {repo_id!r}")
    deps = _KERNEL_DEPS.get()
    if deps is None:
        raise RuntimeError("`get_kernel_dep` only works during kernel loading.")
    module = deps.get(repo_id)
    if module is None:
        raise RuntimeError(
            f"Dependency '{repo_id}' not found in kernel dependencies. Ensure the dependency is added to "
            "`kernel-deps` in build.toml."
        )
    return module
