"""Kernel repositories: where a layer's implementation comes from (local directory or the Hub)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from torch import nn

from kernelhub._loader import load_kernel_from_dir

__all__ = ["LocalLayerRepository", "get_local_kernel"]


def get_local_kernel(path: str | Path) -> ModuleType:
    """Import a kernel from a local kernel repository, variant directory or package directory."""
    return load_kernel_from_dir(path)


class LocalLayerRepository:
    """A layer class from a kernel repository on disk (e.g. the bundled `kernels_repo/swiglu`)."""

    def __init__(self, path: str | Path, *, layer_name: str):
        if not isinstance(layer_name, str) or not layer_name:
            raise ValueError(f"LocalLayerRepository: `layer_name` must be a non-empty str, got {layer_name!r}")
        self.path = Path(path)
        self.layer_name = layer_name

    def load(self) -> type[nn.Module]:
        kernel = get_local_kernel(self.path)
        layers = getattr(kernel, "layers", None)
        layer = getattr(layers, self.layer_name, None) if layers is not None else None
        if layer is None:
            raise AttributeError(f"kernel at {self.path} has no layer {self.layer_name!r} in its `layers`")
        return layer

    def __repr__(self) -> str:
        return f"LocalLayerRepository({str(self.path)!r}, layer_name={self.layer_name!r})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, LocalLayerRepository)
            and self.path.resolve() == other.path.resolve()
            and self.layer_name == other.layer_name
        )

    def __hash__(self) -> int:
        return hash((str(self.path.resolve()), self.layer_name))
