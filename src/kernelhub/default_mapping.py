"""The mapping kernelhub registers at import, built from the bundled kernel repositories' kernel.toml.

Each repository under `kernels_repo/` declares in its kernel.toml which variant serves which
capability (`[dispatch]`, or the `[dispatch_<name>]` table a layer names, e.g. `[dispatch_fp8]`) and
which layer class runs each variant (`[layers]`); this module turns those declarations into
`{layer: {Device: LocalLayerRepository}}` and holds no capability of its own.
"""

from __future__ import annotations

from pathlib import Path

from kernelhub.device import CUDAProperties, Device
from kernelhub.dispatch_table import read_dispatch_table
from kernelhub.hub import LocalLayerRepository

__all__ = [
    "bundled_kernels_dir",
    "bundled_repositories",
    "default_kernel_mapping",
    "home_repository",
    "kernel_mapping_from",
]


def bundled_kernels_dir() -> Path:
    """`kernels_repo/` shipped in the wheel, or the source checkout's copy in an editable install."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels_repo", here.parents[1] / "kernels_repo"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"bundled kernels_repo not found next to {here}")


def bundled_repositories(root: Path | None = None) -> list[Path]:
    """The kernel repositories under `root` (default `kernels_repo/`): every directory with a kernel.toml."""
    root = bundled_kernels_dir() if root is None else Path(root)
    return sorted(p for p in root.iterdir() if (p / "kernel.toml").is_file())


def kernel_mapping_from(repo: str | Path) -> dict[str, dict[Device, LocalLayerRepository]]:
    """`{layer: {Device: LocalLayerRepository}}` for one kernel repository, as its kernel.toml declares.

    Each layer reads its own table (`[dispatch]` unless its classes name another): a CUDA range maps
    to the class of its variant; a capability in no range gets no entry (kernelize keeps the
    module's own forward there, and says so).
    """
    repo = Path(repo)
    table = read_dispatch_table(repo)
    mapping: dict[str, dict[Device, LocalLayerRepository]] = {}
    for layer in table.layers:
        ranges = table.ranges_for(layer)
        entries: dict[Device, LocalLayerRepository] = {}
        for r in ranges.cuda:
            device = Device("cuda", properties=CUDAProperties(r.min_capability, r.max_capability))
            entries[device] = LocalLayerRepository(repo, layer_name=table.class_for(layer, r.variant))
        if ranges.cpu is not None:
            entries[Device("cpu")] = LocalLayerRepository(repo, layer_name=table.class_for(layer, ranges.cpu))
        if entries:
            mapping[layer] = entries
    return mapping


def default_kernel_mapping(root: Path | None = None) -> dict[str, dict[Device, LocalLayerRepository]]:
    """The mapping of every bundled kernel repository (or of those under `root`)."""
    mapping: dict[str, dict[Device, LocalLayerRepository]] = {}
    for repo in bundled_repositories(root):
        for layer, entries in kernel_mapping_from(repo).items():
            if layer in mapping:
                raise ValueError(f"default_kernel_mapping: layer {layer!r} is declared by two kernel "
                                 f"repositories ({repo} and {next(iter(mapping[layer].values())).path})")
            mapping[layer] = entries
    return mapping


def home_repository(layer: str, root: Path | None = None) -> Path | None:
    """The bundled kernel repository that declares `layer` (it also says which modules really are one)."""
    for repo in bundled_repositories(root):
        if layer in read_dispatch_table(repo).layers:
            return repo
    return None
