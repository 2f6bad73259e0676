"""`kernelhub lock`: write `kernels.lock` for the Hub kernels named in the kernelhub config
(`--kernelhub-config`, default searched in the current directory; `--config` is its deprecated spelling),
or, as `kernels lock PROJECT_DIR`, for those of `[tool.kernels.dependencies]` in PROJECT_DIR/pyproject.toml
(with the kernelhub config found in PROJECT_DIR when that table is absent).

Each entry records the repository, the version/revision asked for, the commit it resolved to, and the
sha256 of every file of the locked build variant(s) (default: the one this system loads; add others
with `--variant`, e.g. to lock a CUDA build from a CPU machine). Set `lockfile = "kernels.lock"` in the
config (or use `LockedLayerRepository`) to load only locked, verified bytes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kernelhub.cli._common import add_kernelhub_config_arguments, add_subcommand
from kernelhub.config import load_config
from kernelhub.lock import DEFAULT_LOCKFILE, lock_kernel, write_lockfile

__all__ = ["add_parser", "kernels_dependencies", "lock_kernels", "run"]


def add_parser(sub) -> None:
    p = add_subcommand(sub, "lock", "resolve the config's Hub kernels to commits and write kernels.lock", __doc__)
    p.add_argument("project_dir", nargs="?", default=None,
                   help="a project directory: lock its pyproject.toml's [tool.kernels.dependencies] into "
                        "PROJECT_DIR/kernels.lock, as `kernels lock` does")
    add_kernelhub_config_arguments(p, "kernelhub.toml or pyproject.toml (default: search the current directory)")
    p.add_argument(
        "--output",
        "-o",
        default=None,
        help=f"lock file to write (default: {DEFAULT_LOCKFILE} next to the config, or in PROJECT_DIR)",
    )
    p.add_argument("--variant", action="append", default=None, help="lock this build variant (repeatable)")
    p.set_defaults(run=run)


def kernels_dependencies(project_dir: Path) -> list[tuple[str, int | None, str | None]] | None:
    """[(repo_id, version, None)] of `[tool.kernels.dependencies]` in PROJECT_DIR/pyproject.toml (what
    `kernels lock` locks), or None where there is no such table."""
    import tomllib

    pyproject = Path(project_dir) / "pyproject.toml"
    if not pyproject.is_file():
        return None
    with open(pyproject, "rb") as f:
        deps = tomllib.load(f).get("tool", {}).get("kernels", {}).get("dependencies")
    if deps is None:
        return None
    if not isinstance(deps, dict):
        raise ValueError(f"lock: {pyproject}: [tool.kernels.dependencies] must map repositories to versions")
    out = []
    for repo_id, version in deps.items():
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"lock: {pyproject}: [tool.kernels.dependencies] {repo_id!r} must be an int version, "
                             f"got {version!r}")
        out.append((repo_id, version, None))
    return out


def lock_kernels(args) -> None:
    """`kernels lock`'s function: lock `args.project_dir`'s kernels into PROJECT_DIR/kernels.lock."""
    run(argparse.Namespace(project_dir=args.project_dir, kernelhub_config=None, output=None,
                           variant=getattr(args, "variant", None)))


def run(args) -> int:
    project = Path(args.project_dir) if args.project_dir else None
    if project is not None and not project.is_dir():
        raise FileNotFoundError(f"lock: project directory {project} does not exist")
    kernels = kernels_dependencies(project) if project is not None and not args.kernelhub_config else None
    config = None
    if kernels is None:
        config = load_config(args.kernelhub_config or project)
        if config is None and project is None and not args.kernelhub_config:
            kernels = kernels_dependencies(Path.cwd())  # `kernels lock .` spelled without the dot
        if config is None and kernels is None:
            raise FileNotFoundError(
                "no kernelhub config found (kernelhub.toml, or pyproject.toml with [tool.kernelhub] or "
                "[tool.kernels.dependencies])"
            )
        if config is not None:
            kernels = config.hub_kernels()
    if not kernels:
        raise ValueError('the kernelhub config names no Hub kernels (`repo = "org/name"`) to lock')
    entries = []
    for repo_id, version, revision in kernels:
        entry = lock_kernel(repo_id, version=version, revision=revision, variants=args.variant)
        entries.append(entry)
        ref = f"v{version}" if version else (revision or "default")
        print(f"locked {repo_id} {ref} -> {entry['commit']} ({', '.join(entry['variants'])})")
    given = args.kernelhub_config
    base = Path(given).parent if given and not Path(given).is_dir() else Path(given or project or ".")
    name = (config.lockfile if config is not None else None) or DEFAULT_LOCKFILE
    output = Path(args.output) if args.output else base / name
    print(f"wrote {write_lockfile(entries, output)}")
    return 0
