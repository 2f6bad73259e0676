"""Resolve a kernel on the Hub to (commit, build variant) and download just that variant.

Everything that talks to `huggingface_hub` lives here. Settings are read at call time, not import
time, so `HF_ENDPOINT`, `HF_HUB_CACHE`/`HF_HOME`, `HF_HUB_OFFLINE` and `KERNELHUB_*` set after import
(tests, notebooks) take effect.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kernelhub._env import env_flag
from kernelhub.errors import (  # re-exported: their earlier import path
    HubKernelNotFoundError,
    KernelHubError,
    KernelNotFoundError,
    KernelVariantNotFoundError,
    KernelVersionNotFoundError,
)
from kernelhub.variants import SystemInfo, rank_variants

logger = logging.getLogger("kernelhub.hub")

__all__ = [
    "KernelHubError",
    "KernelNotFoundError",
    "KernelVariantNotFoundError",
    "KernelVersionNotFoundError",
    "ResolvedKernel",
    "cache_dir",
    "check_repo_id",
    "check_revision",
    "current_user_agent",
    "choose_variant",
    "default_repo_type",
    "endpoint",
    "list_variants",
    "offline",
    "resolve_kernel",
    "user_agent_scope",
]

_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_VERSION_BRANCH_RE = re.compile(r"^v([1-9]\d*)$")  # v1, v2, ...: not "v01", which is no "vN" of a version N


@dataclass(frozen=True)
class ResolvedKernel:
    """Where a kernel request landed: the exact commit and the build variant chosen for this system."""

    repo_id: str
    repo_type: str
    ref: str  # what was asked for: "v1", "main", a tag, or a commit
    commit: str
    variant: str
    path: Path  # build/<variant> inside the cached snapshot


def endpoint() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def cache_dir() -> Path:
    """KERNELHUB_CACHE, else the Hugging Face hub cache (HF_HUB_CACHE, HF_HOME/hub)."""
    from huggingface_hub import constants

    for var, suffix in (("KERNELHUB_CACHE", ""), ("HF_HUB_CACHE", ""), ("HF_HOME", "hub")):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser() / suffix
    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    return env_flag("HF_HUB_OFFLINE", default=bool(constants.HF_HUB_OFFLINE))


def default_repo_type() -> str:
    """The Hub's `kernel` repository type where this huggingface_hub supports it, else `model`."""
    from huggingface_hub import constants

    wanted = os.environ.get("KERNELHUB_REPO_TYPE")
    supported = getattr(constants, "REPO_TYPES_WITH_KERNEL", constants.REPO_TYPES)
    if wanted:
        if wanted not in supported:
            raise ValueError(
                f"KERNELHUB_REPO_TYPE must be one of {[t for t in supported if t]}, got {wanted!r}"
            )
        return wanted
    return "kernel" if "kernel" in supported else "model"


_USER_AGENT: contextvars.ContextVar[str | dict | None] = contextvars.ContextVar("kernelhub_user_agent", default=None)


@contextlib.contextmanager
def user_agent_scope(user_agent: str | dict | None) -> Iterator[None]:
    """Add `user_agent` (as `kernels` takes it: a str or a dict of name -> version) to the Hub
    requests made inside the block."""
    if user_agent is not None and not isinstance(user_agent, (str, dict)):
        raise TypeError(f"`user_agent` must be a str, a dict or None, got {type(user_agent).__name__}")
    parts = [user_agent] if isinstance(user_agent, str) else [str(x) for kv in (user_agent or {}).items() for x in kv]
    if any(re.search(r"[\x00-\x1f\x7f]", p) for p in parts):  # a header value: no line breaks smuggled in
        raise ValueError(f"`user_agent` must not contain control characters, got {user_agent!r}")
    token = _USER_AGENT.set(user_agent)
    try:
        yield
    finally:
        _USER_AGENT.reset(token)


def current_user_agent() -> str | dict | None:
    return _USER_AGENT.get()


def api():
    from huggingface_hub import HfApi

    guard_hub_session()
    return HfApi(endpoint=endpoint(), library_name="kernelhub", user_agent=_USER_AGENT.get())


_SAFE_ETAG_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*$")


def _check_hub_headers(response) -> None:
    """Refuse a response whose headers huggingface_hub would turn into cache paths unchecked: the
    ETag names the blob file (`blobs/<etag>`), the commit names the snapshot directory."""
    etag = response.headers.get("X-Linked-Etag") or response.headers.get("ETag")
    if etag is not None:
        name = etag.removeprefix("W/").strip('"')
        if name and not _SAFE_ETAG_RE.match(name):
            raise KernelHubError(
                f"the Hub at {response.request.url.host} sent ETag {etag!r}, which is no blob name "
                "(huggingface_hub would write the file outside the cache); refusing the download"
            )
    commit = response.headers.get("X-Repo-Commit")
    if commit is not None and not _COMMIT_RE.match(commit):
        raise KernelHubError(
            f"the Hub at {response.request.url.host} sent commit id {commit!r}, which is not 40 hex digits; "
            "refusing the download"
        )


def guard_hub_session() -> None:
    """Add `_check_hub_headers` to huggingface_hub's shared HTTP client (once per client; a client
    made by a new `set_client_factory` gets it at kernelhub's next Hub call). It refuses only values
    that would escape the cache, so the rest of the process's Hub traffic is unaffected."""
    from huggingface_hub.utils import get_session

    hooks = get_session().event_hooks.setdefault("response", [])
    if _check_hub_headers not in hooks:
        hooks.append(_check_hub_headers)


def check_commit(repo_id: str, commit: object, what: str) -> str:
    """A commit id the Hub sent: exactly 40 lowercase hex digits (it names a cache directory)."""
    if not isinstance(commit, str) or not _COMMIT_RE.match(commit):
        raise KernelHubError(
            f"the Hub at {endpoint()} sent {what} {commit!r} for kernel repository {repo_id!r}, which is "
            "not a 40-hex-digit commit id; refusing it"
        )
    return commit


def _storage(repo_id: str, repo_type: str) -> Path:
    from huggingface_hub.file_download import repo_folder_name

    return cache_dir() / repo_folder_name(repo_id=repo_id, repo_type=repo_type)


def _versions(branches) -> list[int]:
    return sorted(int(m.group(1)) for b in branches if (m := _VERSION_BRANCH_RE.match(b)))


def _transport_errors() -> tuple[type[Exception], ...]:
    """The "could not connect" errors of whichever HTTP client this huggingface_hub uses (httpx2
    for 2.x, httpx for 1.x, requests before)."""
    import importlib

    found: list[type[Exception]] = []
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "ConnectionError")):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


@contextlib.contextmanager
def _hub_errors(repo_id: str, repo_type: str, revision: str | None) -> Iterator[None]:
    """Turn the Hub client's missing-repo/revision errors into ours, naming what was asked for."""
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except _transport_errors() as e:
        raise KernelHubError(
            f"could not reach the Hub at {endpoint()} for kernel repository {repo_id!r}: {e} "
            "(HF_HUB_OFFLINE=1 loads what the local cache holds)"
        ) from e
    except RepositoryNotFoundError as e:
        raise HubKernelNotFoundError(
            f"kernel repository {repo_id!r} ({repo_type}) not found on {endpoint()}", response=e.response
        ) from e
    except RevisionNotFoundError as e:
        raise HubKernelNotFoundError(
            f"kernel repository {repo_id!r} has no revision {revision!r}", response=e.response
        ) from e
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        # a server error, a failed or truncated download (OSError: "Consistency check failed"), a
        # file name huggingface_hub refused to place (ValueError: "Invalid pointer path")
        raise KernelHubError(
            f"the Hub at {endpoint()} failed for kernel repository {repo_id!r} (revision {revision!r}): "
            f"{type(e).__name__}: {e}"
        ) from e


def _resolve_online(
    repo_id: str, repo_type: str, revision: str | None, version: int | None
) -> tuple[str, str]:
    """(ref, commit) from the Hub."""
    hub = api()
    with _hub_errors(repo_id, repo_type, revision):
        if revision is not None and _COMMIT_RE.match(revision):
            return revision, revision
        if revision is not None:
            sha = hub.repo_info(repo_id, repo_type=repo_type, revision=revision).sha
            return revision, check_commit(repo_id, sha, f"the commit of {revision!r}")
        refs = hub.list_repo_refs(repo_id, repo_type=repo_type)
    branches = {b.name: b.target_commit for b in refs.branches}
    versions = _versions(branches)
    if version is None:  # neither given: the newest published version, else main
        ref = f"v{versions[-1]}" if versions else "main"
        return ref, check_commit(repo_id, branches.get(ref), f"the commit of branch {ref!r}")
    ref = f"v{version}"
    if ref not in branches:
        raise KernelVersionNotFoundError(  # the phrase `kernels` users match on, then kernelhub's detail
            f"Version {version} not found, available versions: {', '.join(map(str, versions))} "
            f"(kernel repository {repo_id!r} has no branch {ref!r})"
        )
    if versions and versions[-1] > version:
        logger.warning(  # Hugging Face `kernels`' wording, on every resolution as `kernels` logs it
            "You are using version %d of '%s', but version %d is available.", version, repo_id, versions[-1]
        )
    return ref, check_commit(repo_id, branches[ref], f"the commit of branch {ref!r}")


def _resolve_cached(
    repo_id: str, repo_type: str, revision: str | None, version: int | None
) -> tuple[str, str]:
    """(ref, commit) from the local cache only (offline)."""
    storage = _storage(repo_id, repo_type)
    if revision is not None and _COMMIT_RE.match(revision):
        return revision, revision
    refs_dir = storage / "refs"
    if revision is not None:
        ref = revision
    elif version is not None:
        ref = f"v{version}"
    else:
        cached = _versions(p.name for p in refs_dir.iterdir()) if refs_dir.is_dir() else []
        ref = f"v{cached[-1]}" if cached else "main"
    ref_file = inside(refs_dir, refs_dir / ref, f"kernel {repo_id!r}: the cached ref of {ref!r}")
    if not ref_file.is_file():
        raise KernelNotFoundError(
            f"offline (HF_HUB_OFFLINE=1) and kernel {repo_id!r} at {ref!r} is not in the cache "
            f"{cache_dir()}; "
            "download it once online (`kernelhub download`)"
        )
    commit = ref_file.read_text(errors="replace").strip()
    if not _COMMIT_RE.match(commit):
        raise KernelHubError(
            f"the cached ref {ref_file} of kernel {repo_id!r} holds {commit[:80]!r}, not a 40-hex-digit commit id"
        )
    return ref, commit


def _variants_online(repo_id: str, repo_type: str, commit: str) -> list[str]:
    from huggingface_hub.errors import EntryNotFoundError
    from huggingface_hub.hf_api import RepoFolder

    with _hub_errors(repo_id, repo_type, commit):
        try:
            tree = api().list_repo_tree(repo_id, path_in_repo="build", revision=commit, repo_type=repo_type)
            folders = [item.path for item in tree if isinstance(item, RepoFolder)]
        except EntryNotFoundError:
            return []
    names = []
    for path in folders:  # each names a cache directory: one plain component under build/
        name = path.removeprefix("build/")
        if path != f"build/{name}" or not VARIANT_NAME_RE.match(name):
            raise KernelHubError(
                f"the Hub at {endpoint()} listed {path!r} under build/ of kernel {repo_id!r} at {commit[:12]}, "
                "which is not a build variant directory; refusing it"
            )
        names.append(name)
    return sorted(names)


VARIANT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")  # one path component; never "." or ".."


_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_BAD_REF_CHARS = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")


def check_revision(func: str, revision: object) -> str:
    """A branch, tag or commit as git allows one to be named (`git check-ref-format`), checked
    before any I/O: the revision names a file under the cache's `refs/`, so "../x" must never reach a
    path join, online or offline."""
    if not isinstance(revision, str) or not revision:
        raise TypeError(f"{func}: `revision` must be a non-empty str, got {revision!r}")
    parts = revision.split("/")
    problem = None
    if _BAD_REF_CHARS.search(revision):
        problem = "a control character, space or one of ~^:?*[\\"
    elif ".." in revision or "@{" in revision or revision == "@":
        problem = "'..', '@{' or is '@'"
    elif any(not p or p.startswith(".") or p.endswith(".lock") for p in parts) or revision.endswith("."):
        problem = "an empty path component, one starting with '.' or ending with '.lock' or '.'"
    elif len(revision) > 255:
        problem = "more than 255 characters"
    if problem is not None:
        raise ValueError(f"{func}: `revision` {revision!r} is not a valid git revision (it contains {problem})")
    return revision


def inside(root: Path, path: Path, what: str) -> Path:
    """`path`, after resolving links and '..', if it lies under `root`; else KernelHubError.

    Every cache path built from something a caller or the Hub sent (a ref, a commit, a variant or
    file name) goes through here before it is read or written."""
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(path))
    if real != real_root and real_root not in real.parents:
        raise KernelHubError(f"{what} {path} resolves to {real}, outside {real_root}; refusing it")
    return path


def check_repo_id(func: str, repo_id: object) -> str:
    """A Hub id "org/name", checked before any request (a bad one would come back as a 404)."""
    if not isinstance(repo_id, str) or not _REPO_ID_RE.match(repo_id):
        raise ValueError(f"{func}: `repo_id` must look like 'org/name', got {repo_id!r}")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:  # the Hub's own rules too ("--", "..", a trailing "." or "-", ".git", length)
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ValueError(f"{func}: `repo_id` {repo_id!r} is not a valid Hub id: {e}") from e
    return repo_id


def list_variants(
    repo_id: str,
    *,
    revision: str | None = None,
    version: int | None = None,
    repo_type: str | None = None,
    local_only: bool = False,
) -> tuple[str, str, list[str]]:
    """(ref, commit, variant names) of a kernel revision, from the Hub or (offline, or `local_only`)
    the cache."""
    check_repo_id("list_variants", repo_id)
    if revision is not None:
        check_revision("list_variants", revision)
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise TypeError(f"list_variants: `version` must be an int (branch vN), got {version!r}")
    repo_type = repo_type or default_repo_type()
    if local_only or offline():
        ref, commit = _resolve_cached(repo_id, repo_type, revision, version)
        snapshot = _storage(repo_id, repo_type) / "snapshots" / commit
        if not snapshot.is_dir():
            raise KernelNotFoundError(
                f"offline and kernel {repo_id!r} at {commit[:12]} ({ref}) is not cached (HF_HUB_OFFLINE is set)"
            )
        build = snapshot / "build"
        return ref, commit, sorted(p.name for p in build.iterdir() if p.is_dir()) if build.is_dir() else []
    ref, commit = _resolve_online(repo_id, repo_type, revision, version)
    return ref, commit, _variants_online(repo_id, repo_type, commit)


def choose_variant(repo_id: str, commit: str, names: list[str], system: SystemInfo | None = None) -> str:
    system = system or SystemInfo.current()
    usable, rejected = rank_variants(names, system)
    if not usable:
        why = "; ".join(f"{n}: {r}" for n, r in rejected.items()) or "the revision has no build/ variants"
        raise KernelVariantNotFoundError(
            f"kernel {repo_id!r} at {commit[:12]} has no build variant for this system "
            f"({system.describe()}): {why}"
        )
    return usable[0]


def resolve_kernel(
    repo_id: str,
    *,
    revision: str | None = None,
    version: int | None = None,
    repo_type: str | None = None,
    variant: str | None = None,
    system: SystemInfo | None = None,
) -> ResolvedKernel:
    """Find the commit and the best variant for this system, download that variant, return where it is."""
    repo_type = repo_type or default_repo_type()
    ref, commit, names = list_variants(repo_id, revision=revision, version=version, repo_type=repo_type)
    if variant is None:
        variant = choose_variant(repo_id, commit, names, system)
    elif variant not in names:
        raise KernelVariantNotFoundError(
            f"kernel {repo_id!r} at {commit[:12]} has no variant {variant!r}: {names}"
        )
    from kernelhub._download import fetch_variant

    path = fetch_variant(repo_id, repo_type, ref, commit, variant)
    return ResolvedKernel(repo_id, repo_type, ref, commit, variant, path)
