"""`kernelhub.errors`: the one home of kernelhub's public exceptions; earlier import paths still work."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import kernelhub
import kernelhub.errors as errors

EARLIER_PATHS = {
    "KernelHubError": ["kernelhub._fetch", "kernelhub.hub"],
    "KernelNotFoundError": ["kernelhub._fetch", "kernelhub.hub"],
    "HubKernelNotFoundError": ["kernelhub._fetch"],
    "KernelVersionNotFoundError": ["kernelhub._fetch", "kernelhub.hub"],
    "KernelVariantNotFoundError": ["kernelhub._fetch", "kernelhub.hub"],
    "KernelLockError": ["kernelhub.lock"],
    "UntrustedKernelError": ["kernelhub.hub"],
    "UntrustedKernelWarning": ["kernelhub.hub"],
    "ConfigError": ["kernelhub.config"],
    "AllocationSymmetryError": ["kernelhub.distributed.symmetric_heap", "kernelhub.distributed"],
    "SymmetricHeapFullError": ["kernelhub.distributed.symmetric_heap", "kernelhub.distributed"],
}


def test_every_public_exception_is_in_errors_and_exported_by_the_package():
    assert sorted(errors.__all__) == sorted(EARLIER_PATHS)
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert cls.__module__ == "kernelhub.errors"
        assert getattr(kernelhub, name) is cls and name in kernelhub.__all__


def test_earlier_import_paths_give_the_same_classes():
    for name, modules in EARLIER_PATHS.items():
        for module in modules:
            assert getattr(importlib.import_module(module), name) is getattr(errors, name), (module, name)


def test_hierarchy_is_unchanged():
    assert issubclass(errors.KernelVersionNotFoundError, errors.KernelNotFoundError)
    assert issubclass(errors.KernelVariantNotFoundError, LookupError)
    assert issubclass(errors.KernelLockError, errors.KernelHubError) and issubclass(errors.KernelLockError, ValueError)
    assert issubclass(errors.UntrustedKernelError, PermissionError)
    assert issubclass(errors.ConfigError, ValueError) and issubclass(errors.UntrustedKernelWarning, UserWarning)
    assert issubclass(errors.SymmetricHeapFullError, MemoryError)


def test_no_other_module_defines_a_public_exception():
    """A new public exception goes to kernelhub.errors, not beside the code that raises it."""
    elsewhere = []
    for info in pkgutil.walk_packages(kernelhub.__path__, "kernelhub."):
        if info.name.endswith("__main__"):  # runs the CLI when imported
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException) and not name.startswith("_")
                    and obj.__module__ == info.name and info.name != "kernelhub.errors"):
                elsewhere.append(f"{info.name}.{name}")
    assert not elsewhere
