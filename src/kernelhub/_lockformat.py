"""`kernels.lock` on disk: the three formats kernelhub reads and the pair of files it writes.

- Hugging Face `kernels` 0.17 (what kernelhub writes, so `kernels` reads it): a JSON list of
  `{"dependency": {"repo-id": ..., "version": N | "revision": ...}, "lock": {"commit": ...}}`.
  `kernels` refuses any field beyond these, so kernelhub's sha256 of every file goes beside it, in
  `<lockfile>.sha256` (the format below), matched to the lock by repository and commit.
- Older `kernels` locks: a JSON list of `{"repo_id", "sha", "variants": {name: {"hash", "hash_type"}}}`,
  the variant hash being `git_lfs_concat` (see `lock.kernels_variant_hash`).
- kernelhub's own: `{"lockfile_version": 1, "kernels": [{repo_id, repo_type, version, revision, ref,
  commit, variants: {name: {repo path: sha256}}}]}`.

Every format is parsed into the same entry dict: the kernelhub fields plus `variant_hashes`
({name: {"hash", "hash_type"}}, from older `kernels` locks).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kernelhub._fetch import default_repo_type

__all__ = [
    "KERNELS_HASH_TYPE",
    "LOCKFILE_VERSION",
    "dependency_key",
    "dump_kernels_lock",
    "dump_sidecar",
    "parse_lock",
    "sidecar_path",
]

LOCKFILE_VERSION = 1
KERNELS_HASH_TYPE = "git_lfs_concat"
_HEX40 = re.compile(r"^[0-9a-fA-F]{40}$")
_KERNELS_HASH = re.compile(r"^sha256-[0-9a-f]{64}$")


def sidecar_path(path: Path) -> Path:
    """Where kernelhub keeps the per-file sha256 of the lock at `path`."""
    return path.with_name(path.name + ".sha256")


def _kernels_entry(i: int, item: dict) -> dict:
    """One entry of a `kernels` 0.17 lock."""
    dep, lock = item.get("dependency"), item.get("lock")
    if not isinstance(dep, dict) or not isinstance(lock, dict) or set(item) - {"dependency", "lock"}:
        raise ValueError(f"entry {i}: must be {{'dependency': {{...}}, 'lock': {{'commit': ...}}}}, got {item!r}")
    repo_id, version, revision, commit = dep.get("repo-id"), dep.get("version"), dep.get("revision"), lock.get("commit")
    if (version is None) == (revision is None):
        raise ValueError(f"entry {i} ({repo_id!r}): `dependency` needs exactly one of `version` and `revision`")
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise ValueError(f"entry {i} ({repo_id!r}): `dependency.version` must be an int, got {version!r}")
    if not isinstance(commit, str) or not _HEX40.match(commit):
        raise ValueError(f"entry {i} ({repo_id!r}): `lock.commit` must be a 40-hex-digit commit, got {commit!r}")
    # `kernels` locks name no repository type: the Hub's kernel type where this client has it
    return {"repo_id": repo_id, "repo_type": default_repo_type(), "version": version, "revision": revision,
            "ref": f"v{version}" if version is not None else revision, "commit": commit.lower(), "variants": {},
            "variant_hashes": {}}


def _legacy_kernels_entry(i: int, item: dict) -> dict:
    """One entry of an older `kernels` lock (a hash per variant)."""
    repo_id, commit, variants = item.get("repo_id"), item.get("sha"), item.get("variants")
    if not isinstance(commit, str) or not _HEX40.match(commit):
        raise ValueError(f"entry {i} ({repo_id!r}): `sha` must be a 40-hex-digit commit, got {commit!r}")
    if not isinstance(variants, dict):
        raise ValueError(f"entry {i} ({repo_id!r}): `variants` must map variant names to hashes, got {variants!r}")
    hashes = {}
    for name, lock in variants.items():
        if (not isinstance(lock, dict) or lock.get("hash_type", KERNELS_HASH_TYPE) != KERNELS_HASH_TYPE
                or not isinstance(lock.get("hash"), str) or not _KERNELS_HASH.match(lock["hash"])):
            raise ValueError(
                f"entry {i} ({repo_id!r}): `variants.{name}` must be "
                f"{{'hash': 'sha256-<64 hex>', 'hash_type': '{KERNELS_HASH_TYPE}'}}, got {lock!r}"
            )
        hashes[name] = {"hash": lock["hash"], "hash_type": KERNELS_HASH_TYPE}
    return {"repo_id": repo_id, "repo_type": default_repo_type(), "version": None, "revision": None,
            "ref": commit.lower(), "commit": commit.lower(), "variants": {}, "variant_hashes": hashes}


def parse_lock(data: object) -> tuple[str, list[dict]]:
    """(format name, entries) of a parsed lock file; ValueError says what is malformed."""
    if isinstance(data, dict):
        if data.get("lockfile_version") != LOCKFILE_VERSION:
            raise ValueError(f"must have lockfile_version {LOCKFILE_VERSION} (or be a list, as `kernels` writes)")
        entries = data.get("kernels")
        required = {"repo_id", "repo_type", "commit", "variants"}
        if not isinstance(entries, list) or any(not isinstance(e, dict) or required - set(e) for e in entries):
            raise ValueError(f"every entry of `kernels` needs keys {sorted(required)}")
        return "kernelhub", [{**e, "variant_hashes": {}} for e in entries]
    if not isinstance(data, list):
        raise ValueError(f"must be a JSON list (as `kernels` writes) or object, got {type(data).__name__}")
    out = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise ValueError(f"entry {i}: must be an object, got {item!r}")
        out.append(_kernels_entry(i, item) if "dependency" in item else _legacy_kernels_entry(i, item))
    return "kernels", out


def _dependency(e: dict) -> dict:
    dep: dict = {"repo-id": e["repo_id"]}
    if e.get("version") is not None:
        dep["version"] = e["version"]
    else:  # as asked, else what it resolved to ("v2", "main"): `kernels` needs one of the two
        dep["revision"] = e.get("revision") or e.get("ref") or e["commit"]
    return dep


def dependency_key(e: dict) -> tuple:
    """What ties a sidecar entry to its `kernels` lock entry: repository, commit, version or revision."""
    return (e["commit"], tuple(sorted(_dependency(e).items())))


def dump_kernels_lock(entries: list[dict]) -> str:
    """The `kernels` 0.17 lock of `entries` (no field `kernels` would refuse)."""
    items = [{"dependency": _dependency(e), "lock": {"commit": e["commit"]}} for e in entries]
    return json.dumps(items, indent=2) + "\n"


def dump_sidecar(entries: list[dict]) -> str:
    plain = [{k: v for k, v in e.items() if k != "variant_hashes"} for e in entries]
    return json.dumps({"lockfile_version": LOCKFILE_VERSION, "kernels": plain}, indent=2, sort_keys=True) + "\n"
