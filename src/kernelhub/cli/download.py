"""`kernelhub download`: fetch kernels into the Hugging Face cache (only this system's build variant).

`kernelhub download ORG/NAME [--version N | --revision REV]` fetches one kernel; with no repository,
every Hub kernel named in the kernelhub config (`--kernelhub-config`, default ./kernelhub.toml or
./pyproject.toml; `--config` is its deprecated spelling) is fetched. Nothing is imported, so no
publisher trust is needed; afterwards the kernels load offline (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

from kernelhub._fetch import resolve_kernel
from kernelhub.cli._common import add_kernelhub_config_arguments, add_ref_arguments, add_subcommand

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    p = add_subcommand(sub, "download", "download kernels (this system's build variant) into the cache", __doc__)
    p.add_argument("repo_id", nargs="?", help="ORG/NAME; omit to download the kernels of the config")
    add_ref_arguments(p)
    p.add_argument("--variant", help="download this build variant instead of the best one for this system")
    add_kernelhub_config_arguments(p, "kernelhub.toml or pyproject.toml (when no ORG/NAME is given)")
    p.set_defaults(run=run)


def run(args) -> int:
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
