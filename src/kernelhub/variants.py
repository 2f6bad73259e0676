"""Build variants of a kernel repository: parse their names and rank them for this system.

A kernel repository holds one directory per build under `build/`, named as Hugging Face `kernels`
names them:

- `torch-universal`: pure Python/Triton, runs anywhere torch runs (what kernelhub's kernels are);
- `torch-<backend>` (`torch-cuda`, `torch-cpu`, ...): no compiled torch ABI, one backend;
- `torch<MAJOR><MINOR>-[cxx11-|cxx98-]<backend><version>-<cpu>-<os>`, e.g.
  `torch27-cxx11-cu128-x86_64-linux`: compiled against one torch, one CUDA/ROCm, one platform.

Ranking follows `kernels`: compiled variants for this torch/platform first (highest compatible CUDA
minor first; a CUDA x.z build runs on a system with CUDA x.y when z <= y), then backend noarch
builds, then `torch-universal`. Every rejection carries its reason, for `kernelhub variants`.
"""

from __future__ import annotations

import platform
import re
from dataclasses import dataclass

__all__ = ["SystemInfo", "Variant", "VariantAccepted", "VariantRejected", "rank_variants", "system_for_backend"]

_TORCH_RE = re.compile(r"^torch(\d)(\d+)$")
_BACKEND_RE = re.compile(r"^(cu|rocm|xpu|cpu|metal|npu|cann)(\d*)$")


def _backend_version(name: str, digits: str) -> tuple[int, ...] | None:
    """'cu' '128' -> (12, 8); 'rocm' '63' -> (6, 3); 'xpu' '20251' -> (2025, 1)."""
    if not digits:
        return None
    if name == "xpu" and len(digits) > 4:
        return (int(digits[:4]), int(digits[4:]))
    return (int(digits[:-1]), int(digits[-1])) if len(digits) > 1 else (int(digits),)


@dataclass(frozen=True)
class Variant:
    """One parsed build variant name."""

    name: str
    torch_version: tuple[int, int] | None  # None: no compiled torch ABI (noarch / universal)
    backend: str  # "universal", "cuda", "rocm", "xpu", "cpu", "metal", "npu"
    backend_version: tuple[int, ...] | None
    cpu: str | None
    os: str | None
    cxx11_abi: bool | None

    @property
    def variant_str(self) -> str:
        """The directory name (as `kernels`' variants name it)."""
        return self.name

    @staticmethod
    def parse(name: str) -> Variant:
        """Parse a variant directory name; ValueError names what is wrong."""
        parts = name.split("-")
        if len(parts) == 2 and parts[0] == "torch":
            backend = "cuda" if parts[1] == "cuda" else parts[1]
            return Variant(name, None, backend, None, None, None, None)
        m = _TORCH_RE.match(parts[0])
        if m is None:
            raise ValueError(
                f"Variant.parse: {name!r} is not a build variant name (e.g. 'torch-universal', "
                "'torch27-cxx11-cu128-x86_64-linux')"
            )
        rest = parts[1:]
        cxx11: bool | None = None
        if rest and rest[0] in ("cxx11", "cxx98"):
            cxx11 = rest[0] == "cxx11"
            rest = rest[1:]
        if len(rest) != 3:
            raise ValueError(
                f"Variant.parse: {name!r} must end in <backend>-<cpu>-<os>, got {'-'.join(rest)!r}"
            )
        b = _BACKEND_RE.match(rest[0])
        if b is None:
            raise ValueError(
                f"Variant.parse: unknown backend {rest[0]!r} in {name!r} (cuXYZ, rocmXY, xpu, cpu, metal)"
            )
        backend = {"cu": "cuda", "cann": "npu"}.get(b.group(1), b.group(1))
        return Variant(
            name,
            (int(m.group(1)), int(m.group(2))),
            backend,
            _backend_version(b.group(1), b.group(2)),
            rest[1],
            rest[2],
            cxx11,
        )


@dataclass(frozen=True)
class SystemInfo:
    """What a variant must match: torch version, backend (+version), cpu, os, C++ ABI."""

    torch_version: tuple[int, int]
    backend: str
    backend_version: tuple[int, ...] | None
    cpu: str
    os: str
    cxx11_abi: bool | None

    @staticmethod
    def current() -> SystemInfo:
        import torch

        major, minor = (int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
        cpu, os_name = platform.machine(), platform.system().lower()
        if os_name == "darwin" and cpu == "arm64":
            cpu = "aarch64"
        if os_name == "windows" and cpu == "AMD64":
            cpu = "x86_64"
        backend, version = "cpu", None
        if getattr(torch.version, "cuda", None):
            backend = "cuda"
            version = tuple(int(x) for x in torch.version.cuda.split(".")[:2])
        elif getattr(torch.version, "hip", None):
            backend = "rocm"
            version = tuple(int(x) for x in torch.version.hip.split(".")[:2])
        elif hasattr(torch, "xpu") and torch.xpu.is_available():
            backend = "xpu"
        elif os_name == "darwin":
            backend = "metal"
        abi = bool(torch.compiled_with_cxx11_abi()) if os_name == "linux" else None
        return SystemInfo((major, minor), backend, version, cpu, os_name, abi)

    def describe(self) -> str:
        v = ".".join(map(str, self.backend_version)) if self.backend_version else ""
        return (
            f"torch {self.torch_version[0]}.{self.torch_version[1]}, {self.backend} {v}".rstrip()
            + f", {self.cpu}-{self.os}"
        )


def _reject_reason(v: Variant, system: SystemInfo) -> str | None:
    """None if `v` runs on `system`, else why not (the wording `kernelhub variants` prints)."""
    if v.torch_version is None:
        if v.backend in ("universal", system.backend):
            return None
        return f"backend {v.backend} does not match this system's {system.backend}"
    if (v.cpu, v.os) != (system.cpu, system.os):
        return f"platform {v.cpu}-{v.os} is not this system's {system.cpu}-{system.os}"
    if v.torch_version != system.torch_version:
        return (
            f"built for torch {v.torch_version[0]}.{v.torch_version[1]}, this is torch "
            f"{system.torch_version[0]}.{system.torch_version[1]}"
        )
    if v.cxx11_abi is not None and system.cxx11_abi is not None and v.cxx11_abi != system.cxx11_abi:
        return f"C++ ABI {'cxx11' if v.cxx11_abi else 'cxx98'} does not match torch's"
    if v.backend != system.backend:
        return f"backend {v.backend} does not match this system's {system.backend}"
    if v.backend == "cuda" and v.backend_version and system.backend_version:
        if (
            v.backend_version[0] != system.backend_version[0]
            or v.backend_version[1:] > system.backend_version[1:]
        ):
            have = ".".join(map(str, system.backend_version))
            return f"CUDA {'.'.join(map(str, v.backend_version))} is not compatible with system CUDA {have}"
    elif v.backend_version and system.backend_version and v.backend_version != system.backend_version:
        return f"{v.backend} {v.backend_version} does not match this system's {system.backend_version}"
    return None


def rank_variants(names, system: SystemInfo | None = None) -> tuple[list[str], dict[str, str]]:
    """Split variant names into (usable, best first) and {rejected name: reason}.

    Example:
        >>> s = SystemInfo((2, 7), "cuda", (12, 8), "x86_64", "linux", True)
        >>> rank_variants(["torch-universal", "torch27-cxx11-cu126-x86_64-linux",
        ...                "torch27-cxx11-cu128-x86_64-linux", "torch26-cxx11-cu128-x86_64-linux"], s)[0]
        ['torch27-cxx11-cu128-x86_64-linux', 'torch27-cxx11-cu126-x86_64-linux', 'torch-universal']
    """
    system = system or SystemInfo.current()
    usable: list[Variant] = []
    rejected: dict[str, str] = {}
    for name in names:
        try:
            v = Variant.parse(name)
        except ValueError as e:
            rejected[name] = str(e)
            continue
        reason = _reject_reason(v, system)
        if reason is None:
            usable.append(v)
        else:
            rejected[name] = reason

    def key(v: Variant) -> tuple:
        if v.torch_version is not None:
            return (0, tuple(-x for x in (v.backend_version or ())), v.name)
        return (1 if v.backend != "universal" else 2, (), v.name)

    return [v.name for v in sorted(usable, key=key)], rejected


def system_for_backend(func: str, backend: str | None) -> SystemInfo:
    """This system, or this system loading `backend`'s builds: "cpu" or torch's own backend, as
    `kernels` allows (a CUDA torch can run CPU builds; a CPU torch cannot run CUDA ones)."""
    system = SystemInfo.current()
    if backend is None or backend == system.backend:
        return system
    if backend != "cpu":
        raise ValueError(  # the phrase `kernels` raises, then which backends this system takes
            f"{func}: Invalid backend {backend!r}, system supported backends: "
            f"{', '.join(sorted({'cpu', system.backend}))} (`backend` must be 'cpu' or this torch's backend)"
        )
    return SystemInfo(system.torch_version, "cpu", None, system.cpu, system.os, system.cxx11_abi)


@dataclass(frozen=True)
class VariantAccepted:
    """A build variant this system can run (`kernels`' name)."""

    variant: Variant


@dataclass(frozen=True)
class VariantRejected:
    """A build variant this system cannot run, and why (`kernels`' name)."""

    variant: Variant | str
    reason: str
