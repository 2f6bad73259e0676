"""Whose Hub code may be imported: the trust decision of `get_kernel` and the repositories.

As Hugging Face `kernels` 0.17: refused unless trusted; trusted are `trust_remote_code=True` (or a
list of repository ids), the local list of publishers, and, online, a publisher the Hub marks
`trustedKernelPublisher`. Locked kernels never come here: the lock is the review of that code.
"""

from __future__ import annotations

import os

from kernelhub._env import env_flag
from kernelhub._fetch import endpoint, offline
from kernelhub.errors import UntrustedKernelError, UntrustedKernelWarning  # re-exported: their earlier home

__all__ = [
    "DEFAULT_TRUSTED_PUBLISHERS",
    "UntrustedKernelError",
    "UntrustedKernelWarning",
    "trusted_publishers",
]

DEFAULT_TRUSTED_PUBLISHERS = ("kernels-community",)


_TRUSTED_BY_HUB: dict[tuple[str, str], bool] = {}  # (endpoint, publisher) -> the Hub's answer


def trusted_publishers() -> frozenset[str]:
    """Publishers whose Hub kernels are imported without `trust_remote_code`, known without asking the Hub.

    `kernels-community` plus the comma-separated `KERNELHUB_TRUSTED_PUBLISHERS` (read at call time).
    Online, a publisher the Hub marks `trustedKernelPublisher` is trusted too (as in `kernels`).
    """
    extra = os.environ.get("KERNELHUB_TRUSTED_PUBLISHERS", "")
    return frozenset(DEFAULT_TRUSTED_PUBLISHERS) | {p.strip() for p in extra.split(",") if p.strip()}


def _check_trust_arg(func: str, trust_remote_code: object) -> None:
    ok = trust_remote_code is None or isinstance(trust_remote_code, bool) or (
        isinstance(trust_remote_code, list) and all(isinstance(r, str) for r in trust_remote_code))
    if not ok:  # ("false" would trust)
        raise TypeError(
            f"{func}: `trust_remote_code` must be a bool or a list of repository ids, got {trust_remote_code!r}"
        )


def _hub_trusts(publisher: str) -> bool:
    """Whether the Hub marks the publisher `trustedKernelPublisher` (its organization overview), as
    `kernels` asks; remembered per process and endpoint. Not reachable: a refusal naming why."""
    key = (endpoint(), publisher)
    if key not in _TRUSTED_BY_HUB:
        from kernelhub._fetch import api

        try:
            info = api().get_organization_overview(publisher)
        except Exception as e:
            raise UntrustedKernelError(
                f"Kernel repository of publisher {publisher!r} could not verify publisher trust status "
                f"({type(e).__name__}: {e}). Set trust_remote_code=True or add the repository ID to the "
                "trust_remote_code allowlist to allow loading kernels from untrusted sources."
            ) from e
        _TRUSTED_BY_HUB[key] = getattr(info, "trustedKernelPublisher", False) is True
    return _TRUSTED_BY_HUB[key]


def _check_trust(repo_id: str, trust_remote_code: bool | list[str] | None) -> None:
    """Refuse Hub code that is not trusted, before anything is downloaded (as `kernels` 0.17).

    Trusted: `trust_remote_code=True`, a list holding `repo_id`, a publisher in
    `trusted_publishers()`, or (online) one the Hub marks `trustedKernelPublisher`. Offline the Hub
    cannot be asked, so only the first three count. Locked kernels do not come through here: the
    lock is the review of that exact code.
    """
    if trust_remote_code is True or (isinstance(trust_remote_code, list) and repo_id in trust_remote_code):
        return
    publisher = repo_id.split("/", 1)[0]
    trusted = trusted_publishers()
    if publisher in trusted:
        return
    strict = env_flag("KERNELHUB_REQUIRE_TRUSTED")  # only the local list: the Hub's flag is not asked
    if not strict and not offline() and _hub_trusts(publisher):
        return
    where = ("KERNELHUB_REQUIRE_TRUSTED is set, so the Hub is not asked; " if strict
             else "offline, so the Hub cannot vouch for it; " if offline() else "")
    raise UntrustedKernelError(
        f"Kernel repository '{repo_id}' is not from a trusted publisher ({where}publisher {publisher!r}; "
        f"trusted: {sorted(trusted)}). Set trust_remote_code=True or add the repository ID to the "
        "trust_remote_code allowlist to allow loading kernels from untrusted sources; or add the publisher "
        "to KERNELHUB_TRUSTED_PUBLISHERS (`trusted_publishers` in the kernelhub config), or load it "
        "through a lock file."
    )
