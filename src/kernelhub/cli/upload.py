"""`kernelhub upload DIR --repo-id ORG/NAME [--version N] [--private]`: publish a kernel repository.

Steps: `kernelhub check DIR`; create the repository (the Hub's `kernel` type where huggingface_hub
supports it, else `model`; `--repo-type` overrides); create branch `vN` (N from `--version`, else
kernel.toml's `version`); upload kernel.toml, README, LICENSE and build/ to that branch, deleting
build files a previous upload left; tag the commit `vN.K` (K counts releases of vN); print the commit.
Users then load it with `get_kernel("ORG/NAME", version=N)`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from kernelhub._fetch import api, check_repo_id, default_repo_type
from kernelhub.cli._common import add_subcommand
from kernelhub.cli.check import check_kernel_dir

__all__ = ["add_parser", "run", "upload_kernel"]

_ALLOW = ["kernel.toml", "README.md", "LICENSE*", "build/*"]
_IGNORE = ["*/__pycache__/*", "*.pyc", ".*", "*/.*"]  # hidden files at any depth (.DS_Store, ...)


def upload_kernel(
    directory: str | Path,
    repo_id: str,
    *,
    version: int | None = None,
    private: bool = False,
    repo_type: str | None = None,
) -> tuple[str, str, str]:
    """Publish `directory` to branch `vN` of `repo_id`; returns (branch, tag, commit)."""
    check_repo_id("upload_kernel", repo_id)
    manifest, problems = check_kernel_dir(directory)
    if problems:
        raise ValueError("upload_kernel: `directory` fails `kernelhub check`:\n  " + "\n  ".join(problems))
    version = manifest.version if version is None else version
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"upload_kernel: `version` must be an int >= 1, got {version!r}")
    repo_type = repo_type or default_repo_type()
    hub = api()
    branch = f"v{version}"
    hub.create_repo(repo_id, repo_type=repo_type, private=private, exist_ok=True)
    hub.create_branch(repo_id, branch=branch, repo_type=repo_type, exist_ok=True)
    info = hub.upload_folder(
        repo_id=repo_id,
        folder_path=str(directory),
        repo_type=repo_type,
        revision=branch,
        allow_patterns=_ALLOW,
        ignore_patterns=_IGNORE,
        delete_patterns=["build/*"],
        commit_message=f"Upload {manifest.name} version {version}",
    )
    tags = [t.name for t in hub.list_repo_refs(repo_id, repo_type=repo_type).tags]
    # the next release number after the highest (a deleted tag leaves a gap: counting would collide)
    release = max((int(m.group(1)) for t in tags if (m := re.fullmatch(rf"v{version}\.(\d+)", t))), default=-1) + 1
    tag = f"v{version}.{release}"
    hub.create_tag(
        repo_id,
        tag=tag,
        revision=info.oid,
        repo_type=repo_type,
        tag_message=f"{manifest.name} version {version}, release {release}",
    )
    return branch, tag, info.oid


def add_parser(sub) -> None:
    p = add_subcommand(
        sub, "upload", "publish a kernel repository to branch vN of a Hub repository and tag it", __doc__
    )
    p.add_argument("dir", type=Path, help="kernel repository directory, e.g. kernels_repo/swiglu")
    p.add_argument("--repo-id", required=True, help="Hub repository, ORG/NAME")
    p.add_argument(
        "--version", type=int, default=None, help="major version N -> branch vN (default: kernel.toml)"
    )
    p.add_argument("--private", action="store_true", help="create the repository as private")
    p.add_argument(
        "--repo-type",
        choices=["kernel", "model"],
        default=None,
        help="Hub repository type (default: kernel where huggingface_hub supports it)",
    )
    p.set_defaults(run=run)


def run(args) -> int:
    branch, tag, commit = upload_kernel(
        args.dir, args.repo_id, version=args.version, private=args.private, repo_type=args.repo_type
    )
    print(f"uploaded {args.dir} to {args.repo_id} branch {branch}, tag {tag}", file=sys.stderr)
    print(commit)
    return 0
