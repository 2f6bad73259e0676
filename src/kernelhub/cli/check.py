"""`kernelhub check DIR`: validate a kernel repository's layout before it is published.

Checked: `kernel.toml` (top level or `[general]`) has `name` (identifier), `version` (int >= 1) and
`layers` (a non-empty list, or a `[layers]` table keyed by layer name), and its `[dispatch]` and
`[layers.<class>]` declarations are consistent (kernelhub.dispatch_table);
`build/` has at least one variant, each a valid variant name holding `<name>/__init__.py`, a
`metadata.json` (JSON, in the variant or the package directory) and a `layers` module that defines
every layer named in kernel.toml (read statically; `--import` also imports the package and checks
each layer is a stateless `nn.Module` subclass declaring `has_backward` and `can_torch_compile`);
exactly one package per variant; no symlinks among the published files.
"""

from __future__ import annotations

import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kernelhub.cli._common import add_subcommand
from kernelhub.dispatch_table import read_dispatch_table
from kernelhub.variants import Variant

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["KernelManifest", "add_parser", "check_kernel_dir", "read_manifest", "run"]


@dataclass
class KernelManifest:
    name: str
    version: int
    layers: list[str]
    description: str = ""
    problems: list[str] = field(default_factory=list)


def read_manifest(repo: Path) -> KernelManifest:
    """Read kernel.toml (top-level keys, or a `[general]` table as in HF build.toml), collecting problems."""
    path = repo / "kernel.toml"
    if not path.is_file():
        return KernelManifest("", 0, [], problems=[f"{path}: missing (needs name, version, layers)"])
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        return KernelManifest("", 0, [], problems=[f"{path}: not valid UTF-8 TOML: {e}"])
    general = data.get("general", {})
    if not isinstance(general, dict):
        return KernelManifest("", 0, [], problems=[f"{path}: `general` must be a table, got {general!r}"])
    data = {**general, **{k: v for k, v in data.items() if k != "general"}}
    problems = []
    name, version, layers = data.get("name"), data.get("version"), data.get("layers")
    if isinstance(layers, dict):  # `[layers]` table: {LayerName = {description = ..., has_backward = ...}}
        for layer, table in layers.items():
            attrs = table if isinstance(table, dict) else {}
            bad = {k: v for k, v in attrs.items() if k in ("has_backward", "can_torch_compile") and type(v) is not bool}
            if not isinstance(table, dict) or bad:
                problems.append(f"{path}: [layers.{layer}] must be a table whose has_backward / can_torch_compile "
                                f"are true or false, got {table!r}")
        layers = list(layers)
    if not isinstance(name, str) or not name.isidentifier() or name == "build":
        problems.append(f"{path}: `name` must be a Python identifier (the package name) other than 'build', "
                        f"got {name!r}")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        problems.append(f"{path}: `version` must be an int >= 1, got {version!r}")
    if (
        not isinstance(layers, list)
        or not layers
        or not all(isinstance(x, str) and x.isidentifier() for x in layers)
    ):
        problems.append(f"{path}: `layers` must be a non-empty list of class names, got {layers!r}")
    desc = data.get("description", "")
    return KernelManifest(
        name if isinstance(name, str) else "",
        version if isinstance(version, int) else 0,
        layers if isinstance(layers, list) else [],
        desc if isinstance(desc, str) else "",
        problems,
    )


def _defined_names(source: str) -> set[str] | None:
    """Module-level names a module defines or imports (classes, assignments, imports; also inside
    `if` / `try` / `with` blocks), or None where they cannot be read statically (`import *`,
    `globals()`)."""
    names: set[str] = set()

    def targets(t: ast.expr) -> None:
        if isinstance(t, ast.Name):
            names.add(t.id)
        elif isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                targets(e)

    def visit(body: list[ast.stmt]) -> bool:
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                if any(a.name == "*" for a in node.names):
                    return False
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    targets(t)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets(node.target)
            for block in ("body", "orelse", "finalbody", "handlers"):  # if / try / with / for blocks
                inner = getattr(node, block, None)
                if isinstance(inner, list) and not isinstance(node, (ast.ClassDef, ast.FunctionDef,
                                                                      ast.AsyncFunctionDef)):
                    stmts = [h for h in inner if isinstance(h, ast.stmt)]
                    stmts += [s for h in inner if isinstance(h, ast.ExceptHandler) for s in h.body]
                    if not visit(stmts):
                        return False
        return True

    tree = ast.parse(source)
    # a module that defines names through globals() (swiglu generates its layer classes from
    # kernel.toml) cannot be read statically either: `--import` checks its layers
    if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "globals"
           for n in ast.walk(tree)):
        return None
    return names if visit(tree.body) else None


def _symlinks(repo: Path) -> list[str]:
    """Symlinked files or directories among what `upload` publishes: upload_folder skips a linked
    directory and copies a linked file's target (possibly from outside the repository)."""
    found = []
    for top in (repo / "kernel.toml", repo / "README.md", repo / "build"):
        paths = [top] + (sorted(top.rglob("*")) if top.is_dir() and not top.is_symlink() else [])
        found += [f"{p}: a symlink; publish the real file or directory" for p in paths if p.is_symlink()]
    return found


def _check_variant(vdir: Path, manifest: KernelManifest, do_import: bool) -> list[str]:
    problems = []
    try:
        Variant.parse(vdir.name)
    except ValueError as e:
        problems.append(f"{vdir}: {e}")
    pkg = vdir / manifest.name
    if not (pkg / "__init__.py").is_file():
        return problems + [f"{vdir}: missing {manifest.name}/__init__.py (the package named in kernel.toml)"]
    packages = sorted(p.name for p in vdir.iterdir() if (p / "__init__.py").is_file())
    if packages != [manifest.name]:
        problems.append(f"{vdir}: must hold exactly one package, {manifest.name}/ (the loader imports the only "
                        f"one), found {packages}")
    metas = [p for p in (vdir / "metadata.json", pkg / "metadata.json") if p.is_file()]
    if not metas:
        problems.append(f"{vdir}: missing metadata.json (in {vdir.name}/ or {vdir.name}/{manifest.name}/)")
    for meta in metas:
        try:
            if not isinstance(json.loads(meta.read_text(encoding="utf-8")), dict):
                problems.append(f"{meta}: must hold a JSON object")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            problems.append(f"{meta}: not valid UTF-8 JSON: {e}")
    layers_src = pkg / "layers.py" if (pkg / "layers.py").is_file() else pkg / "layers" / "__init__.py"
    if not layers_src.is_file():
        return problems + [f"{pkg}: missing layers.py (the layers named in kernel.toml live there)"]
    try:
        defined = _defined_names(layers_src.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError) as e:
        return problems + [f"{layers_src}: not valid UTF-8 Python: {e}"]
    missing = [x for x in manifest.layers if defined is not None and x not in defined]
    if missing:
        problems.append(f"{layers_src}: layers {missing} named in kernel.toml are not defined")
    if do_import and not problems:
        problems += _check_by_import(vdir, manifest)
    return problems


def _check_by_import(vdir: Path, manifest: KernelManifest) -> list[str]:
    from torch import nn

    from kernelhub._loader import load_kernel_from_dir

    try:
        kernel = load_kernel_from_dir(vdir)
    except Exception as e:  # report any import failure as a layout problem
        return [f"{vdir}: importing the package failed: {type(e).__name__}: {e}"]
    problems = []
    for name in manifest.layers:
        layer = getattr(getattr(kernel, "layers", None), name, None)
        if not (isinstance(layer, type) and issubclass(layer, nn.Module)):
            problems.append(f"{vdir}: layers.{name} is not an nn.Module subclass")
            continue
        # DESIGN: stateless nn.Modules whose forward replaces the host's, declaring both attributes
        if layer.__init__ is not nn.Module.__init__:
            problems.append(f"{vdir}: layers.{name} defines __init__; kernel layers must be stateless")
        for attr in ("has_backward", "can_torch_compile"):
            if type(getattr(layer, attr, None)) is not bool:
                problems.append(f"{vdir}: layers.{name}.{attr} must be True or False, "
                                f"got {getattr(layer, attr, None)!r}")
    return problems


def check_kernel_dir(repo: str | Path, *, do_import: bool = False) -> tuple[KernelManifest, list[str]]:
    """(manifest, problems) for a kernel repository directory; no problems means it can be published."""
    repo = Path(repo)
    if not repo.is_dir():
        return KernelManifest("", 0, []), [f"{repo}: not a directory"]
    manifest = read_manifest(repo)
    problems = list(manifest.problems) + _symlinks(repo)
    if not manifest.problems:  # the variants and capability ranges kernel.toml declares
        try:
            read_dispatch_table(repo)
        except ValueError as e:
            problems.append(str(e))
    build = repo / "build"
    variants = sorted(p for p in build.iterdir() if p.is_dir()) if build.is_dir() else []
    if not variants:
        problems.append(
            f"{build}: no build variants (e.g. build/torch-universal/{manifest.name or '<name>'}/)"
        )
    if manifest.name:
        for vdir in variants:
            problems += _check_variant(vdir, manifest, do_import)
    return manifest, problems


def add_parser(sub) -> None:
    p = add_subcommand(sub, "check", "validate a kernel repository's layout (kernel.toml, build/, layers)", __doc__)
    p.add_argument("dir", type=Path, help="kernel repository directory, e.g. kernels_repo/swiglu")
    p.add_argument(
        "--import",
        dest="do_import",
        action="store_true",
        help="also import the package and check each layer is an nn.Module",
    )
    p.set_defaults(run=run)


def run(args) -> int:
    manifest, problems = check_kernel_dir(args.dir, do_import=args.do_import)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return 2
    print(f"ok: {manifest.name} v{manifest.version}, layers {', '.join(manifest.layers)}")
    return 0
