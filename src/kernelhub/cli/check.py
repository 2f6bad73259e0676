"""`kernelhub check DIR`: validate a kernel repository before it is built or published.

Checked: `kernel.toml` (top level or `[general]`) has `name` (identifier), `version` (int >= 1),
`layers` (a non-empty list, or a `[layers]` table keyed by layer name) and optionally `license`; its
`[dispatch]` and `[layers.<class>]` declarations are consistent (kernelhub.dispatch_table).
The source, `torch-ext/<name>/` (kernel-builder's layout), is one package whose `layers` module
defines every layer named in kernel.toml (read statically). The build output, `build/` (written by
`kernelhub build`, or a Hub-style repository's only content), when present: each variant a valid
variant name holding `<name>/__init__.py` with the same layers, a `metadata.json` (a JSON object, in
the variant or the package directory), exactly one package; where the source is present too,
`build/torch-universal/` must be what `kernelhub build` writes from it now (else it is stale).
No symlinks or special files anywhere in kernel.toml, README.md, LICENSE*, torch-ext/ or build/.
`--import` also imports each package and checks each layer is a stateless `nn.Module` subclass
declaring `has_backward` and `can_torch_compile`.
"""

from __future__ import annotations

import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kernelhub.cli._build_plan import UNIVERSAL, built_files
from kernelhub.cli._common import add_subcommand
from kernelhub.cli._files import read_file, repository_link_problems, scan_tree
from kernelhub.dispatch_table import read_dispatch_table
from kernelhub.variants import Variant

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["KernelManifest", "add_parser", "check_kernel_dir", "read_manifest", "run"]

MANIFEST_LIMIT = 1 << 20  # bytes of kernel.toml / metadata.json: a manifest is small


@dataclass
class KernelManifest:
    name: str
    version: int
    layers: list[str]
    description: str = ""
    problems: list[str] = field(default_factory=list)
    license: str = ""  # written to metadata.json by `kernelhub build`


def read_manifest(repo: Path) -> KernelManifest:
    """Read kernel.toml (top-level keys, or a `[general]` table as in HF build.toml), collecting problems."""
    path = repo / "kernel.toml"
    if not (path.is_symlink() or path.exists()):
        return KernelManifest("", 0, [], problems=[f"{path}: missing (needs name, version, layers)"])
    try:
        raw = read_file(repo, "kernel.toml", limit=MANIFEST_LIMIT)
    except ValueError as e:  # a link, a special file, too large
        return KernelManifest("", 0, [], problems=[str(e)])
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        return KernelManifest("", 0, [], problems=[f"{path}: not valid UTF-8 TOML: {e}"])
    except (RecursionError, MemoryError):  # the parser recurses per nesting level
        return KernelManifest("", 0, [], problems=[f"{path}: not valid TOML: nested too deeply"])
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
    license = data.get("license", "")
    if "license" in data and (not isinstance(license, str) or not license.strip()):
        problems.append(f"{path}: `license` must be a license identifier such as 'Apache-2.0', got {license!r}")
    desc = data.get("description", "")
    return KernelManifest(
        name if isinstance(name, str) else "",
        version if isinstance(version, int) else 0,
        layers if isinstance(layers, list) else [],
        desc if isinstance(desc, str) else "",
        problems,
        license if isinstance(license, str) else "",
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




def _json_object(path: Path, base: Path, rel: str) -> tuple[dict | None, list[str]]:
    """(the JSON object in base/rel, problems)."""
    try:
        data = json.loads(read_file(base, rel, limit=MANIFEST_LIMIT).decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, [f"{path}: not valid UTF-8 JSON: {e}"]
    except (RecursionError, MemoryError):  # the decoder recurses per nesting level
        return None, [f"{path}: not valid JSON: nested too deeply"]
    except ValueError as e:  # a link, a special file, too large
        return None, [str(e)]
    if not isinstance(data, dict):
        return None, [f"{path}: must hold a JSON object"]
    return data, []


def _check_metadata(meta: Path, base: Path, manifest: KernelManifest) -> list[str]:
    data, problems = _json_object(meta, base, str(meta.relative_to(base)))
    if data is None:
        return problems
    if "version" in data and (type(data["version"]) is not int or data["version"] != manifest.version):
        problems.append(f"{meta}: `version` {data['version']!r} differs from kernel.toml's {manifest.version}")
    if "name" in data and data["name"] != manifest.name:
        problems.append(f"{meta}: `name` {data['name']!r} differs from kernel.toml's {manifest.name!r}")
    depends = data.get("python-depends", [])
    if not (isinstance(depends, list) and all(isinstance(d, str) for d in depends)):
        problems.append(f"{meta}: `python-depends` must be a list of package names, got {depends!r}")
    return problems


def _check_layers(pkg: Path, base: Path, manifest: KernelManifest) -> list[str]:
    """Every layer named in kernel.toml is defined in the package's `layers` module (read statically)."""
    rel = "layers.py" if (pkg / "layers.py").is_file() else "layers/__init__.py"
    layers_src = pkg / rel
    if not layers_src.is_file():
        return [f"{pkg}: missing layers.py (the layers named in kernel.toml live there)"]
    try:
        defined = _defined_names(read_file(base, str(layers_src.relative_to(base))).decode("utf-8"))
    except (SyntaxError, UnicodeDecodeError) as e:
        return [f"{layers_src}: not valid UTF-8 Python: {e}"]
    except (RecursionError, MemoryError):  # the parser's own limits on nesting
        return [f"{layers_src}: not valid Python: nested too deeply"]
    except ValueError as e:  # a link or a special file
        return [str(e)]
    missing = [x for x in manifest.layers if defined is not None and x not in defined]
    if missing:
        return [f"{layers_src}: layers {missing} named in kernel.toml are not defined"]
    return []


def _packages(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if (p / "__init__.py").is_file())


def _check_source(repo: Path, manifest: KernelManifest, do_import: bool) -> list[str]:
    """torch-ext/<name>/: one package, named as in kernel.toml, defining its layers."""
    ext = repo / "torch-ext"
    pkg = ext / manifest.name
    if not (pkg / "__init__.py").is_file():
        return [f"{ext}: missing {manifest.name}/__init__.py (the package named in kernel.toml)"]
    problems = []
    packages = _packages(ext)
    if packages != [manifest.name]:
        problems.append(f"{ext}: must hold exactly one package, {manifest.name}/ (the loader imports the only "
                        f"one), found {packages}")
    if (pkg / "metadata.json").exists():
        problems.append(f"{pkg / 'metadata.json'}: `kernelhub build` writes metadata.json; remove it from the source")
    if (pkg / "kernel.toml").exists() and read_file(repo, f"torch-ext/{manifest.name}/kernel.toml") != read_file(
        repo, "kernel.toml"
    ):
        problems.append(f"{pkg / 'kernel.toml'}: differs from {repo / 'kernel.toml'}; `kernelhub build` copies "
                        "the repository's kernel.toml into the package")
    problems += _check_layers(pkg, repo, manifest)
    if do_import and not problems:
        problems += _check_by_import(pkg, manifest)
    return problems


def _check_variant(vdir: Path, repo: Path, manifest: KernelManifest, do_import: bool) -> list[str]:
    problems = []
    try:
        Variant.parse(vdir.name)
    except ValueError as e:
        problems.append(f"{vdir}: {e}")
    pkg = vdir / manifest.name
    if not (pkg / "__init__.py").is_file():
        return problems + [f"{vdir}: missing {manifest.name}/__init__.py (the package named in kernel.toml)"]
    packages = _packages(vdir)
    if packages != [manifest.name]:
        problems.append(f"{vdir}: must hold exactly one package, {manifest.name}/ (the loader imports the only "
                        f"one), found {packages}")
    metas = [p for p in (vdir / "metadata.json", pkg / "metadata.json") if p.is_file()]
    if not metas:
        problems.append(f"{vdir}: missing metadata.json (in {vdir.name}/ or {vdir.name}/{manifest.name}/)")
    for meta in metas:
        problems += _check_metadata(meta, repo, manifest)
    if (pkg / "kernel.toml").is_file() and read_file(repo, str((pkg / "kernel.toml").relative_to(repo))) != read_file(
        repo, "kernel.toml"
    ):
        problems.append(f"{pkg / 'kernel.toml'}: differs from {repo / 'kernel.toml'}")
    problems += _check_layers(pkg, repo, manifest)
    if do_import and not problems:
        problems += _check_by_import(vdir, manifest)
    return problems


def _check_stale(repo: Path, manifest: KernelManifest) -> list[str]:
    """build/torch-universal/ is byte for byte what `kernelhub build` would write from the source now."""
    vdir = repo / "build" / UNIVERSAL
    if not vdir.is_dir():
        return [f"{repo / 'build'}: has no {UNIVERSAL}/ built from torch-ext/; run `kernelhub build {repo}`"]
    try:
        want = built_files(repo, manifest.name, manifest.version, manifest.license)
    except ValueError as e:
        return [str(e)]
    base = f"build/{UNIVERSAL}"
    have, problems = scan_tree(repo, base)
    have_files = {p[len(base) + 1:] for p in have}
    changed = {p for p in set(want) & have_files if read_file(repo, f"{base}/{p}") != want[p]}
    differ = sorted((set(want) ^ have_files) | changed)
    if differ and not problems:
        shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
        problems.append(f"{vdir}: stale, not what `kernelhub build` writes from torch-ext/{manifest.name}/ now "
                        f"(differs: {shown}); run `kernelhub build {repo}`")
    return problems


def _check_by_import(path: Path, manifest: KernelManifest) -> list[str]:
    from torch import nn

    from kernelhub._loader import load_kernel_from_dir

    try:
        kernel = load_kernel_from_dir(path)
    except Exception as e:  # report any import failure as a layout problem
        return [f"{path}: importing the package failed: {type(e).__name__}: {e}"]
    problems = []
    for name in manifest.layers:
        layer = getattr(getattr(kernel, "layers", None), name, None)
        if not (isinstance(layer, type) and issubclass(layer, nn.Module)):
            problems.append(f"{path}: layers.{name} is not an nn.Module subclass")
            continue
        # DESIGN: stateless nn.Modules whose forward replaces the host's, declaring both attributes
        if layer.__init__ is not nn.Module.__init__:
            problems.append(f"{path}: layers.{name} defines __init__; kernel layers must be stateless")
        for attr in ("has_backward", "can_torch_compile"):
            if type(getattr(layer, attr, None)) is not bool:
                problems.append(f"{path}: layers.{name}.{attr} must be True or False, "
                                f"got {getattr(layer, attr, None)!r}")
    return problems


def check_kernel_dir(
    repo: str | Path, *, do_import: bool = False, build: bool = True
) -> tuple[KernelManifest, list[str]]:
    """(manifest, problems) for a kernel repository directory; no problems means it can be built and
    published. `build=False` leaves out the checks of build/ (`upload` rebuilds it from the source)."""
    repo = Path(repo)
    if not repo.is_dir():
        return KernelManifest("", 0, []), [f"{repo}: not a directory"]
    links = repository_link_problems(repo)
    manifest = read_manifest(repo)
    problems = list(dict.fromkeys(manifest.problems + links))
    if links:  # nothing is read through a link: fix them first
        return manifest, problems
    has_source, has_build = (repo / "torch-ext").is_dir(), (repo / "build").is_dir()
    if not has_source and not has_build:
        name = manifest.name or "<name>"
        problems.append(f"{repo}: no source (torch-ext/{name}/) and no build (build/<variant>/{name}/)")
    if not manifest.name:
        return manifest, problems
    if not manifest.problems:  # the variants and capability ranges kernel.toml declares
        try:
            read_dispatch_table(repo)
        except ValueError as e:
            problems.append(str(e))
    if has_source:
        problems += _check_source(repo, manifest, do_import)
    if build and has_build:
        variants = sorted(p for p in (repo / "build").iterdir() if p.is_dir())
        if not variants:
            problems.append(f"{repo / 'build'}: no build variants (e.g. build/{UNIVERSAL}/{manifest.name}/)")
        for vdir in variants:
            problems += _check_variant(vdir, repo, manifest, do_import)
        if has_source and not problems:
            problems += _check_stale(repo, manifest)
    return manifest, problems


def add_parser(sub) -> None:
    p = add_subcommand(sub, "check", "validate a kernel repository (kernel.toml, torch-ext/, build/, layers)", __doc__)
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
    if (args.dir / "torch-ext").is_dir() and not (args.dir / "build").exists():
        print(f"note: no build/ yet: the source torch-ext/{manifest.name}/ passes; `kernelhub build {args.dir}` "
              f"writes build/{UNIVERSAL}/{manifest.name}/ (`kernelhub upload` builds first)")
    print(f"ok: {manifest.name} v{manifest.version}, layers {', '.join(manifest.layers)}")
    return 0
