"""What `kernelhub build` writes for a kernel repository, computed in one place: `build` writes it,
`check` compares an existing build with it (a build that differs is stale).

`build/torch-universal/` gets `<name>/` (the source package `torch-ext/<name>/`, less bytecode and
hidden files), `<name>/kernel.toml` (a copy: the kernel reads its variant table at run time) and
`metadata.json`. The metadata sits in the variant directory and has the fields kernel-builder
writes and Hugging Face `kernels` 0.17 requires (`name`, `id`, `version`, `license`,
`python-depends`, `backend`), so `kernels` loads a kernelhub build too.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kernelhub.cli._files import read_file, scan_tree

__all__ = ["UNIVERSAL", "built_files", "kernel_metadata"]

UNIVERSAL = "torch-universal"
# A universal build has no arch list; its Triton kernels target CUDA, its references run anywhere,
# and `kernels` reads the backend type only together with an arch list.
_BACKEND = {"type": "cuda"}


def kernel_metadata(name: str, version: int, license: str, files: dict[str, bytes]) -> dict:
    """metadata.json for a build of `files`; `id` (a module name unique to the content) changes
    whenever a built file does, as kernel-builder's does with the source commit."""
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
    return {
        "name": name,
        "id": f"_{name}_universal_{digest.hexdigest()[:7]}",
        "version": version,
        "license": license or "unknown",
        "python-depends": [],
        "backend": dict(_BACKEND),
    }


def built_files(repo: Path, name: str, version: int, license: str) -> dict[str, bytes]:
    """{path under build/torch-universal/: bytes} that `kernelhub build` writes for `repo`.

    ValueError (naming the path) where the source holds a link or a special file."""
    source = f"torch-ext/{name}"
    paths, problems = scan_tree(repo, source)
    if problems:
        raise ValueError("\n".join(problems))
    files = {f"{name}/{p[len(source) + 1:]}": read_file(repo, p) for p in paths}
    files[f"{name}/kernel.toml"] = read_file(repo, "kernel.toml")
    meta = kernel_metadata(name, version, license, files)
    files["metadata.json"] = (json.dumps(meta, indent=2) + "\n").encode()
    return files
