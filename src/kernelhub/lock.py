"""`kernels.lock`: the exact commit and the sha256 of every file of each locked build variant.

A lock turns "version 1 of org/swiglu" into reviewed bytes: loading through it downloads that commit
and refuses to import if any file differs from the lock (or an unlocked file appears), naming the file.

Format (JSON, sorted keys so diffs stay small):

    {"lockfile_version": 1,
     "kernels": [{"repo_id": "org/swiglu", "repo_type": "kernel", "version": 1, "revision": null, "ref": "v1",
                  "commit": "<40 hex>",
                  "variants": {"torch-universal": {"build/torch-universal/swiglu/__init__.py": "<sha256>"}}}]}
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from types import ModuleType

from kernelhub._download import fetch_variant
from kernelhub._fetch import (
    KernelHubError,
    ResolvedKernel,
    choose_variant,
    default_repo_type,
    list_variants,
)
from kernelhub.variants import rank_variants

__all__ = [
    "DEFAULT_LOCKFILE",
    "KernelLockError",
    "find_lock_entry",
    "get_locked_kernel",
    "hash_variant",
    "lock_kernel",
    "read_lockfile",
    "verify_variant",
    "write_lockfile",
]

DEFAULT_LOCKFILE = "kernels.lock"
LOCKFILE_VERSION = 1


class KernelLockError(KernelHubError, ValueError):
    """The lock file is missing, malformed, has no entry for a kernel, or a file's hash differs."""


def _lock_path(lockfile: str | Path | None) -> Path:
    if lockfile is not None:
        return Path(lockfile)
    return Path(os.environ.get("KERNELHUB_LOCKFILE") or DEFAULT_LOCKFILE)


def _variant_files(variant_dir: Path) -> dict[str, Path]:
    """Files of a variant keyed by repo path (`build/<variant>/...`); bytecode caches are not content."""
    prefix = f"build/{variant_dir.name}"
    out = {}
    for p in sorted(variant_dir.rglob("*")):
        rel = p.relative_to(variant_dir)
        if "__pycache__" in rel.parts or not p.is_file():
            continue
        out[f"{prefix}/{rel.as_posix()}"] = p
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def hash_variant(variant_dir: Path) -> dict[str, str]:
    """{repo path: sha256} for every file of a downloaded variant directory."""
    return {name: _sha256(p) for name, p in _variant_files(Path(variant_dir)).items()}


def verify_variant(variant_dir: Path, expected: dict[str, str], *, where: str) -> None:
    """Raise KernelLockError naming the first file that is missing, changed, or not in the lock."""
    actual = _variant_files(Path(variant_dir))
    for name, digest in sorted(expected.items()):
        if name not in actual:
            raise KernelLockError(f"{where}: locked file {name} is missing from the download")
        got = _sha256(actual[name])
        if got != digest:
            raise KernelLockError(f"{where}: sha256 of {name} is {got}, the lock says {digest}; refusing to load")
    extra = sorted(set(actual) - set(expected))
    if extra:
        raise KernelLockError(f"{where}: file {extra[0]} is not in the lock; refusing to load")


def lock_kernel(
    repo_id: str,
    *,
    version: int | None = None,
    revision: str | None = None,
    variants: list[str] | None = None,
) -> dict:
    """Resolve a kernel to a commit, download the variant(s) and return its lock entry.

    `variants`: extra variant names to lock besides the one this system would load (e.g. a CUDA
    build locked from a CPU machine).
    """
    repo_type = default_repo_type()
    ref, commit, names = list_variants(repo_id, revision=revision, version=version, repo_type=repo_type)
    if variants:
        best = rank_variants(names)[0][:1]
        wanted = list(dict.fromkeys(best + list(variants)))
    else:
        wanted = [choose_variant(repo_id, commit, names)]
    hashes = {}
    for variant in wanted:
        if variant not in names:
            raise KernelLockError(f"lock_kernel: {repo_id!r} at {commit[:12]} has no variant {variant!r}: {names}")
        hashes[variant] = hash_variant(fetch_variant(repo_id, repo_type, ref, commit, variant))
    return {
        "repo_id": repo_id,
        "repo_type": repo_type,
        "version": version,  # as asked: what a LockedLayerRepository looks entries up by
        "revision": revision,
        "ref": ref,  # what that resolved to (e.g. branch "v2" when no version was asked for)
        "commit": commit,
        "variants": hashes,
    }


def write_lockfile(entries: list[dict], path: str | Path = DEFAULT_LOCKFILE) -> Path:
    path = Path(path)
    entries = sorted(entries, key=lambda e: (e["repo_id"], e.get("version") or 0, e.get("revision") or ""))
    text = json.dumps({"lockfile_version": LOCKFILE_VERSION, "kernels": entries}, indent=2, sort_keys=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)
    return path


def read_lockfile(lockfile: str | Path | None = None) -> list[dict]:
    path = _lock_path(lockfile)
    if not path.is_file():
        raise KernelLockError(f"read_lockfile: lock file {path} does not exist (create it with `kernelhub lock`)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise KernelLockError(f"read_lockfile: {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict) or data.get("lockfile_version") != LOCKFILE_VERSION:
        raise KernelLockError(f"read_lockfile: {path} must have lockfile_version {LOCKFILE_VERSION}")
    entries = data.get("kernels")
    required = {"repo_id", "repo_type", "commit", "variants"}
    if not isinstance(entries, list) or any(not isinstance(e, dict) or required - set(e) for e in entries):
        raise KernelLockError(f"read_lockfile: {path}: every entry of `kernels` needs keys {sorted(required)}")
    for i, e in enumerate(entries):
        problem = _entry_problem(e)
        if problem is not None:
            raise KernelLockError(f"read_lockfile: {path}: entry {i} ({e.get('repo_id')!r}): {problem}")
    return entries


def _entry_problem(e: dict) -> str | None:
    """What is malformed in one lock entry (types of the fields loading relies on), or None."""
    for key in ("repo_id", "repo_type"):
        if not isinstance(e[key], str) or not e[key]:
            return f"`{key}` must be a non-empty string, got {e[key]!r}"
    if not isinstance(e["commit"], str) or not re.fullmatch(r"[0-9a-f]{40}", e["commit"]):
        return f"`commit` must be a full 40-hex-digit commit hash, got {e['commit']!r}"
    variants = e["variants"]
    if not isinstance(variants, dict) or not variants:
        return f"`variants` must map variant names to file hashes, got {variants!r}"
    for name, files in variants.items():
        if not isinstance(files, dict) or not all(
            isinstance(f, str) and isinstance(h, str) and re.fullmatch(r"[0-9a-f]{64}", h) for f, h in files.items()
        ):
            return f"`variants.{name}` must map file paths to sha256 hex digests"
    for key in ("version", "revision", "ref"):
        value = e.get(key)
        if key == "version" and value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return f"`version` must be an int or null, got {value!r}"
        if key != "version" and value is not None and not isinstance(value, str):
            return f"`{key}` must be a string or null, got {value!r}"
    return None


def find_lock_entry(
    entries: list[dict], repo_id: str, *, version: int | None = None, revision: str | None = None
) -> dict:
    """The entry for `repo_id` (narrowed by version/revision when the lock has several)."""
    found = [e for e in entries if e["repo_id"] == repo_id]
    if version is not None:
        found = [e for e in found if e.get("version") == version]
    if revision is not None:
        found = [e for e in found if e.get("revision") == revision or e["commit"] == revision]
    if not found:
        have = sorted({e["repo_id"] for e in entries})
        raise KernelLockError(
            f"lock has no entry for {repo_id!r} (version={version}, revision={revision}); "
            f"locked: {have}. Run `kernelhub lock`."
        )
    if len(found) > 1:
        refs = [(e.get("version"), e.get("revision")) for e in found]
        raise KernelLockError(f"lock has {len(found)} entries for {repo_id!r} {refs}: pass version= or revision=")
    return found[0]


def get_locked_kernel(
    repo_id: str,
    *,
    lockfile: str | Path | None = None,
    version: int | None = None,
    revision: str | None = None,
) -> ModuleType:
    """Import the locked commit of `repo_id` after checking every file's sha256 against the lock."""
    from kernelhub.hub import _import_resolved

    path = _lock_path(lockfile)
    entry = find_lock_entry(read_lockfile(path), repo_id, version=version, revision=revision)
    commit, repo_type = entry["commit"], entry["repo_type"]
    variant = choose_variant(repo_id, commit, sorted(entry["variants"]))
    ref = f"v{entry['version']}" if entry.get("version") else (entry.get("revision") or commit)
    target = fetch_variant(repo_id, repo_type, commit, commit, variant)  # no ref update: the lock pins
    verify_variant(target, entry["variants"][variant], where=f"get_locked_kernel({repo_id!r}, lockfile={str(path)!r})")
    return _import_resolved(ResolvedKernel(repo_id, repo_type, ref, commit, variant, target))
