"""A kernel build's `metadata.json`, under Hugging Face `kernels`' name `Metadata`.

`kernels` parses the file with a schema that requires every field kernel-builder writes (`id`,
`license`, `backend`, ...); kernelhub's own builds write fewer, so here only `name` is required by
`from_bytes`/`read_from_file` and a field of the wrong type is a ValueError. Loading a kernel never
fails on its metadata: `Metadata.read` takes what it can and falls back to the package name.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["KernelName", "Metadata"]


class KernelName(str):
    """A kernel's name (a str); `python_name` is its importable spelling, as in `kernels`."""

    @property
    def python_name(self) -> str:
        return self.replace("-", "_")


_BYTES = (bytes, bytearray)  # (named before `from_bytes` shadows the builtin with `kernels`' parameter)

# metadata.json key -> (field, accepted types); `kernels`' spelling of the keys
_FIELDS: dict[str, tuple[str, tuple[type, ...]]] = {
    "id": ("id", (str,)),
    "version": ("version", (int,)),
    "kernels-minver": ("kernels_minver", (str,)),
    "license": ("license", (str,)),
    "upstream": ("upstream", (str,)),
    "source": ("source", (str,)),
    "python-depends": ("python_depends", (list,)),
    "kernel-depends": ("kernel_depends", (list,)),
    "backend": ("backend", (dict,)),
    "digest": ("digest", (dict,)),
    "provenance": ("provenance", (dict,)),
}


@dataclass(frozen=True)
class Metadata:
    """Parsed `metadata.json` of a kernel build variant (`kernels.Metadata`'s properties).

    `backend`, `digest`, `provenance` and the entries of `kernel_depends` are the file's JSON
    objects as they are; `raw` is the whole file.
    """

    name: KernelName
    version: int | None = None
    license: str | None = None
    python_depends: tuple[str, ...] = ()
    id: str | None = None
    kernels_minver: str | None = None
    upstream: str | None = None
    source: str | None = None
    kernel_depends: tuple[Any, ...] = ()
    backend: dict | None = None
    digest: dict | None = None
    provenance: dict | None = None
    raw: dict = field(default_factory=dict, compare=False)

    @staticmethod
    def from_bytes(bytes: bytes) -> Metadata:  # noqa: A002 - `kernels`' parameter name
        """Parse `metadata.json` from its bytes; ValueError on any parse error (as `kernels`)."""
        if not isinstance(bytes, _BYTES):
            raise TypeError(f"Metadata.from_bytes: `bytes` must be bytes, got {type(bytes).__name__}")
        try:
            raw = json.loads(bytes)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"Cannot parse metadata: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"Cannot parse metadata: expected a JSON object, got {type(raw).__name__}")
        return _parse(raw, strict=True, default_name=None)

    @staticmethod
    def read_from_file(metadata_path: str | os.PathLike[str]) -> Metadata:
        """Parse the `metadata.json` at `metadata_path`: OSError where it cannot be read, ValueError
        where it is no metadata (as `kernels`)."""
        if not isinstance(metadata_path, (str, os.PathLike)):
            raise TypeError(f"Metadata.read_from_file: `metadata_path` must be a path, got {metadata_path!r}")
        return Metadata.from_bytes(Path(metadata_path).read_bytes())

    @staticmethod
    def read(variant_dir: Path, package_dir: Path) -> Metadata:
        """The metadata of a loaded kernel (the variant's file, else its package's): never raises;
        what is missing or malformed is left out, and the name falls back to the package's."""
        raw: dict = {}
        for candidate in (variant_dir / "metadata.json", package_dir / "metadata.json"):
            try:
                data = json.loads(candidate.read_text())
            except (OSError, ValueError, RecursionError):  # (the file is the kernel's: any bytes)
                continue
            if isinstance(data, dict):
                raw = data
                break
        return _parse(raw, strict=False, default_name=package_dir.name)


def _parse(raw: dict, *, strict: bool, default_name: str | None) -> Metadata:
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        if strict:
            raise ValueError(f"Cannot parse metadata: missing field `name` (a non-empty string), got {name!r}")
        name = default_name or ""
    values: dict[str, Any] = {}
    for key, (attr, types) in _FIELDS.items():
        value = raw.get(key)
        if value is None:
            continue
        if attr == "python_depends" and isinstance(value, list) and not strict:
            value = [d for d in value if isinstance(d, str)]  # (loading keeps what it can read)
        ok = isinstance(value, types) and not isinstance(value, bool)
        if ok and attr == "python_depends":
            ok = all(isinstance(d, str) for d in value)
        if not ok:
            if strict:
                raise ValueError(f"Cannot parse metadata: invalid type for `{key}`: {value!r}")
            continue
        values[attr] = tuple(value) if isinstance(value, list) else value
    return Metadata(name=KernelName(name), raw=raw, **values)
