"""`kernelhub download`: fetch kernels into the Hugging Face cache (only this system's build variant).

`kernelhub download ORG/NAME [--version N | --revision REV]` fetches one kernel; with no repository,
every Hub kernel named in the kernelhub config (`--kernelhub-config`, default ./kernelhub.toml or
./pyproject.toml; `--config` is its deprecated spelling) is fetched. `kernelhub download PROJECT_DIR
[--all-variants]` is `kernels download`: every kernel of PROJECT_DIR/kernels.lock at its locked commit,
checked against the lock. Nothing is imported, so no publisher trust is needed; afterwards the
kernels load offline (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kernelhub._fetch import resolve_kernel
from kernelhub.cli._common import add_kernelhub_config_arguments, add_ref_arguments, add_subcommand

__all__ = ["add_parser", "download_kernels", "run"]


def add_parser(sub) -> None:
    p = add_subcommand(sub, "download", "download kernels (this system's build variant) into the cache", __doc__)
    p.add_argument("repo_id", nargs="?", metavar="ORG/NAME | PROJECT_DIR",
                   help="a kernel, or a directory holding kernels.lock; omit to download the kernels of the config")
    add_ref_arguments(p)
    p.add_argument("--variant", help="download this build variant instead of the best one for this system")
    p.add_argument("--all-variants", action="store_true", help="with PROJECT_DIR: every locked build variant")
    add_kernelhub_config_arguments(p, "kernelhub.toml or pyproject.toml (when no ORG/NAME is given)")
    p.set_defaults(run=run)


def download_kernels(args) -> None:
    """`kernels download`'s function: `args.project_dir` holds kernels.lock; `args.all_variants`."""
    from kernelhub.lock import download_locked

    project_dir = Path(args.project_dir)
    lockfile = project_dir / "kernels.lock"
    if not lockfile.is_file():
        raise FileNotFoundError(f"No kernels.lock file found in: {project_dir}")
    for path in download_locked(lockfile, all_variants=bool(getattr(args, "all_variants", False))):
        print(path)


def run(args) -> int:
    if args.repo_id and Path(args.repo_id).is_dir():
        if args.version is not None or args.revision or args.variant:
            raise ValueError("download: PROJECT_DIR downloads the locked commits; --version/--revision/--variant "
                             "apply to ORG/NAME")
        download_kernels(argparse.Namespace(project_dir=Path(args.repo_id), all_variants=args.all_variants))
        return 0
    if args.all_variants:
        raise ValueError("download: --all-variants applies to PROJECT_DIR (a directory holding kernels.lock)")
    if args.repo_id:
        targets = [(args.repo_id, args.version, args.revision)]
    else:
        from kernelhub.config import load_config

        config = load_config(args.kernelhub_config)
        if config is None:
            raise FileNotFoundError(
                "no ORG/NAME given and no kernelhub config found (kernelhub.toml, pyproject.toml)"
            )
        targets = config.hub_kernels()
    for repo_id, version, revision in targets:
        r = resolve_kernel(
            repo_id, version=version, revision=revision, variant=args.variant if args.repo_id else None
        )
        print(f"{repo_id} {r.ref} {r.commit} {r.variant} {r.path}")
    return 0

