"""Hugging Face `kernels`' tests/test_kernel_locking.py, ported to kernelhub.

Upstream: github.com/huggingface/kernels at 8ac69fc542a4306eade0759ef7c45b4f2ae57df0 (kernels
0.17.0.dev0), kernels/tests/test_kernel_locking.py. Changed: the imports (`kernels.cli`'s
`download_kernels` is `kernelhub.cli`'s, what `kernelhub download PROJECT_DIR`
runs); upstream's checked-in projects `tests/kernel_locking/` and `tests/layer_locking/` (pyproject.toml
and the kernels.lock `kernels lock` wrote) are written by `_project` for the local Hub's stand-ins
(hf_test_kernels.py), in upstream's lock format and again in the one the released `kernels` 0.17.2
writes (commit only); `cuda_only` is kernelhub's `gpu` marker.
"""

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.nn as nn

from compat_hf_kernels.hf_test_kernels import write_locked_project
from kernelhub import (
    LockedFuncRepository,
    LockedLayerRepository,
    Mode,
    kernelize,
    load_kernel,
    use_kernel_forward_from_hub,
    use_kernel_func_from_hub,
    use_kernel_mapping,
)
from kernelhub.cli import download_kernels

_PROJECTS = {
    "kernel_locking": {"kernels-community/relu": 1, "kernels-test/versions": 2},
    "layer_locking": {"kernels-test/versions": 2},
}


_PROJECT_DIRS: dict[str, Path] = {}


@pytest.fixture(scope="module", autouse=True, params=["variant-hash", "commit"])
def _locked_projects(request, _local_hub, tmp_path_factory):
    """Each test runs with the lock files of upstream's commit (a hash per variant) and with those
    the released `kernels` 0.17.2 writes (the commit only)."""
    root = tmp_path_factory.mktemp(f"locked-projects-{request.param}")
    for name, deps in _PROJECTS.items():
        _PROJECT_DIRS[name] = write_locked_project(root / name, deps, request.param)
    yield
    _PROJECT_DIRS.clear()


def _project(name: str) -> Path:
    """Upstream's `Path(__file__).parent / name`: that project, written for the local Hub."""
    return _PROJECT_DIRS[name]


# Mock download arguments class.
@dataclass
class DownloadArgs:
    all_variants: bool
    project_dir: Path


def test_download_all_hash_validation():
    project_dir = _project("kernel_locking")
    download_kernels(DownloadArgs(all_variants=True, project_dir=project_dir))


@pytest.mark.gpu
def test_load_locked():
    project_dir = _project("kernel_locking")
    # Also validates that hashing works correctly.
    download_kernels(DownloadArgs(all_variants=False, project_dir=project_dir))
    load_kernel("kernels-community/relu", lockfile=project_dir / "kernels.lock")


def test_layer_locked(device):
    project_dir = _project("layer_locking")

    @use_kernel_forward_from_hub("Version")
    class Version(nn.Module):
        def forward(self) -> str:
            return "0.0.0"

    version = Version()

    with use_kernel_mapping(
        {
            "Version": {
                device: LockedLayerRepository(
                    repo_id="kernels-test/versions",
                    layer_name="Version",
                    lockfile=project_dir / "kernels.lock",
                )
            },
        }
    ):
        version = kernelize(version, device=device, mode=Mode.INFERENCE)
        assert version() == 2


def test_func_locked(device):
    project_dir = _project("layer_locking")

    @use_kernel_func_from_hub("version")
    def version():
        return 0

    class Version(nn.Module):
        def __init__(self):
            super().__init__()
            self.version = version

        def forward(self) -> str:
            return self.version()

    model = Version()

    with use_kernel_mapping(
        {
            "version": {
                device: LockedFuncRepository(
                    repo_id="kernels-test/versions",
                    func_name="version",
                    lockfile=project_dir / "kernels.lock",
                )
            },
        }
    ):
        model = kernelize(model, device=device, mode=Mode.INFERENCE)

    assert version() == 2

    with use_kernel_mapping({"version": {}}):
        model = kernelize(model, mode=Mode.INFERENCE, device=device)

    assert version() == 0
