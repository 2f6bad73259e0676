"""Hugging Face `kernels`' tests/test_func.py, ported to kernelhub.

Upstream: github.com/huggingface/kernels at 8ac69fc542a4306eade0759ef7c45b4f2ae57df0 (kernels
0.17.0.dev0), kernels/tests/test_func.py. Changed: the imports; `install_kernel` downloads from the
local Hub (hf_test_kernels.py); the lock file of `test_deprecated_kernel_func` is written to
tmp_path (it is never loaded); `cuda_only` is kernelhub's `gpu` marker.
"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from compat_hf_kernels.hf_test_kernels import install_kernel
from kernelhub import (
    FuncRepository,
    LayerRepository,
    LocalFuncRepository,
    Mode,
    kernelize,
    use_kernel_forward_from_hub,
    use_kernel_func_from_hub,
    use_kernel_mapping,
    use_kernelized_func,
)
from kernelhub.func import LockedFuncRepository


# A function + layer that we can map arbitrary functions to for testing.
@use_kernel_forward_from_hub("surprise_me")
def surprise_me(x: torch.Tensor):
    return x


@use_kernelized_func(surprise_me)
class SurpriseMe(nn.Module):
    def forward(self, x: torch.Tensor):
        return surprise_me(x)


def test_decorator():
    @use_kernel_forward_from_hub("identity_func")
    def identity(x):
        return x

    assert type(identity).kernel_layer_name == "identity_func"
    assert isinstance(identity, nn.Module)


@pytest.mark.filterwarnings("ignore:.*will be removed in kernels 0.17:DeprecationWarning")
def test_deprecated_decorator():
    @use_kernel_func_from_hub("identity_func")
    def identity(x):
        return x

    assert type(identity).kernel_layer_name == "identity_func"
    assert isinstance(identity, nn.Module)


@pytest.mark.filterwarnings("ignore:.*will be removed in kernels 0.17:DeprecationWarning")
def test_deprecated_func_repository_requires_version_or_revision():
    with pytest.raises(ValueError, match="Either a revision or a version must be specified"):
        FuncRepository("kernels-test/flattened-build", func_name="silu_and_mul")


@pytest.mark.filterwarnings("ignore:.*will be removed in kernels 0.17:DeprecationWarning")
def test_deprecated_func_repository(device):
    model = SurpriseMe()

    x = torch.arange(-10, 10, device=device).float()
    assert model(x) is x

    with use_kernel_mapping(
        {
            "surprise_me": {
                device: FuncRepository(
                    "kernels-test/flattened-build",
                    func_name="silu_and_mul",
                    revision="main",
                )
            }
        }
    ):
        model = kernelize(model, mode=Mode.INFERENCE, device=device)

    torch.testing.assert_close(model(x), _silu_and_mul(x))

    # And empty mapping should revert to the original implementation.
    with use_kernel_mapping({"surprise_me": {}}):
        model = kernelize(model, mode=Mode.INFERENCE, device=device)

    assert model(x) is x


@pytest.mark.gpu
def test_kernel_func_with_layer():
    model = SurpriseMe()

    x = torch.arange(-10, 10, device="cuda").float()
    assert model(x) is x

    # We can also replace the function by a pure layer.
    with use_kernel_mapping(
        {
            "surprise_me": {
                "cuda": LayerRepository(
                    "kernels-test/silu-and-mul",
                    layer_name="SiluAndMul",
                    version=1,
                )
            }
        }
    ):
        model = kernelize(model, mode=Mode.INFERENCE, device="cuda")

    torch.testing.assert_close(model(x), _silu_and_mul(x))

    # And empty mapping should revert to the original implementation.
    with use_kernel_mapping({"surprise_me": {}}):
        model = kernelize(model, mode=Mode.INFERENCE, device="cuda")

    assert model(x) is x


@pytest.mark.filterwarnings("ignore:.*will be removed in kernels 0.17:DeprecationWarning")
def test_deprecated_local_kernel_func(device):
    model = SurpriseMe()

    x = torch.arange(-10, 10).float()
    assert model(x) is x

    path = install_kernel("kernels-test/flattened-build", revision="main")

    with use_kernel_mapping(
        {
            "surprise_me": {
                device: LocalFuncRepository(
                    repo_path=path.parent.parent,
                    func_name="silu_and_mul",
                )
            }
        }
    ):
        model = kernelize(model, mode=Mode.INFERENCE, device=device)

    torch.testing.assert_close(model(x), _silu_and_mul(x))

    with use_kernel_mapping({"do_something_func": {}}):
        model = kernelize(model, mode=Mode.INFERENCE, device=device)

    assert model(x) is x


def test_deprecated_kernel_func(tmp_path):
    with pytest.deprecated_call(match="kernels 0.17"):
        FuncRepository("kernels-test/flattened-build", func_name="silu_and_mul", version=1)

    project_dir = tmp_path
    (project_dir / "kernels.lock").write_text(_LOCK)
    with pytest.deprecated_call(match="kernels 0.17"):
        LockedFuncRepository(
            "kernels-test/versions",
            func_name="version",
            lockfile=project_dir / "kernels.lock",
        )

    with pytest.deprecated_call(match="kernels 0.17"):
        LocalFuncRepository(
            # We are never loading the kernel, so we can just use an invalid path.
            repo_path=Path("."),
            func_name="silu_and_mul",
        )

    with pytest.deprecated_call(match="kernels 0.17"):

        @use_kernel_func_from_hub("deprecated")
        def deprecated_func(x):
            return x


def test_use_kernelized_func_used_on_non_kernelized_func():
    def not_kernelized(x):
        return x

    with pytest.raises(ValueError, match="Function `not_kernelized` is not decorated"):

        @use_kernelized_func(not_kernelized)
        class NotKernelized(nn.Module):
            def forward(self, x: torch.Tensor):
                return not_kernelized(x)


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


# a `kernels` lock file pinning kernels-test/versions (never loaded by the test)
_LOCK = """[
  {"repo_id": "kernels-test/versions", "sha": "0000000000000000000000000000000000000001", "variants": {}}
]
"""
