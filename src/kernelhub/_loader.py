"""Import a kernel package from a directory, under a name unique to that directory.

Two versions of one kernel (say `swiglu` v1 and v2) must be importable side by side, so the
package is never imported under its bare name: the module name carries a hash of its path.

Every module of a kernel package is compiled from its `.py` source, never from bytecode: a lock
verifies the sources' sha256, and a `__pycache__/*.pyc` planted next to them (an unchecked-hash
one is not compared with the source at all) would otherwise run instead. Nothing is written there.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType

from kernelhub.deps import use_kernel_deps

__all__ = ["find_variant_dir", "import_kernel_package", "load_kernel_from_dir"]

_lock = threading.Lock()
UNIVERSAL_VARIANT = "torch-universal"
_NAMESPACE = "kernelhub_kernels"


# module name of a locked package -> {absolute file path: sha256} of every file it may import
_verified: dict[str, dict[str, str]] = {}


def _package_of(fullname: str) -> str:
    return ".".join(fullname.split(".")[:2])


class _SourceLoader(importlib.machinery.SourceFileLoader):
    """A module's code from its source file alone (no bytecode read or written). In a locked
    package the bytes read are the bytes hashed: a file swapped after verification is refused."""

    def get_code(self, fullname: str):
        path = self.get_filename(fullname)
        return self.source_to_code(self.get_data(path), path)

    def get_data(self, path: str) -> bytes:
        data = super().get_data(path)
        allowed = _verified.get(_package_of(self.name))
        if allowed is not None:
            digest = hashlib.sha256(data).hexdigest()
            if allowed.get(path) != digest:
                from kernelhub.lock import KernelLockError

                raise KernelLockError(
                    f"{path}: sha256 {digest} is not the locked one ({allowed.get(path)}); refusing to import it"
                )
        return data


def _spec(fullname: str, file: str, package: Path | None, allowed: dict[str, str] | None):
    if allowed is not None and file not in allowed:
        return None
    if file.endswith(".py"):
        loader = _SourceLoader(fullname, file)
    else:
        loader = importlib.machinery.ExtensionFileLoader(fullname, file)
    locations = [str(package)] if package is not None else None
    return importlib.util.spec_from_file_location(fullname, file, loader=loader, submodule_search_locations=locations)


class _KernelSourceFinder(importlib.abc.MetaPathFinder):
    """The submodules of loaded kernel packages (`kernelhub_kernels.*`), through `_SourceLoader`.

    In a locked package only verified files are candidates, and nothing else may answer: no
    namespace package, no planted file, whatever Python's own finders would have picked."""

    def find_spec(self, fullname: str, path, target=None):
        if not fullname.startswith(_NAMESPACE + ".") or not path:
            return None
        allowed = _verified.get(_package_of(fullname))
        name = fullname.rpartition(".")[2]
        for entry in path:
            package = Path(entry) / name
            candidates = [(str(package / "__init__.py"), package), (str(Path(entry) / f"{name}.py"), None)]
            if allowed is not None:  # compiled extension modules that the lock lists
                prefix = str(Path(entry) / f"{name}.")
                candidates += [(f, None) for f in sorted(allowed) if f.startswith(prefix)
                               and f.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))]
            for file, pkg in candidates:  # a package first, as Python's own finder does
                if (allowed is not None and file in allowed) or (allowed is None and file.endswith(".py")
                                                                 and Path(file).is_file()):
                    return _spec(fullname, file, pkg, allowed)
        if allowed is not None:
            raise ModuleNotFoundError(f"No module named {fullname!r} among the locked files", name=fullname)
        return None


def _install_finder() -> None:
    if not any(isinstance(f, _KernelSourceFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _KernelSourceFinder())


def _best_variant(build: Path, system=None) -> Path:
    """The variant directory under `build` that this system runs best (ranked as `get_kernel`
    ranks a Hub repository's: a compiled build for this torch/backend first, `torch-universal` last)."""
    from kernelhub.variants import rank_variants

    found = sorted(p.name for p in build.iterdir() if p.is_dir())
    usable, rejected = rank_variants(found, system)
    if usable:
        return build / usable[0]
    raise FileNotFoundError(
        f"kernel repository {build.parent} has no build variant for this system (found {found}: "
        + ("; ".join(f"{n}: {why}" for n, why in rejected.items()) or "none") + ")"
    )


def find_variant_dir(repo_dir: Path, system=None) -> Path:
    """The build variant of a kernel repository (`repo_dir/build/<variant>`) that this system runs best."""
    build = repo_dir / "build"
    if not build.is_dir():
        raise FileNotFoundError(f"kernel repository {repo_dir} has no build/ directory")
    return _best_variant(build, system)


def _has_files(path: Path) -> bool:
    return any(p.is_file() for p in path.rglob("*"))


def _holds_variants(path: Path) -> bool:
    """Whether `path` is a `build/` directory: its subdirectories are named as build variants."""
    from kernelhub.variants import Variant

    for child in path.iterdir():
        if child.is_dir() and child.name != "__pycache__":
            try:
                Variant.parse(child.name)
                return True
            except ValueError:
                continue
    return False


def _package_dir(path: Path, package_name: str | None = None, system=None) -> Path:
    """Accept every layout `kernels` loads, plus kernelhub's source layout:

    - the package directory itself (or a flattened variant: `build/<variant>/__init__.py`);
    - a repository root (`build/<variant>/<package>/` or a flattened `build/<variant>/__init__.py`);
    - a `build/` directory given as the path (`repo/build`, the layout before flattening);
    - a variant directory holding one package (or `package_name`, where it holds several);
    - a repository root with no `build/`, read from its source `torch-ext/<name>/` (kernel-builder's
      layout): the bundled kernels ship as source, so a stale build can never shadow an edit.
    """
    path = path.resolve()
    if (path / "__init__.py").is_file():
        return path
    if (path / "build").is_dir() and (_has_files(path / "build") or not (path / "torch-ext").is_dir()):
        path = find_variant_dir(path, system)
    elif (path / "torch-ext").is_dir():  # (a build/ of empty directories, e.g. left by a checkout, is no build)
        path = path / "torch-ext"
    elif _holds_variants(path):
        path = _best_variant(path, system)
    if (path / "__init__.py").is_file():
        return path
    packages = [p for p in sorted(path.iterdir()) if (p / "__init__.py").is_file()]
    if package_name is not None:
        chosen = [p for p in packages if p.name == package_name]
        if chosen:
            return chosen[0]
        raise FileNotFoundError(f"{path} has no kernel package {package_name!r} (found {[p.name for p in packages]})")
    if len(packages) != 1:
        raise FileNotFoundError(
            f"{path} must hold exactly one kernel package (a directory with __init__.py), "
            f"found {[p.name for p in packages]}"
        )
    return packages[0]


def import_kernel_package(package_dir: Path, *, verified: dict[str, str] | None = None) -> ModuleType:
    """Import the package at `package_dir` once per process, under a path-unique module name.

    `verified` ({path relative to package_dir: sha256}): a locked import. Only those files can be
    imported, each checked again as it is read; the module name differs from an unlocked import's,
    so a module imported without the lock is never handed out as the locked one.
    """
    package_dir = package_dir.resolve()
    key = str(package_dir)
    allowed = None
    if verified is not None:
        allowed = {str(package_dir / rel): digest for rel, digest in verified.items()}
        key += "\0locked\0" + "\0".join(f"{k}={v}" for k, v in sorted(allowed.items()))
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    module_name = f"{_NAMESPACE}.{package_dir.name}_{digest}"
    init = str(package_dir / "__init__.py")
    if allowed is not None and init not in allowed:
        raise ImportError(f"kernel package {package_dir}: __init__.py is not among the locked files")
    with _lock:
        if module_name in sys.modules:
            return sys.modules[module_name]
        if _NAMESPACE not in sys.modules:
            parent = ModuleType(_NAMESPACE)
            parent.__path__ = []  # namespace for loaded kernels
            sys.modules[_NAMESPACE] = parent
        _install_finder()
        if allowed is not None:
            _verified[module_name] = allowed
        spec = importlib.util.spec_from_file_location(
            module_name, init, loader=_SourceLoader(module_name, init), submodule_search_locations=[str(package_dir)]
        )
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import kernel package from {package_dir}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            with use_kernel_deps({}):  # (get_kernel_dep works while a kernel imports; no deps resolved)
                spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            _verified.pop(module_name, None)
            raise
        return module


def load_kernel_from_dir(
    path: str | Path, *, verified: dict[str, str] | None = None, package_name: str | None = None, system=None
) -> ModuleType:
    """Import the kernel at `path` (any layout `_package_dir` accepts).

    `verified` ({path relative to `path`: sha256}): import only those files (a locked load).
    `package_name`: the package to import where a variant holds several. `system`: rank variants
    for that `SystemInfo` (a `backend=` choice) instead of this one."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"kernel path {p} does not exist")
    package = _package_dir(p, package_name, system)
    if verified is not None:
        base = p.resolve()
        verified = {
            (base / rel).relative_to(package).as_posix(): h
            for rel, h in verified.items() if (base / rel).is_relative_to(package)
        }
    return import_kernel_package(package, verified=verified)
