"""A kernel repository's own files, read and copied without following a link.

What `check` reads, `build` copies and `upload` publishes must be regular files inside the
repository: a symlink (`LICENSE -> /etc/passwd`) would publish its target, a FIFO would hang the
read. Scans use `lstat`, and every open walks the path one component at a time with `O_NOFOLLOW`,
so a link swapped in after the scan is refused as well. (A hard link is the file itself: its bytes
are the repository's, so it is published like any other file.)
"""

from __future__ import annotations

import errno
import fnmatch
import os
import stat
from pathlib import Path

__all__ = [
    "PUBLISHED_TOP_LEVEL",
    "copy_files",
    "link_problem",
    "read_file",
    "repository_link_problems",
    "scan_tree",
    "skipped",
]

PUBLISHED_TOP_LEVEL = ("kernel.toml", "README.md", "LICENSE*")  # beside build/: what `upload` publishes
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # no wait on a FIFO


def link_problem(path: Path) -> str:
    return f"{path}: a symlink; publish the real file or directory"


def skipped(name: str) -> bool:
    """Names a build leaves out: bytecode caches and hidden files (.DS_Store, editor swap files)."""
    return name.startswith(".") or name == "__pycache__" or name.endswith((".pyc", ".pyo"))


def _is_link(path: Path, e: OSError) -> bool:
    """Whether an open with O_NOFOLLOW failed because `path` is a link (ELOOP on Linux, EMLINK on BSDs)."""
    return e.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR) and path.is_symlink()


def _open(base: Path, rel: str, *, directory: bool = False) -> int:
    """A file descriptor for `base/rel`, following no link below `base` (base itself is the caller's)."""
    parts = [p for p in rel.split("/") if p]
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                nxt = os.open(part, _FILE_FLAGS if last and not directory else _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if _is_link(base.joinpath(*parts[: i + 1]), e):
                    raise ValueError(link_problem(base.joinpath(*parts[: i + 1]))) from None
                raise
            os.close(fd)
            fd = nxt
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISDIR(mode) if directory else stat.S_ISREG(mode)):
            kind = "directory" if directory else "regular file"
            raise ValueError(f"{base.joinpath(*parts)}: not a {kind}")
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_file(base: Path, rel: str, *, limit: int | None = None) -> bytes:
    """The bytes of the regular file `base/rel`; ValueError for a link, a special file, or more than
    `limit` bytes (a manifest is small: a huge one is refused before parsing)."""
    fd = _open(base, rel)
    with os.fdopen(fd, "rb") as f:
        data = f.read() if limit is None else f.read(limit + 1)  # (a file growing meanwhile stops here too)
    if limit is not None and len(data) > limit:
        raise ValueError(f"{base / rel}: larger than {limit} bytes")
    return data


def scan_tree(base: Path, rel: str) -> tuple[list[str], list[str]]:
    """(files, problems) under the directory `base/rel`: the paths (relative to `base`, POSIX) of its
    regular files, leaving out `skipped` names, and a problem for each link or special file found.
    A skipped name that is a link is still a problem; skipped directories are not entered."""
    files: list[str] = []
    problems: list[str] = []

    def walk(fd: int, prefix: str) -> None:
        with os.scandir(fd) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            path = f"{prefix}/{entry.name}"
            if entry.is_symlink():
                problems.append(link_problem(base / path))
            elif skipped(entry.name):
                continue
            elif entry.is_dir(follow_symlinks=False):
                try:
                    sub = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:  # replaced by a link since the listing
                    if not _is_link(base / path, e):
                        raise
                    problems.append(link_problem(base / path))
                    continue
                try:
                    walk(sub, path)
                finally:
                    os.close(sub)
            elif entry.is_file(follow_symlinks=False):
                files.append(path)
            else:
                problems.append(f"{base / path}: not a regular file or directory")

    try:
        top = _open(base, rel, directory=True)
    except ValueError as e:
        return [], [str(e)]
    try:
        walk(top, rel.strip("/"))
    finally:
        os.close(top)
    return files, problems


def repository_link_problems(repo: Path) -> list[str]:
    """Links and special files among what `check` reads, `build` copies and `upload` publishes:
    kernel.toml, README.md, LICENSE*, and everything under torch-ext/ and build/."""
    problems = []
    with os.scandir(repo) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        if entry.name in ("torch-ext", "build"):
            if entry.is_symlink():
                problems.append(link_problem(repo / entry.name))
            elif entry.is_dir(follow_symlinks=False):
                problems += scan_tree(repo, entry.name)[1]
        elif any(fnmatch.fnmatchcase(entry.name, p) for p in PUBLISHED_TOP_LEVEL):
            if entry.is_symlink():
                problems.append(link_problem(repo / entry.name))
            elif not entry.is_file(follow_symlinks=False):
                problems.append(f"{repo / entry.name}: not a regular file")
    return problems


def copy_files(base: Path, files: list[str], dest: Path) -> None:
    """Copy `base/<f>` to `dest/<f>` for each relative path f, refusing links (see `_open`)."""
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(read_file(base, rel))
