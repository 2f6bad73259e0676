"""This kernel's declared variants, read from its kernel.toml (the one home of capability -> variant).

kernelhub builds its default mapping from the same file, so the automatic choice here and the
layer kernelize binds agree. kernel.toml sits in this package's directory in a built kernel
(`build/torch-universal/<name>/`) and two levels up in the source (`torch-ext/<name>/`). Parsed once:
the table is a property of the package, not of a device.
"""

from __future__ import annotations

import functools
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10 (tomli is a declared dependency there)
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["auto_variant", "declared_layers", "kernel_toml", "layer_table"]


def kernel_toml() -> Path:
    """kernel.toml of this package: beside it (built layout), else at the repository root (source)."""
    here = Path(__file__).absolute()  # not resolved: a Hub snapshot links each file to a blob elsewhere
    for path in (here.parent / "kernel.toml", here.parents[2] / "kernel.toml"):
        if path.is_file():
            return path
    raise FileNotFoundError(f"{here.parent.name}: no kernel.toml in {here.parent} or {here.parents[2]}")


def _table() -> dict:
    return _parse(kernel_toml())


@functools.lru_cache(maxsize=4)  # per file: the package's declarations, not a device property
def _parse(path: Path) -> dict:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    dispatch, layers = data.get("dispatch"), data.get("layers")
    if not isinstance(dispatch, dict) or not isinstance(layers, dict):
        raise ValueError(f"{path}: needs a [dispatch] table and [layers.<class>] tables")
    for name, spec in layers.items():  # a layer's own table must exist: never [dispatch] by mistake
        table = spec.get("dispatch", "dispatch") if isinstance(spec, dict) else "dispatch"
        if not isinstance(table, str) or not isinstance(data.get(table), dict):
            raise ValueError(f"{path}: [layers.{name}] `dispatch` must name a table of this file, got {table!r}")
    return data


_chosen: dict[tuple[str, int | None], str] = {}


def auto_variant(capability: int | None, table: str = "dispatch") -> str:
    """The variant the automatic choice runs on a CUDA GPU of `capability` (None: on the CPU), as
    kernel.toml's `table` declares it ([dispatch]; a kernel may declare more tables of that schema).

    Remembered per capability: an eager call pays one dict lookup, not a walk of the ranges."""
    hit = _chosen.get((table, capability))
    if hit is None:
        hit = _chosen[table, capability] = _lookup(capability, table)
    return hit


def _lookup(capability: int | None, table: str) -> str:
    dispatch = _table().get(table)
    if not isinstance(dispatch, dict):
        raise ValueError(f"{kernel_toml()}: needs a [{table}] table")
    key = "cpu"
    if capability is not None:
        for entry in dispatch.get("cuda", ()):
            low, high = entry["capability"]
            if low <= capability <= high:
                return entry["variant"]
        key = "other_cuda"
    if not isinstance(dispatch.get(key), str):
        where = "the CPU" if capability is None else f"capability {capability}"
        raise ValueError(f"{kernel_toml()}: [{table}] needs `{key}` (the variant for {where})")
    return dispatch[key]


def layer_table(layer: str) -> str:
    """The table `layer` chooses its variant from: the `dispatch` key of one of its classes
    ([layers.<class>] with `layer = ...`, or the class named as the layer), else [dispatch]."""
    for name, spec in _table()["layers"].items():
        if (spec.get("layer", name) == layer) and "dispatch" in spec:
            return spec["dispatch"]
    return "dispatch"


def declared_layers() -> list[tuple[str, dict]]:
    """[(class name, its [layers.<class>] table)] in declaration order."""
    return list(_table()["layers"].items())
