"""Download one build variant of a commit into the Hugging Face cache, and check it is still whole.

Everything the Hub sends is untrusted: file names are checked before they become paths, sizes are
compared with what arrived, and the list of files is kept beside a completion marker so that a
snapshot that lost a file since is noticed (re-downloaded online, named offline) instead of imported.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from filelock import FileLock

from kernelhub._fetch import (
    VARIANT_NAME_RE,
    KernelHubError,
    KernelNotFoundError,
    KernelVariantNotFoundError,
    _hub_errors,
    _storage,
    api,
    cache_dir,
    check_commit,
    check_revision,
    current_user_agent,
    endpoint,
    inside,
    offline,
)

__all__ = ["fetch_variant", "variant_manifest"]

_MARKER_FORMAT = 2  # {"format": 2, "commit": ..., "files": {repo path: size}}


def _check_file_path(repo_id: str, variant: str, path: str) -> str:
    """A file path the Hub listed: under build/<variant>/, plain components only."""
    parts = path.split("/")
    if (
        parts[:2] != ["build", variant]
        or len(parts) < 3
        or any(p in ("", ".", "..") or "\\" in p or ":" in p or any(ord(c) < 32 for c in p) for p in parts)
    ):
        raise KernelHubError(
            f"the Hub at {endpoint()} listed file {path!r} in build/{variant}/ of kernel {repo_id!r}, "
            "which is not a plain relative path inside it; refusing the download"
        )
    return path


def _list_files(repo_id: str, repo_type: str, commit: str, variant: str) -> dict[str, int]:
    """{repo path: size} of build/<variant>/ at `commit`, as the Hub lists it (checked)."""
    from huggingface_hub.hf_api import RepoFile

    with _hub_errors(repo_id, repo_type, commit):
        tree = api().list_repo_tree(
            repo_id, path_in_repo=f"build/{variant}", revision=commit, repo_type=repo_type, recursive=True
        )
        files = {}
        for item in tree:
            if isinstance(item, RepoFile):
                size = item.size
                if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                    raise KernelHubError(
                        f"the Hub at {endpoint()} gave {item.path!r} of kernel {repo_id!r} the size {size!r}"
                    )
                files[_check_file_path(repo_id, variant, item.path)] = size
    return files


def _missing(snapshot: Path, files: dict[str, int], *, sizes: bool = False) -> list[str]:
    """Files of the manifest absent from the snapshot (with `sizes`, also those of another size).

    A file present with other bytes is left to the lock to judge (it names the file and the hash)."""
    out = []
    for name, size in sorted(files.items()):
        path = snapshot / name
        try:
            ok = path.is_file() and (not sizes or path.stat().st_size == size)
        except OSError:
            ok = False
        if not ok:
            out.append(name)
    return out


def variant_manifest(marker: Path) -> dict[str, int] | None:
    """The file list a completion marker recorded, or None (no marker, an older or a damaged one)."""
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    files = data.get("files") if isinstance(data, dict) and data.get("format") == _MARKER_FORMAT else None
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, int) for k, v in files.items()):
        return None
    return files


def _download(repo_id: str, repo_type: str, commit: str, files: dict[str, int]) -> None:
    from huggingface_hub import hf_hub_download

    user_agent = current_user_agent()  # (the pool's threads do not see the caller's context)

    def one(name: str) -> None:
        hf_hub_download(repo_id, name, repo_type=repo_type, revision=commit, cache_dir=str(cache_dir()),
                        endpoint=endpoint(), user_agent=user_agent)

    with _hub_errors(repo_id, repo_type, commit), ThreadPoolExecutor(max_workers=min(8, len(files) or 1)) as pool:
        for future in [pool.submit(one, name) for name in sorted(files)]:
            future.result()


def fetch_variant(
    repo_id: str, repo_type: str, ref: str, commit: str, variant: str, *, local_only: bool = False
) -> Path:
    """Download `build/<variant>/` of `commit` (once; under a file lock) and return its directory.

    The lock plus a completion marker make concurrent loaders safe: one process downloads, the others
    wait, and nobody imports a tree that is still being written. The marker lists the files and
    their sizes; a file gone or changed in size since is downloaded again (online) or named in a
    KernelHubError (offline). `local_only`: never download, as offline.
    """
    check_commit(repo_id, commit, "commit")
    if not VARIANT_NAME_RE.match(variant):
        raise ValueError(f"fetch_variant: `variant` must be a build variant directory name, got {variant!r}")
    storage = _storage(repo_id, repo_type)
    locks = cache_dir() / ".kernelhub-locks" / storage.name
    locks.mkdir(parents=True, exist_ok=True)
    marker = locks / f"{commit}-{variant}.complete"
    snapshot = storage / "snapshots" / commit
    target = inside(storage, snapshot / "build" / variant, f"kernel {repo_id!r}: the variant directory")
    with FileLock(str(locks / f"{commit}-{variant}.lock")):
        files = variant_manifest(marker)
        missing = _missing(snapshot, files) if files is not None else None
        if missing is None or missing:
            if local_only or offline():
                target = _offline(repo_id, repo_type, commit, variant, target, missing)
            else:
                files = _list_files(repo_id, repo_type, commit, variant)
                if not files:
                    raise KernelVariantNotFoundError(f"kernel {repo_id!r} at {commit[:12]} has no build/{variant}/")
                fetched = {name: files[name] for name in _missing(snapshot, files)}
                _download(repo_id, repo_type, commit, fetched)
                wrong = _missing(snapshot, fetched, sizes=True)
                if wrong:
                    raise KernelHubError(
                        f"kernel {repo_id!r} at {commit[:12]}: {wrong[0]} did not arrive whole "
                        f"(not {files[wrong[0]]} bytes, as the Hub listed it)"
                    )
                tmp = marker.with_name(f".{marker.name}.{os.getpid()}")
                tmp.write_text(json.dumps({"format": _MARKER_FORMAT, "commit": commit, "files": files}))
                os.replace(tmp, marker)
        if ref != commit:  # remember the branch/tag -> commit mapping for offline use, as huggingface_hub does
            refs = storage / "refs"
            ref_file = inside(refs, refs / check_revision("fetch_variant", ref), f"kernel {repo_id!r}: the ref")
            ref_file.parent.mkdir(parents=True, exist_ok=True)
            if not ref_file.is_file() or ref_file.read_text() != commit:
                tmp = ref_file.with_name(f".{ref_file.name}.{os.getpid()}")
                tmp.write_text(commit)
                os.replace(tmp, ref_file)
    return target


def _offline(repo_id: str, repo_type: str, commit: str, variant: str, target: Path, missing: list[str] | None) -> Path:
    """Offline: a marked snapshot missing a file is an error naming it; an unmarked one (a cache
    filled by another tool) is used as huggingface_hub finds it."""
    if missing:
        raise KernelHubError(
            f"offline (HF_HUB_OFFLINE=1) and kernel {repo_id!r} {variant} at {commit[:12]} lost {missing[0]} "
            f"from the cache since it was downloaded ({len(missing)} file(s) missing or changed in size); "
            "download it again online"
        )
    from huggingface_hub import snapshot_download

    try:
        with _hub_errors(repo_id, repo_type, commit):
            snapshot_download(repo_id, repo_type=repo_type, revision=commit, cache_dir=str(cache_dir()),
                              allow_patterns=[f"build/{variant}/*"], local_files_only=True)
    except KernelHubError as e:
        raise KernelNotFoundError(
            f"offline and kernel {repo_id!r} {variant} at {commit[:12]} is not fully cached: {e}"
        ) from e
    if not target.is_dir():
        raise KernelNotFoundError(f"offline and kernel {repo_id!r} at {commit[:12]} has no cached build/{variant}/")
    return target
