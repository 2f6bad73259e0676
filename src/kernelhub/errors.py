"""kernelhub's public exceptions and warnings, in one module that imports nothing else of kernelhub.

Catch them from here (`from kernelhub.errors import KernelHubError`) without importing the parts
that raise them; the modules that raise them re-export them under their earlier import paths.
Each also derives from the builtin a caller would catch without knowing kernelhub
(`LookupError`, `ValueError`, `PermissionError`, ...).
"""

from __future__ import annotations

from huggingface_hub.errors import HfHubHTTPError

__all__ = [
    "AllocationSymmetryError",
    "ConfigError",
    "HubKernelNotFoundError",
    "KernelHubError",
    "KernelLockError",
    "KernelNotFoundError",
    "KernelVariantNotFoundError",
    "KernelVersionNotFoundError",
    "SymmetricHeapFullError",
    "UntrustedKernelError",
    "UntrustedKernelWarning",
]


class KernelHubError(Exception):
    """Base of kernelhub's Hub errors."""


class KernelNotFoundError(KernelHubError, LookupError):
    """The repository or revision does not exist (or is not reachable and not cached)."""


class HubKernelNotFoundError(KernelNotFoundError, HfHubHTTPError):
    """The Hub answered that the repository or revision does not exist: also the `HfHubHTTPError`
    that code written for Hugging Face `kernels` catches there."""

    def __init__(self, message: str, *, response) -> None:
        HfHubHTTPError.__init__(self, message, response=response)


class KernelVersionNotFoundError(KernelNotFoundError, ValueError):
    """The repository has no branch `vN` for the requested version (a ValueError, as `kernels` raises)."""


class KernelVariantNotFoundError(KernelNotFoundError):
    """The revision has no build variant this system can run."""


class KernelLockError(KernelHubError, ValueError):
    """The lock file is missing, malformed, has no entry for a kernel, or a file's hash differs."""


class UntrustedKernelError(KernelHubError, PermissionError, ValueError):
    """Hub code from a publisher that is not trusted, refused (a ValueError, as Hugging Face `kernels`
    raises, whose message it shares: "is not from a trusted publisher"; docs/security.md)."""


class UntrustedKernelWarning(UserWarning):
    """Kept for code that filters it: untrusted Hub code is now refused, never imported with a warning."""


class ConfigError(ValueError):
    """An invalid kernelhub config; the message names the key and what is allowed."""


class AllocationSymmetryError(RuntimeError):
    """Ranks allocated different things from a SymmetricHeap: peer views would be wrong."""


class SymmetricHeapFullError(MemoryError):
    """An allocation does not fit in the heap."""
