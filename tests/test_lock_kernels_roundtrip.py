"""Lock files shared with Hugging Face `kernels` 0.17: kernelhub writes what `kernels` reads and
reads what `kernels` writes. Runs where `kernels` is importable (it installs from the package
registry: `pip install "kernels==0.17.*"`); each side runs in its own process against the local Hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hub_server import hub_fixture, tiny_copy  # noqa: F401 - hub_fixture provides `hub`

from kernelhub.hub import LockedLayerRepository
from kernelhub.lock import get_locked_kernel, lock_kernel, write_lockfile

pytest.importorskip("kernels", reason="Hugging Face `kernels` is not installed (pip install 'kernels==0.17.*')")

SRC = Path(__file__).resolve().parents[1] / "src"
# What `kernels` requires of build/<variant>/metadata.json (its Metadata), beside kernelhub's package.
_KERNELS_METADATA = {"name": "tiny", "id": "_tiny_roundtrip", "version": 1, "license": "Apache-2.0",
                     "python-depends": [], "backend": {"type": "cpu"}}


def _publish(hub, tmp_path: Path, repo_id: str, factor: float) -> str:
    """A tiny kernel laid out as both loaders read it, on branch v1; returns the commit."""
    from huggingface_hub import HfApi

    src = tiny_copy(tmp_path / f"src-{factor}", factor=factor)
    (src / "build" / "torch-universal" / "metadata.json").write_text(json.dumps(_KERNELS_METADATA))
    api = HfApi(endpoint=hub.url)
    api.create_repo(repo_id, repo_type="kernel", exist_ok=True)
    branches = {b.name for b in api.list_repo_refs(repo_id, repo_type="kernel").branches}
    if "v1" not in branches:
        api.create_branch(repo_id, branch="v1", repo_type="kernel")
    return api.upload_folder(repo_id=repo_id, folder_path=str(src), repo_type="kernel", revision="v1").oid


def _run_kernels(hub, tmp_path: Path, code: str) -> str:
    """Run `code` with `kernels` in a fresh process (it reads HF_ENDPOINT when huggingface_hub is
    imported), with its own cache."""
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "kernels-cache"),
           "PYTHONPATH": str(SRC)}
    for var in ("HF_HUB_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):  # (kernels 0.17 + huggingface_hub 2.4 send a
        env.pop(var, None)                                      # user agent ending in "; " without telemetry)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_a_lock_written_by_kernelhub_loads_in_kernels(hub, tmp_path):
    _publish(hub, tmp_path, "org/tiny", factor=2.0)
    lockfile = write_lockfile([lock_kernel("org/tiny", version=1)], tmp_path / "kernels.lock")
    _publish(hub, tmp_path, "org/tiny", factor=4.0)  # v1 moved on: the lock still means the first commit
    code = (
        "from pathlib import Path; import torch; from kernels import get_locked_kernel; "
        f"k = get_locked_kernel('org/tiny', lockfile=Path({str(lockfile)!r}), trust_remote_code=True); "
        "print(float(k.scale(torch.ones(1))[0]))"
    )
    assert _run_kernels(hub, tmp_path, code) == "2.0"


def test_a_lock_written_by_kernels_loads_in_kernelhub(hub, tmp_path):
    first = _publish(hub, tmp_path, "org/tiny", factor=2.0)
    hub.store.trusted_orgs.add("org")  # `kernels lock` asks the Hub whether the publisher is trusted
    lockfile = tmp_path / "kernels.lock"
    code = (
        "from kernels._rust import KernelDependency, KernelVersion; from kernels.hf_hub import _get_hf_api; "
        "from kernels.locking import extract_dependency_locks; "
        "locks = extract_dependency_locks([KernelDependency(repo_id='org/tiny', version=KernelVersion.Version(1))], "
        "api=_get_hf_api()); "
        f"open({str(lockfile)!r}, 'w').write(locks.to_json())"
    )
    _run_kernels(hub, tmp_path, code)
    assert json.loads(lockfile.read_text())[0]["lock"]["commit"] == first
    _publish(hub, tmp_path, "org/tiny", factor=4.0)
    hub.store.trusted_orgs.clear()  # a lock needs no publisher trust in kernelhub
    kernel = get_locked_kernel("org/tiny", lockfile=lockfile)
    assert float(kernel.scale(torch.ones(1))[0]) == 2.0
    assert kernel.__kernelhub_source__.commit == first
    layer = LockedLayerRepository("org/tiny", layer_name="TinyScale", lockfile=lockfile).load()
    assert float(layer()(torch.ones(1))[0]) == 2.0
