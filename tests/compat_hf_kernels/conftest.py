"""Harness for Hugging Face `kernels`' own tests, ported to kernelhub.

- `device`: upstream conftest's fixture (cuda where there is one, else cpu).
- A local Hub (tests/hub_server.py) per test module, holding stand-ins for the `kernels-test/*`
  repositories (hf_test_kernels.py); HF_ENDPOINT points the real huggingface_hub client at it.
  `kernels-test` and `kernels-community` are trusted publishers there, as they are on the Hub.
- Upstream registers kernel mappings when a test module is imported; each module's registrations
  are kept for its own tests only, so kernelhub's other tests see kernelhub's mapping.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # hub_server, when run on its own

from hub_server import LocalHub  # noqa: E402

from kernelhub import registry  # noqa: E402

_CLEAN_MAPPING = registry._GLOBAL_MAPPING
_MODULE_MAPPINGS: dict[str, registry.KernelMapping] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_collectreport(report):
    yield
    # `fspath` is the node id's path, relative to the rootdir (the repository root) in current pytest
    path = str((Path(__file__).resolve().parents[2] / str(getattr(report, "fspath", ""))).resolve())
    if path.startswith(str(Path(__file__).resolve().parent)) and path.endswith(".py"):
        # the module was imported: keep what it registered, give the rest of the session the clean one
        if registry._GLOBAL_MAPPING is not _CLEAN_MAPPING:
            _MODULE_MAPPINGS[str(Path(path).resolve())] = registry._GLOBAL_MAPPING
            registry._GLOBAL_MAPPING = _CLEAN_MAPPING


@pytest.fixture(autouse=True)
def _module_mapping(request):
    """The mapping this test's module registered at import, for this test only."""
    registry._GLOBAL_MAPPING = _MODULE_MAPPINGS.get(str(Path(request.node.path).resolve()), _CLEAN_MAPPING)
    yield
    registry._GLOBAL_MAPPING = _CLEAN_MAPPING


@pytest.fixture(scope="module", autouse=True)
def _local_hub(tmp_path_factory):
    """The stand-in `kernels-test/*` repositories on a local Hub, for this module's tests."""
    from compat_hf_kernels.hf_test_kernels import publish_all

    root = tmp_path_factory.mktemp("hf-kernels-hub")
    with pytest.MonkeyPatch.context() as mp:
        for var in ("KERNELHUB_CACHE", "HF_HUB_OFFLINE", "KERNELHUB_LOCKFILE", "KERNELHUB_REPO_TYPE", "HF_TOKEN",
                    "LOCAL_KERNELS"):
            mp.delenv(var, raising=False)
        mp.setenv("KERNELHUB_TRUSTED_PUBLISHERS", "kernels-test,kernels-community")
        import huggingface_hub
        from packaging.version import Version

        if Version(huggingface_hub.__version__) < Version("2.3"):  # downloads `kernel` repos, cannot upload them
            mp.setenv("KERNELHUB_REPO_TYPE", "model")
        with LocalHub(root / "hubdata") as server:
            mp.setenv("HF_ENDPOINT", server.url)
            mp.setenv("HF_HUB_CACHE", str(root / "cache"))
            publish_all(root / "src")
            yield server


@pytest.fixture
def device():
    return "cuda" if torch.cuda.is_available() else "cpu"
