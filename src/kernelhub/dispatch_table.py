"""A kernel repository's declared variants: which layer class serves which device, from kernel.toml.

kernel.toml is the one home of that decision: the default mapping is built from it here, and each
bundled kernel's automatic choice reads the same file with its own small reader (kernel code
imports no kernelhub module but `kernelhub.device`). The schema (docs/dispatch.md):

    [dispatch]
    cpu = "reference"                 # the variant for CPU tensors
    other_cuda = "sm80"               # a CUDA GPU in none of the ranges (the mapping binds nothing)
    cuda = [ { capability = [80, 89], variant = "sm80" }, ... ]   # inclusive, disjoint

    [dispatch_fp8]                    # more tables of that schema (`dispatch_<name>`), for layers
    ...                               # whose variants serve other capability ranges

    [layers.SwiGLUMLPSm80]            # one table per layer class in the package's layers module
    layer = "SwiGLUMLP"               # the layer name kernelize matches; absent: the class is the layer
    variant = "sm80"                  # the kernels it runs; absent: chosen per device by its table
    dispatch = "dispatch"             # the table its layer chooses from (default [dispatch]); set on
    has_backward = true               # one class of a layer, it holds for all of them
    can_torch_compile = true
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["CudaRange", "DispatchRanges", "DispatchTable", "LayerClass", "read_dispatch_table"]

_FN = "read_dispatch_table"
DEFAULT_TABLE = "dispatch"


@dataclass(frozen=True)
class LayerClass:
    """One `[layers.<name>]` entry: a class of the package's layers module."""

    name: str
    layer: str
    variant: str | None
    description: str
    has_backward: bool
    can_torch_compile: bool
    # the table its layer chooses from, as this entry declares it (None: not declared here)
    dispatch: str | None = None


@dataclass(frozen=True)
class CudaRange:
    min_capability: int
    max_capability: int
    variant: str


@dataclass(frozen=True)
class DispatchRanges:
    """One table of the [dispatch] schema (`[dispatch]`, `[dispatch_fp8]`, ...), validated."""

    name: str
    cpu: str | None
    other_cuda: str | None
    cuda: tuple[CudaRange, ...]

    def variant_for(self, capability: int | None) -> str | None:
        """The variant on a CUDA GPU of `capability`, or on the CPU (None)."""
        if capability is None:
            return self.cpu
        for r in self.cuda:
            if r.min_capability <= capability <= r.max_capability:
                return r.variant
        return self.other_cuda

    @property
    def mapped(self) -> list[str]:
        """The variants the default mapping binds somewhere (the CUDA ranges' and the CPU's)."""
        return list(dict.fromkeys([r.variant for r in self.cuda] + ([self.cpu] if self.cpu else [])))


@dataclass(frozen=True)
class DispatchTable:
    """kernel.toml's dispatch tables and `[layers]`, validated."""

    path: Path
    tables: tuple[DispatchRanges, ...]
    classes: tuple[LayerClass, ...]

    @property
    def layers(self) -> list[str]:
        """The layer names kernelize matches (mapping keys), in declaration order."""
        return list(dict.fromkeys(c.layer for c in self.classes))

    def table(self, name: str = DEFAULT_TABLE) -> DispatchRanges:
        """The table `name` ([dispatch] when kernel.toml has none: nothing declared, nothing bound)."""
        for t in self.tables:
            if t.name == name:
                return t
        if name == DEFAULT_TABLE:
            return DispatchRanges(DEFAULT_TABLE, None, None, ())
        raise ValueError(f"{_FN}: {self.path}: no [{name}] table")

    def dispatch_of(self, layer: str) -> str:
        """The name of the table `layer` chooses its variant from ([dispatch] unless a class says otherwise)."""
        for c in self.classes:
            if c.layer == layer and c.dispatch is not None:
                return c.dispatch
        return DEFAULT_TABLE

    def ranges_for(self, layer: str) -> DispatchRanges:
        """The table `layer` chooses its variant from."""
        return self.table(self.dispatch_of(layer))

    # [dispatch]'s fields, as before layers could name other tables
    @property
    def cpu(self) -> str | None:
        return self.table().cpu

    @property
    def other_cuda(self) -> str | None:
        return self.table().other_cuda

    @property
    def cuda(self) -> tuple[CudaRange, ...]:
        return self.table().cuda

    def variant_for(self, capability: int | None, layer: str | None = None) -> str | None:
        """The variant the automatic choice runs: on a CUDA GPU of `capability`, or the CPU (None),
        by `layer`'s table (default: [dispatch])."""
        return (self.table() if layer is None else self.ranges_for(layer)).variant_for(capability)

    def class_for(self, layer: str, variant: str) -> str:
        """The class of `layer` that runs `variant` on any device."""
        for c in self.classes:
            if c.layer == layer and c.variant == variant:
                return c.name
        raise ValueError(f"{_FN}: {self.path}: no [layers.<class>] of layer {layer!r} for variant {variant!r}")

    def variant_of(self, class_name: str) -> str | None:
        """The variant a class runs (None: the generic layer, which chooses per device)."""
        for c in self.classes:
            if c.name == class_name:
                return c.variant
        raise ValueError(f"{_FN}: {self.path}: no [layers.{class_name}]")


def _bad(path: Path, key: str, want: str, got: object) -> ValueError:
    return ValueError(f"{_FN}: {path}: `{key}` must be {want}, got {got!r}")


def _variant(path: Path, key: str, value: object, optional: bool = True) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise _bad(path, key, "a variant name (a non-empty string)", value)
    return value


def _cuda_ranges(path: Path, table: str, value: object) -> tuple[CudaRange, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _bad(path, f"{table}.cuda", "a list of {capability = [min, max], variant = ...}", value)
    ranges = []
    for i, entry in enumerate(value):
        key = f"{table}.cuda[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"capability", "variant"}:
            raise _bad(path, key, "a table {capability = [min, max], variant = ...}", entry)
        cap = entry["capability"]
        if (not isinstance(cap, list) or len(cap) != 2 or not all(type(c) is int and c >= 0 for c in cap)
                or cap[0] > cap[1]):
            raise _bad(path, f"{key}.capability", "[min, max], ints with min <= max (90 = sm90)", cap)
        ranges.append(CudaRange(cap[0], cap[1], _variant(path, f"{key}.variant", entry["variant"], False)))
    ranges.sort(key=lambda r: r.min_capability)
    for a, b in zip(ranges, ranges[1:]):
        if b.min_capability <= a.max_capability:
            raise ValueError(f"{_FN}: {path}: `{table}.cuda` ranges [{a.min_capability}, {a.max_capability}] "
                             f"and [{b.min_capability}, {b.max_capability}] overlap")
    return tuple(ranges)


def _is_table_name(name: str) -> bool:
    return name == DEFAULT_TABLE or name.startswith(DEFAULT_TABLE + "_")


def _dispatch_tables(path: Path, data: dict) -> tuple[DispatchRanges, ...]:
    """[dispatch] and every `[dispatch_<name>]` of kernel.toml, each of the [dispatch] schema."""
    tables = []
    for name, value in data.items():
        if not _is_table_name(name):
            continue
        if not isinstance(value, dict):
            raise _bad(path, name, "a table", value)
        unknown = sorted(set(value) - {"cpu", "other_cuda", "cuda"})
        if unknown:
            raise ValueError(f"{_FN}: {path}: unknown key(s) {unknown} in [{name}]; allowed: cpu, other_cuda, cuda")
        tables.append(DispatchRanges(name, _variant(path, f"{name}.cpu", value.get("cpu")),
                                     _variant(path, f"{name}.other_cuda", value.get("other_cuda")),
                                     _cuda_ranges(path, name, value.get("cuda"))))
    return tuple(tables)


def _classes(path: Path, layers: object, tables: set[str]) -> tuple[LayerClass, ...]:
    if not isinstance(layers, dict):
        return ()  # a plain list of class names: nothing declared per class
    classes = []
    for name, entry in layers.items():
        key = f"layers.{name}"
        if not isinstance(entry, dict):
            raise _bad(path, key, "a table", entry)
        for flag in ("has_backward", "can_torch_compile"):
            if type(entry.get(flag)) is not bool:
                raise _bad(path, f"{key}.{flag}", "true or false", entry.get(flag))
        layer, variant = entry.get("layer"), entry.get("variant")
        if (layer is None) != (variant is None):
            raise ValueError(f"{_FN}: {path}: `{key}` must set both `layer` and `variant` (a variant class) "
                             "or neither (the layer itself)")
        if layer is not None and (not isinstance(layer, str) or not layer.isidentifier()):
            raise _bad(path, f"{key}.layer", "a layer name (an identifier)", layer)
        dispatch = entry.get("dispatch")
        if dispatch is not None and (not isinstance(dispatch, str) or dispatch not in tables | {DEFAULT_TABLE}):
            raise _bad(path, f"{key}.dispatch", f"the name of a dispatch table of this file {sorted(tables)}",
                       dispatch)
        classes.append(LayerClass(name, layer or name, _variant(path, f"{key}.variant", variant),
                                  str(entry.get("description", "")), entry["has_backward"],
                                  entry["can_torch_compile"], dispatch))
    return tuple(classes)


def _check_layers(table: DispatchTable) -> None:
    """Each layer names one table, and every variant the mapping binds from it has a class of the layer."""
    for layer in table.layers:
        named = {c.name: c.dispatch for c in table.classes if c.layer == layer and c.dispatch is not None}
        if len(set(named.values())) > 1:
            raise ValueError(f"{_FN}: {table.path}: the classes of layer {layer!r} name different dispatch "
                             f"tables: {named}")
        for variant in table.ranges_for(layer).mapped:
            table.class_for(layer, variant)


@functools.lru_cache(maxsize=64)
def _read(path: Path, mtime_ns: int) -> DispatchTable:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{_FN}: {path}: not valid UTF-8 TOML: {e}") from e
    except RecursionError:  # the parser recurses per nesting level
        raise ValueError(f"{_FN}: {path}: not valid TOML: nested too deeply") from None
    tables = _dispatch_tables(path, data)
    table = DispatchTable(path, tables, _classes(path, data.get("layers"), {t.name for t in tables}))
    _check_layers(table)
    return table


def read_dispatch_table(repo: str | Path) -> DispatchTable:
    """The declarations of the kernel repository at `repo` (its directory, or its kernel.toml).

    Cached per file and modification time: the mapping and the matcher read it often, and an edit
    (a test's modified copy, a developer's change) is seen on the next read.
    """
    if not isinstance(repo, (str, Path)):
        raise TypeError(f"{_FN}: `repo` must be a str or Path, got {type(repo).__name__}")
    path = Path(repo)
    if path.is_dir():
        path = path / "kernel.toml"
    if not path.is_file():
        raise FileNotFoundError(f"{_FN}: `repo`: no kernel.toml at {path}")
    path = path.resolve()
    return _read(path, path.stat().st_mtime_ns)
