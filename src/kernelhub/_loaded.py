"""What this process has loaded, and the `LOCAL_KERNELS` overrides, as Hugging Face `kernels` has them.

`get_loaded_kernels()` lists one `LoadedKernel` per variant directory imported; `LOCAL_KERNELS`
("org/a=/path/a:org/b=/path/b") makes `get_kernel`/`has_kernel` load those repositories from disk.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from kernelhub.metadata import Metadata

__all__ = ["KernelMetadata", "LoadedKernel", "RepoInfo", "get_loaded_kernels", "local_kernel_overrides"]


@dataclass(frozen=True)
class RepoInfo:
    """Where a Hub kernel came from: its repository and the commit it resolved to."""

    repo_id: str
    revision: str


KernelMetadata = Metadata  # its earlier name here


@dataclass(frozen=True)
class LoadedKernel:
    """One kernel imported in this process: `metadata`, `module`, and `repo_info` (None for a local
    kernel), as `kernels.LoadedKernel`; kernelhub adds `path` (the variant directory)."""

    metadata: Metadata
    module: ModuleType
    repo_info: RepoInfo | None
    path: Path | None = None


_loaded: dict[str, LoadedKernel] = {}
_lock = threading.Lock()


def record_loaded(module: ModuleType, variant_dir: Path, repo_info: RepoInfo | None) -> None:
    package_dir = Path(module.__file__).parent if getattr(module, "__file__", None) else variant_dir
    with _lock:
        if module.__name__ not in _loaded:
            _loaded[module.__name__] = LoadedKernel(
                Metadata.read(variant_dir, package_dir), module, repo_info, variant_dir
            )


def get_loaded_kernels() -> list[LoadedKernel]:
    """Every kernel loaded into this process so far (a new list; one entry per imported variant).

    Example:
        >>> from kernelhub import get_local_kernel, get_loaded_kernels
        >>> isinstance(get_loaded_kernels(), list)
        True
    """
    with _lock:
        return list(_loaded.values())


def local_kernel_overrides() -> dict[str, Path]:
    """{repo_id: path} from `LOCAL_KERNELS` ("repo_id_1=path_1:repo_id_2=path_2"), read at call time."""
    raw = os.environ.get("LOCAL_KERNELS")
    if raw is None:
        return {}
    overrides = {}
    for entry in raw.split(":"):
        if "=" not in entry:
            raise ValueError(
                f"Invalid LOCAL_KERNELS entry: {entry}. Expected format: repo_id_1=path_1:repo_id_2=path_2"
            )
        repo_id, path = entry.split("=", 1)
        overrides[repo_id] = Path(path)
    return overrides
