"""`kernelhub build DIR [--output BUILD_DIR]`: write the build variant `build/torch-universal/` from the
source `torch-ext/<name>/` (Hugging Face kernel-builder's layout).

The variant holds `<name>/`, a clean copy of the source package (no bytecode, no hidden files; a
symlink or anything else that is not a regular file fails the build), `<name>/kernel.toml` (a copy:
the kernel reads its variant table from it at run time) and `metadata.json`, in the variant
directory where kernel-builder writes it and Hugging Face `kernels` reads it (name, id, version,
license, python-depends, backend). The repository must pass `kernelhub check` first. The new variant
is assembled beside the old one and swapped in, so a failed build leaves the previous one whole;
other variants in build/ are left as they are. `kernelhub upload` builds into a staging directory
of its own, so publishing never leaves a build behind.

The loader reads a repository's build/ when it has one, else its source: the bundled kernels
(kernels_repo/) run from torch-ext/ with no build step. After building one of them in place,
delete its build/ (or pass --output elsewhere) or edits to torch-ext/ are not what gets loaded.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from kernelhub.cli._build_plan import UNIVERSAL, built_files
from kernelhub.cli._common import add_subcommand
from kernelhub.cli.check import check_kernel_dir

__all__ = ["add_parser", "build_kernel", "run"]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        shutil.rmtree(path)


def build_kernel(directory: str | Path, *, output: str | Path | None = None) -> Path:
    """Build `directory`'s source into `output` (default `directory/build`); returns the variant
    directory written, `<output>/torch-universal`."""
    directory = Path(directory)
    manifest, problems = check_kernel_dir(directory, build=False)
    if problems:
        raise ValueError("build_kernel: `directory` fails `kernelhub check`:\n  " + "\n  ".join(problems))
    if not (directory / "torch-ext").is_dir():
        raise ValueError(f"build_kernel: `directory` {directory} has no source torch-ext/{manifest.name}/ to build "
                         "(a repository with only build/ is already built)")
    files = built_files(directory, manifest.name, manifest.version, manifest.license)
    out = directory / "build" if output is None else Path(output)
    if out.exists() and not out.is_dir():
        raise ValueError(f"build_kernel: `output` {out} is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    # assembled beside `out` (not in it: a leftover would look like a variant), then renamed into place
    staging = Path(tempfile.mkdtemp(prefix=".kernelhub-build-", dir=out.parent))
    try:
        staging.chmod(0o777 & ~_umask())  # mkdtemp's 0700 would become the variant's mode
        for rel, data in files.items():
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / rel).write_bytes(data)
        target = out / UNIVERSAL
        old = None
        if target.exists() or target.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=".kernelhub-old-", dir=out.parent)) / UNIVERSAL
            os.rename(target, old)
        try:
            os.rename(staging, target)
        except BaseException:
            if old is not None:
                os.rename(old, target)
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if old is not None:
        _remove(old)
        old.parent.rmdir()
    return target


def add_parser(sub) -> None:
    p = add_subcommand(
        sub, "build", "write build/torch-universal/<name>/ and metadata.json from torch-ext/<name>/", __doc__
    )
    p.add_argument("dir", type=Path, help="kernel repository directory, e.g. kernels_repo/swiglu")
    p.add_argument("--output", "-o", type=Path, default=None, help="build directory to write (default: DIR/build)")
    p.set_defaults(run=run)


def run(args) -> int:
    print(build_kernel(args.dir, output=args.output))
    return 0
