"""Local stand-ins for the Hub repositories that Hugging Face `kernels`' own tests load.

Upstream's tests download `kernels-test/*` and `kernels-community/relu` from the Hub (compiled CUDA
kernels, mostly). Here each is a small pure-torch kernel with the same repository id, branches,
layer and function names and flags, written to disk and published to tests/hub_server.py's local
Hub with the real huggingface_hub client, so the ported tests run unchanged against it.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

_SILU = """
import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
"""

_SILU_LAYER = """
from torch import nn

from .ops import silu_and_mul


class SiluAndMul(nn.Module):
{flags}
    def forward(self, input):
        return silu_and_mul(input)
"""

_LINEAR_LAYERS = """
import torch.nn.functional as F
from torch import nn


class LinearBackward(nn.Module):
    has_backward = True
    can_torch_compile = True

    def forward(self, input):
        return F.linear(input, self.weight, self.bias)


class LinearNoBackward(nn.Module):
    has_backward = False
    can_torch_compile = True

    def forward(self, input):
        return F.linear(input, self.weight, self.bias)


class LinearImplicitBackward(nn.Module):
    can_torch_compile = True

    def forward(self, input):
        return F.linear(input, self.weight, self.bias)
"""

_VERSION = """
from . import layers  # noqa: F401


def version() -> int:
    return {n}
"""

_VERSION_LAYER = """
from torch import nn


class Version(nn.Module):
    def forward(self) -> int:
        return {n}
"""

_RELU = """
import torch
import torch.nn.functional as F


def relu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x)
"""

_METADATA = json.dumps({"python-depends": [], "license": "Apache-2.0"})


def _package(name: str, init: str, **modules: str) -> dict[str, str]:
    files = {f"{name}/__init__.py": init, f"{name}/metadata.json": _METADATA}
    files.update({f"{name}/{m}.py": text for m, text in modules.items()})
    return files


def _silu_package(layer_flags: str) -> dict[str, str]:
    return _package(
        "silu_and_mul",
        "from . import layers\nfrom .ops import silu_and_mul\n",
        ops=_SILU,
        layers=_SILU_LAYER.format(flags=layer_flags),
    )


_TORCH24 = "../torch24-cxx11-cu121-x86_64-linux"  # beside torch-universal, under build/
_BOTH_FLAGS = "    has_backward = True\n    can_torch_compile = True\n"

# repo id -> branch -> {path under build/torch-universal/: text}
REPOSITORIES: dict[str, dict[str, dict[str, str]]] = {
    "kernels-test/silu-and-mul": {b: _silu_package(_BOTH_FLAGS) for b in ("main", "v1", "layers")},
    # a layer that does not declare can_torch_compile
    "kernels-test/op-without-fake-test": {"main": _silu_package("    has_backward = True\n")},
    "kernels-test/backward-marker-test": {
        "main": _package("backward_marker_test", "from . import layers\n", layers=_LINEAR_LAYERS)
    },
    "kernels-test/versions": {
        branch: _package("versions", _VERSION.format(n=n), layers=_VERSION_LAYER.format(n=n))
        for branch, n in (("main", 2), ("v1", 1), ("v2", 2), ("v10", 10))
    },
    "kernels-community/relu": {b: _package("relu", _RELU) for b in ("main", "v1")},
    # a publisher outside the trusted ones
    "kernels-test-untrusted/ci-test-kernel": {"v1": _package("relu", _RELU)},
    "kernels-test-untrusted/not-a-trused-org-kernel": {"v1": _package("relu", _RELU)},
    # built for torch 2.4 only: no variant this system runs
    "kernels-test/only-torch-2.4": {"main": {f"{_TORCH24}/relu/{k}": v for k, v in _package("relu", _RELU).items()}},
    "kernels-test/flattened-build": {
        # the package directory only (kernel-builder's layout before flattening)
        "pre-flattening": _silu_package(_BOTH_FLAGS),
        # the variant directory is the package, with a compatibility package of the kernel's name
        "main": {
            "__init__.py": "from . import layers\nfrom .ops import silu_and_mul\n",
            "ops.py": _SILU,
            "layers.py": _SILU_LAYER.format(flags=_BOTH_FLAGS),
            "metadata.json": _METADATA,
            "silu_and_mul/__init__.py": "from .. import layers, silu_and_mul  # noqa: F401\n",
        },
        # the variant directory is the package, no compatibility package
        "without-compat-module": {
            "__init__.py": "from . import layers\nfrom .ops import silu_and_mul\n",
            "ops.py": _SILU,
            "layers.py": _SILU_LAYER.format(flags=_BOTH_FLAGS),
            "metadata.json": _METADATA,
        },
    },
}


def write_repository(root: Path, variant_files: dict[str, str]) -> Path:
    """A kernel repository at `root` with one `torch-universal` build variant (paths starting with
    `../` name another variant); returns `root`."""
    variant = root / "build" / "torch-universal"
    for rel, text in variant_files.items():
        path = (variant / rel).resolve() if rel.startswith("../") else variant / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return root


def publish_all(workdir: Path) -> None:
    """Publish every repository of REPOSITORIES, each branch from its own directory, to the Hub
    that HF_ENDPOINT names (tests/hub_server.py's)."""
    from kernelhub._fetch import api, default_repo_type

    hub, repo_type = api(), default_repo_type()
    for repo_id, branches in REPOSITORIES.items():
        hub.create_repo(repo_id, repo_type=repo_type, exist_ok=True)
        for branch, files in branches.items():
            src = write_repository(workdir / repo_id.replace("/", "--") / branch, files)
            if branch != "main":
                hub.create_branch(repo_id, branch=branch, repo_type=repo_type, exist_ok=True)
            hub.upload_folder(repo_id=repo_id, folder_path=str(src), repo_type=repo_type, revision=branch,
                              commit_message=f"{repo_id} {branch}")


def install_kernel(repo_id: str, revision: str, local_files_only: bool = False) -> Path:
    """Download `repo_id` at `revision` from the local Hub; the build variant's directory, as
    `kernels.install.install_kernel` returns it (`path.parent.parent` is the repository root)."""
    from kernelhub._fetch import resolve_kernel

    return Path(resolve_kernel(repo_id, revision=revision).path)


def write_locked_project(project_dir: Path, dependencies: dict[str, int], lock_format: str = "variant-hash") -> Path:
    """A project as upstream's `tests/kernel_locking/` and `tests/layer_locking/` hold it:
    pyproject.toml with `[tool.kernels.dependencies]` and the `kernels.lock` that `kernels lock`
    wrote for it at the upstream commit, made from the local Hub: each repository's commit of branch
    `v<version>`, and each variant's `git_lfs_concat` hash computed from the Hub's listing (git blob
    ids, LFS sha256) as `kernels` computed it, not from downloaded files. `lock_format="commit"`: the
    lock as the released `kernels` 0.17.2 writes it instead (`{"dependency", "lock": {"commit"}}`, no
    hashes). Returns `project_dir`."""
    import hashlib

    from huggingface_hub.hf_api import RepoFile

    from kernelhub._fetch import api, default_repo_type

    hub, repo_type = api(), default_repo_type()
    project_dir.mkdir(parents=True, exist_ok=True)
    deps = "".join(f'"{repo_id}" = {version}\n' for repo_id, version in dependencies.items())
    (project_dir / "pyproject.toml").write_text(f"[tool.kernels.dependencies]\n{deps}")
    locks = []
    for repo_id, version in dependencies.items():
        branches = {b.name: b.target_commit for b in hub.list_repo_refs(repo_id, repo_type=repo_type).branches}
        sha = branches[f"v{version}"]
        if lock_format == "commit":
            locks.append({"dependency": {"repo-id": repo_id, "version": version}, "lock": {"commit": sha}})
            continue
        files: dict[str, list[tuple[bytes, str]]] = {}
        for f in hub.list_repo_tree(repo_id, repo_type=repo_type, revision=sha, recursive=True):
            if isinstance(f, RepoFile) and f.path.startswith("build/torch"):
                parts = f.path.split("/")
                digest = f.lfs.sha256 if f.lfs else f.blob_id
                files.setdefault(parts[1], []).append(("/".join(parts[2:]).encode(), digest))
        variants = {}
        for variant, entries in sorted(files.items()):
            m = hashlib.sha256()
            for rel, digest in sorted(entries):
                m.update(rel)
                m.update(bytes.fromhex(digest))
            variants[variant] = {"hash": f"sha256-{m.hexdigest()}", "hash_type": "git_lfs_concat"}
        locks.append({"repo_id": repo_id, "sha": sha, "variants": variants})
    (project_dir / "kernels.lock").write_text(json.dumps(locks, indent=2))
    return project_dir
