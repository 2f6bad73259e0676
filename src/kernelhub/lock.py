"""`kernels.lock`: the exact commit and the sha256 of every file of each locked build variant.

A lock turns "version 1 of org/swiglu" into reviewed bytes: loading through it downloads that commit
and refuses to import if any file differs from the lock (or an unlocked file appears), naming the file.

`write_lockfile` writes the lock in Hugging Face `kernels`' 0.17 format (so `kernels` reads it) and
kernelhub's per-file sha256 beside it in `<lockfile>.sha256`; `read_lockfile` reads that pair,
older `kernels` locks (a `git_lfs_concat` hash per variant, verified) and kernelhub's earlier
`{"lockfile_version": 1, ...}` files. The formats are described in `_lockformat`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import stat
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from kernelhub._download import fetch_variant
from kernelhub._fetch import (
    VARIANT_NAME_RE,
    ResolvedKernel,
    _storage,
    check_repo_id,
    check_revision,
    choose_variant,
    default_repo_type,
    list_variants,
    user_agent_scope,
)
from kernelhub._lockformat import (
    LOCKFILE_VERSION,
    dependency_key,
    dump_kernels_lock,
    dump_sidecar,
    parse_lock,
    sidecar_path,
)
from kernelhub.errors import KernelLockError  # KernelLockError re-exported: its earlier home
from kernelhub.variants import rank_variants, system_for_backend

__all__ = [
    "DEFAULT_LOCKFILE",
    "LOCKFILE_VERSION",
    "KernelLockError",
    "download_locked",
    "find_lock_entry",
    "get_locked_kernel",
    "hash_variant",
    "lock_kernel",
    "read_lockfile",
    "repository_lockfile",
    "verify_variant",
    "write_lockfile",
]

DEFAULT_LOCKFILE = "kernels.lock"


def _caller_distribution_lock() -> Path | None:
    """The `kernels.lock` that the calling package (the first module on the stack outside kernelhub)
    ships in its distribution metadata, as `kernels` reads it when `lockfile` is None; None where
    that package ships none. The text is copied to a private file (with the `.sha256` sidecar when
    the metadata has one), since a distribution's files need not be on disk."""
    frame = sys._getframe(1)
    while frame is not None and str(frame.f_globals.get("__name__", "")).split(".")[0] == "kernelhub":
        frame = frame.f_back
    if frame is None:
        return None
    top = str(frame.f_globals.get("__name__", "")).split(".")[0]
    for name in importlib.metadata.packages_distributions().get(top, []):
        dist = importlib.metadata.distribution(name)
        text = dist.read_text(DEFAULT_LOCKFILE)
        if text is None:
            continue
        side = dist.read_text(sidecar_path(Path(DEFAULT_LOCKFILE)).name)
        key = (name, text, side)
        if key not in _DISTRIBUTION_LOCKS:
            path = Path(tempfile.mkdtemp(prefix="kernelhub-lock-")) / DEFAULT_LOCKFILE
            path.write_text(text)
            if side is not None:
                sidecar_path(path).write_text(side)
            _DISTRIBUTION_LOCKS[key] = path
        return _DISTRIBUTION_LOCKS[key]
    return None


_DISTRIBUTION_LOCKS: dict[tuple, Path] = {}


def repository_lockfile(func: str, repo_id: str, lockfile: str | Path | None, *, version: int | None = None,
                        revision: str | None = None, check: bool = True) -> Path | None:
    """The lock file a locked repository keeps, checked where the repository is built, as `kernels`
    does: `lockfile`, or with None the calling package's shipped lock (None again where it ships none:
    `KERNELHUB_LOCKFILE` / `./kernels.lock` are then read at load). A kernel that an existing lock does
    not hold is refused now ("is not locked"); a lock file that does not exist yet is read at load."""
    if lockfile is not None and not isinstance(lockfile, (str, Path)):
        raise TypeError(f"{func}: `lockfile` must be a str or Path, got {lockfile!r}")
    if lockfile is None:
        path = None if os.environ.get("KERNELHUB_LOCKFILE") else _caller_distribution_lock()
    else:
        path = Path(lockfile)
    if check and path is not None and path.is_file():
        try:
            find_lock_entry(read_lockfile(path), repo_id, version=version, revision=revision)
        except KernelLockError as e:
            raise KernelLockError(f"{func}: {e}") from None
    return path


def _lock_path(lockfile: str | Path | None) -> Path:
    """`lockfile`, else `KERNELHUB_LOCKFILE`, else the calling package's shipped lock (as `kernels`),
    else `./kernels.lock`."""
    if lockfile is not None:
        return Path(lockfile)
    if os.environ.get("KERNELHUB_LOCKFILE"):
        return Path(os.environ["KERNELHUB_LOCKFILE"])
    return _caller_distribution_lock() or Path(DEFAULT_LOCKFILE)


def _walk(variant_dir: Path, blobs: Path | None) -> tuple[dict[str, Path], set[str]]:
    """({repo path: file}, {repo path of every directory}) of a variant, links not followed.

    The only link allowed is the Hugging Face cache's own: a file pointing at a regular file in
    that repository's `blobs/`. A linked directory, a link elsewhere, a device or a FIFO is refused
    (a planted `ops/` link beside a locked `ops.py` was imported as the package `ops`). Bytecode in
    `__pycache__/` is not content: kernel modules are compiled from source only (`_loader`).
    """
    prefix = f"build/{variant_dir.name}"
    real_blobs = os.path.realpath(blobs) if blobs is not None else None
    files: dict[str, Path] = {}
    dirs: set[str] = set()

    def refuse(path: Path, what: str) -> KernelLockError:
        return KernelLockError(f"{prefix}/{path.relative_to(variant_dir).as_posix()} is {what}; refusing to load")

    def visit(directory: Path) -> None:
        with os.scandir(directory) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                path = Path(entry.path)
                name = f"{prefix}/{path.relative_to(variant_dir).as_posix()}"
                if entry.is_symlink():
                    real = os.path.realpath(path)
                    in_blobs = real_blobs is not None and os.path.dirname(real) == real_blobs
                    if not (in_blobs and stat.S_ISREG(os.lstat(real).st_mode)):
                        raise refuse(path, f"a link to {real} (only the cache's own links into blobs/ are allowed)")
                    files[name] = path
                elif entry.is_dir(follow_symlinks=False):
                    if entry.name == "__pycache__":
                        bad = [e for e in os.scandir(path) if not (e.is_file(follow_symlinks=False)
                                                                   and e.name.endswith(".pyc"))]
                        if bad:
                            raise refuse(Path(bad[0].path), "not a bytecode file in __pycache__/")
                        continue
                    dirs.add(name)
                    visit(path)
                elif entry.is_file(follow_symlinks=False):
                    files[name] = path
                else:
                    raise refuse(path, "neither a file nor a directory")

    visit(variant_dir)
    return files, dirs


def _variant_files(variant_dir: Path, blobs: Path | None = None) -> dict[str, Path]:
    """Files of a variant keyed by repo path (`build/<variant>/...`); see `_walk` for what is refused."""
    return _walk(variant_dir, blobs)[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def hash_variant(variant_dir: Path, *, blobs: Path | None = None) -> dict[str, str]:
    """{repo path: sha256} for every file of a downloaded variant directory."""
    return {name: _sha256(p) for name, p in _variant_files(Path(variant_dir), blobs).items()}


def verify_variant(variant_dir: Path, expected: dict[str, str], *, where: str, blobs: Path | None = None) -> None:
    """Raise KernelLockError naming the first file that is missing, changed, or not in the lock, or
    the first directory that holds no locked file (nothing unlisted may sit where imports look)."""
    try:
        actual, dirs = _walk(Path(variant_dir), blobs)
    except KernelLockError as e:
        raise KernelLockError(f"{where}: {e}") from None
    for name, digest in sorted(expected.items()):
        if name not in actual:
            raise KernelLockError(f"{where}: locked file {name} is missing from the download")
        got = _sha256(actual[name])
        if got != digest:
            raise KernelLockError(f"{where}: sha256 of {name} is {got}, the lock says {digest}; refusing to load")
    extra = sorted(set(actual) - set(expected))
    if extra:
        raise KernelLockError(f"{where}: file {extra[0]} is not in the lock; refusing to load")
    needed = {name.rsplit("/", i)[0] for name in expected for i in range(1, name.count("/"))}
    empty = sorted(dirs - needed)
    if empty:
        raise KernelLockError(f"{where}: directory {empty[0]} holds no locked file; refusing to load")


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
        target = fetch_variant(repo_id, repo_type, ref, commit, variant)
        hashes[variant] = hash_variant(target, blobs=_storage(repo_id, repo_type) / "blobs")
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
    """Write `path` in the `kernels` 0.17 format and kernelhub's per-file sha256 beside it
    (`<path>.sha256`); returns `path`. Each file is replaced atomically."""
    path = Path(path)
    entries = sorted(entries, key=lambda e: (e["repo_id"], e.get("version") or 0, e.get("revision") or ""))
    for target, text in ((sidecar_path(path), dump_sidecar(entries)), (path, dump_kernels_lock(entries))):
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, target)
    return path


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise KernelLockError(f"read_lockfile: {path} is not UTF-8 text: {e}") from e
    except (json.JSONDecodeError, RecursionError) as e:
        raise KernelLockError(f"read_lockfile: {path} is not valid JSON: {e}") from e
    except OSError as e:
        raise KernelLockError(f"read_lockfile: cannot read {path}: {e}") from e


def _parse(path: Path) -> tuple[str, list[dict]]:
    try:
        fmt, entries = parse_lock(_read_json(path))
    except ValueError as e:
        if isinstance(e, KernelLockError):
            raise
        raise KernelLockError(f"read_lockfile: {path}: {e}") from None
    for i, e in enumerate(entries):
        problem = _entry_problem(e, per_file=fmt == "kernelhub")
        if problem is not None:
            raise KernelLockError(f"read_lockfile: {path}: entry {i} ({e.get('repo_id')!r}): {problem}")
    return fmt, entries


def read_lockfile(lockfile: str | Path | None = None) -> list[dict]:
    """The entries of a lock file in any format kernelhub reads (see `_lockformat`).

    A `kernels`-format lock takes the per-file sha256 (and the version/revision kernelhub asked for)
    from `<lockfile>.sha256` where that file has an entry of the same repository and commit; the lock
    itself decides which kernels and commits are locked (matched by repository, commit and the
    version or revision `kernels` records).
    """
    path = _lock_path(lockfile)
    if not path.is_file():
        raise KernelLockError(f"read_lockfile: lock file {path} does not exist (create it with `kernelhub lock`)")
    fmt, entries = _parse(path)
    side = sidecar_path(path)
    if fmt == "kernels" and side.is_file():
        _side_fmt, extra = _parse(side)
        by_key = {dependency_key(e): e for e in extra}
        entries = [
            {**by_key[dependency_key(e)], "variant_hashes": e["variant_hashes"]} if dependency_key(e) in by_key else e
            for e in entries
        ]
    return entries


def _entry_problem(e: dict, *, per_file: bool = True) -> str | None:
    """What is malformed in one lock entry (types of the fields loading relies on), or None."""
    for key in ("repo_id", "repo_type"):
        if not isinstance(e[key], str) or not e[key]:
            return f"`{key}` must be a non-empty string, got {e[key]!r}"
    try:
        check_repo_id("read_lockfile", e["repo_id"])
    except ValueError as err:
        return str(err)
    if e["repo_type"] not in ("kernel", "model"):
        return f"`repo_type` must be 'kernel' or 'model', got {e['repo_type']!r}"
    if not isinstance(e["commit"], str) or not re.fullmatch(r"[0-9a-f]{40}", e["commit"]):
        return f"`commit` must be a full 40-hex-digit commit hash, got {e['commit']!r}"
    variants = e["variants"]
    if not isinstance(variants, dict) or (per_file and not variants):
        return f"`variants` must map variant names to file hashes, got {variants!r}"
    for name, files in variants.items():
        if not VARIANT_NAME_RE.match(name):
            return f"`variants` has {name!r}, which is not a build variant directory name"
        if not isinstance(files, dict) or not all(
            isinstance(f, str) and isinstance(h, str) and re.fullmatch(r"[0-9a-f]{64}", h) for f, h in files.items()
        ):
            return f"`variants.{name}` must map file paths to sha256 hex digests"
        for f in files:
            parts = f.split("/")
            if parts[:2] != ["build", name] or len(parts) < 3 or any(p in ("", ".", "..") for p in parts):
                return f"`variants.{name}` lists {f!r}, which is not a plain path under build/{name}/"
    for key in ("version", "revision", "ref"):
        value = e.get(key)
        if key == "version" and value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return f"`version` must be an int or null, got {value!r}"
        if key != "version" and value is not None and not isinstance(value, str):
            return f"`{key}` must be a string or null, got {value!r}"
        if key != "version" and value is not None:
            try:
                check_revision("read_lockfile", value)
            except (TypeError, ValueError) as err:
                return f"`{key}`: {err}"
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
        raise KernelLockError(  # "is not locked": the phrase `kernels` raises
            f"Kernel `{repo_id}` is not locked: lock has no entry for {repo_id!r} (version={version}, "
            f"revision={revision}); locked: {have}. Lock it with `kernelhub lock` (or `kernels lock <project>`)."
        )
    if len(found) > 1:
        refs = [(e.get("version"), e.get("revision")) for e in found]
        raise KernelLockError(f"lock has {len(found)} entries for {repo_id!r} {refs}: pass version= or revision=")
    return found[0]


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def kernels_variant_hash(variant_dir: Path, *, blobs: Path | None = None) -> str:
    """The `git_lfs_concat` hash older `kernels` locks record per variant, computed from the files.

    sha256 over the files sorted by (path inside the variant, hash): each path's UTF-8 bytes, then
    its hash's bytes, where the hash is the file's sha256 for a Git LFS file and its git blob id
    otherwise. A cached file is LFS when its blob (the cache names blobs by ETag) is a 64-hex name;
    the hash itself is always computed from the bytes on disk.
    """
    variant_dir = Path(variant_dir)
    prefix = f"build/{variant_dir.name}/"
    parts = []
    for name, path in _variant_files(variant_dir, blobs).items():
        data = path.read_bytes()
        lfs = path.is_symlink() and re.fullmatch(r"[0-9a-f]{64}", Path(os.path.realpath(path)).name)
        digest = hashlib.sha256(data).hexdigest() if lfs else _git_blob_sha1(data)
        parts.append((name.removeprefix(prefix).encode("utf-8"), digest))
    m = hashlib.sha256()
    for rel, digest in sorted(parts):
        m.update(rel)
        m.update(bytes.fromhex(digest))
    return f"sha256-{m.hexdigest()}"


def _verified_files(entry: dict, variant: str, target: Path, blobs: Path, where: str) -> dict[str, str]:
    """{repo path: sha256} of the files a locked load may import, after checking them as far as the
    lock allows: per file (kernelhub's hashes), per variant (an older `kernels` lock's hash), or, for a
    lock that pins only the commit (`kernels` 0.17), the commit's files as downloaded (no links,
    nothing else imported)."""
    files = entry["variants"].get(variant)
    if files:
        verify_variant(target, files, where=where, blobs=blobs)
        return files
    try:
        current = hash_variant(target, blobs=blobs)
    except KernelLockError as e:
        raise KernelLockError(f"{where}: {e}") from None
    locked = entry.get("variant_hashes", {}).get(variant)
    if locked is not None:
        got = kernels_variant_hash(target, blobs=blobs)
        if got != locked["hash"]:
            raise KernelLockError(
                f"{where}: the {locked['hash_type']} hash of build/{variant}/ is {got}, the lock says "
                f"{locked['hash']}; refusing to load"
            )
    return current


def get_locked_kernel(
    repo_id: str,
    *,
    lockfile: str | Path | None = None,
    version: int | None = None,
    revision: str | None = None,
    backend: str | None = None,
    trust_remote_code: bool | list[str] | None = None,
    user_agent: str | dict | None = None,
    local_only: bool = False,
) -> ModuleType:
    """Import the locked commit of `repo_id` after checking its files against the lock.

    A lock is the review of that exact code, so no publisher trust is needed (`trust_remote_code`
    and `user_agent` are accepted as `kernels` takes them). `backend`: load the variant for "cpu" or
    for torch's own backend. `local_only`: never download (what `load_kernel` does).
    """
    from kernelhub.hub import _import_resolved

    system = system_for_backend("get_locked_kernel", backend)
    path = _lock_path(lockfile)
    if lockfile is None and not path.is_file():  # the phrase `kernels` raises, then where kernelhub looked
        raise KernelLockError(
            f"get_locked_kernel: Could not find a `kernels.lock` file in the caller's package metadata, nor {path} "
            "(KERNELHUB_LOCKFILE or ./kernels.lock). Lock kernels with `kernelhub lock` (or `kernels lock <project>`)."
        )
    entry = find_lock_entry(read_lockfile(path), repo_id, version=version, revision=revision)
    commit, repo_type = entry["commit"], entry["repo_type"]
    with user_agent_scope(user_agent):
        names = sorted(set(entry["variants"]) | set(entry.get("variant_hashes", {})))
        if not names:  # the lock pins the commit only: its variants, from the Hub or the cache
            names = list_variants(repo_id, revision=commit, repo_type=repo_type, local_only=local_only)[2]
        variant = choose_variant(repo_id, commit, names, system)
        ref = f"v{entry['version']}" if entry.get("version") else (entry.get("revision") or commit)
        # no ref update: the lock pins the commit
        target = fetch_variant(repo_id, repo_type, commit, commit, variant, local_only=local_only)
    where = f"get_locked_kernel({repo_id!r}, lockfile={str(path)!r})"
    files = _verified_files(entry, variant, target, _storage(repo_id, repo_type) / "blobs", where)
    prefix = f"build/{variant}/"
    verified = {name.removeprefix(prefix): digest for name, digest in files.items()}
    return _import_resolved(ResolvedKernel(repo_id, repo_type, ref, commit, variant, target), verified=verified)


def download_locked(
    lockfile: str | Path | None = None, *, all_variants: bool = False, backend: str | None = None
) -> list[Path]:
    """Download every kernel of a lock at its locked commit and check it against the lock, as
    `kernels download` does; returns the variant directories. Only the variant this system (or
    `backend`) loads, or with `all_variants` every locked variant (every variant of the commit for a
    lock that pins only commits). Nothing is imported, so no publisher trust is needed."""
    system = None if all_variants else system_for_backend("download_locked", backend)
    path = _lock_path(lockfile)
    out = []
    for entry in read_lockfile(path):
        repo_id, commit, repo_type = entry["repo_id"], entry["commit"], entry["repo_type"]
        names = sorted(set(entry["variants"]) | set(entry.get("variant_hashes", {})))
        if not names:
            names = list_variants(repo_id, revision=commit, repo_type=repo_type)[2]
        wanted = names if all_variants else [choose_variant(repo_id, commit, names, system)]
        where = f"download_locked({repo_id!r}, lockfile={str(path)!r})"
        for variant in wanted:
            target = fetch_variant(repo_id, repo_type, commit, commit, variant)
            _verified_files(entry, variant, target, _storage(repo_id, repo_type) / "blobs", f"{where} {variant}")
            out.append(target)
    return out
