"""`kernelhub lock`: write `kernels.lock` for the Hub kernels named in the kernelhub config
(`--kernelhub-config`, default searched in the current directory; `--config` is its deprecated spelling).

Each entry records the repository, the version/revision asked for, the commit it resolved to, and the
sha256 of every file of the locked build variant(s) (default: the one this system loads; add others
with `--variant`, e.g. to lock a CUDA build from a CPU machine). Set `lockfile = "kernels.lock"` in the
config (or use `LockedLayerRepository`) to load only locked, verified bytes.
"""

from __future__ import annotations

from pathlib import Path

from kernelhub.cli._common import add_kernelhub_config_arguments, add_subcommand
from kernelhub.config import load_config
from kernelhub.lock import DEFAULT_LOCKFILE, lock_kernel, write_lockfile

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = add_subcommand(sub, "lock", "resolve the config's Hub kernels to commits and write kernels.lock", __doc__)
    add_kernelhub_config_arguments(p, "kernelhub.toml or pyproject.toml (default: search the current directory)")
    p.add_argument(
        "--output",
        "-o",
        default=None,
        help=f"lock file to write (default: {DEFAULT_LOCKFILE} next to the config)",
    )
    p.add_argument("--variant", action="append", default=None, help="lock this build variant (repeatable)")
    p.set_defaults(run=run)


def run(args) -> int:
    config = load_config(args.kernelhub_config)
    if config is None:
        raise FileNotFoundError(
            "no kernelhub config found (kernelhub.toml, or pyproject.toml with [tool.kernelhub])"
        )
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
    base = Path(given).parent if given and not Path(given).is_dir() else Path(given or ".")
    output = Path(args.output) if args.output else base / (config.lockfile or DEFAULT_LOCKFILE)
    print(f"wrote {write_lockfile(entries, output)}")
    return 0
