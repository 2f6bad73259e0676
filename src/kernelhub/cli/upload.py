"""`kernelhub upload DIR --repo-id ORG/NAME [--version N] [--private]`: publish a kernel repository.

Steps: `kernelhub check DIR`; stage what is published in a temporary directory: kernel.toml,
README.md, LICENSE* and build/ (built from torch-ext/ as `kernelhub build` does where DIR has a
source, else DIR's own build/), copied without following links (a symlink anywhere fails the upload,
so a link's target is never published) and checked again; create the repository (the Hub's `kernel`
type where huggingface_hub supports it, else `model`; `--repo-type` overrides); create branch `vN`
(N from `--version`, else kernel.toml's `version`); upload the staged files to that branch, deleting
build files a previous upload left; tag the commit `vN.K` (K counts releases of vN); print the commit.
DIR itself is not changed. Users then load it with `get_kernel("ORG/NAME", version=N)`.
"""

from __future__ import annotations

import fnmatch
import os
import re
import sys
import tempfile
from pathlib import Path

from kernelhub._fetch import api, check_repo_id, default_repo_type
from kernelhub.cli._common import add_subcommand
from kernelhub.cli._files import PUBLISHED_TOP_LEVEL, copy_files, scan_tree
from kernelhub.cli.build import build_kernel
from kernelhub.cli.check import KernelManifest, check_kernel_dir

__all__ = ["add_parser", "run", "stage_kernel", "upload_kernel"]


def _refuse(problems: list[str]) -> ValueError:
    return ValueError("upload_kernel: `directory` fails `kernelhub check`:\n  " + "\n  ".join(problems))


def stage_kernel(directory: str | Path, stage: str | Path) -> KernelManifest:
    """Lay out in `stage` exactly what `upload` publishes from `directory` (see the module doc)."""
    directory, stage = Path(directory), Path(stage)
    has_source = (directory / "torch-ext").is_dir()
    manifest, problems = check_kernel_dir(directory, build=not has_source)  # build/ is rebuilt from the source
    if problems:
        raise _refuse(problems)
    with os.scandir(directory) as it:
        top = sorted(e.name for e in it if any(fnmatch.fnmatchcase(e.name, p) for p in PUBLISHED_TOP_LEVEL))
    copy_files(directory, top, stage)
    if has_source:
        build_kernel(directory, output=stage / "build")
    else:
        files, problems = scan_tree(directory, "build")
        if problems:
            raise _refuse(problems)
        copy_files(directory, files, stage)
    _, problems = check_kernel_dir(stage)  # what is published, as it will be published
    if problems:
        raise _refuse(problems)
    return manifest


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
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 1):
        raise ValueError(f"upload_kernel: `version` must be an int >= 1, got {version!r}")
    with tempfile.TemporaryDirectory(prefix="kernelhub-upload-") as stage:
        manifest = stage_kernel(directory, stage)
        return _publish(stage, manifest, repo_id, version or manifest.version, private, repo_type)


_KERNEL_UPLOADS = "2.3"  # the first huggingface_hub whose upload API accepts repo_type="kernel"


def _check_client(repo_type: str) -> None:
    """Refuse before any request where this huggingface_hub cannot upload to `repo_type` (1.10 to 2.2
    download from `kernel` repositories but reject uploads to them, after creating the repository)."""
    import huggingface_hub
    from packaging.version import Version

    if repo_type == "kernel" and Version(huggingface_hub.__version__) < Version(_KERNEL_UPLOADS):
        raise ValueError(
            f"upload_kernel: huggingface_hub {huggingface_hub.__version__} cannot upload to a `kernel` repository "
            f"({_KERNEL_UPLOADS} and later can): upgrade it, or publish a `model` repository (`--repo-type model`)"
        )


def _publish(
    stage: str, manifest: KernelManifest, repo_id: str, version: int, private: bool, repo_type: str | None
) -> tuple[str, str, str]:
    repo_type = repo_type or default_repo_type()
    _check_client(repo_type)
    hub = api()
    branch = f"v{version}"
    hub.create_repo(repo_id, repo_type=repo_type, private=private, exist_ok=True)
    hub.create_branch(repo_id, branch=branch, repo_type=repo_type, exist_ok=True)
    info = hub.upload_folder(
        repo_id=repo_id,
        folder_path=stage,
        repo_type=repo_type,
        revision=branch,
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
