import pytest
import torch
from torch import nn

from conftest import fake_cuda_tensor
from kernelhub.device import (
    CUDAProperties,
    Device,
    ROCmProperties,
    as_torch_device,
    device_capability,
    device_guard,
    device_properties,
    module_device,
)


def test_device_is_frozen_and_hashable():
    a = Device("cuda", 1, CUDAProperties(80, 89))
    b = Device("cuda", 1, CUDAProperties(80, 89))
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.index = 2  # type: ignore[misc]


def test_capability_range_with_min_above_max_is_rejected():
    with pytest.raises(ValueError, match="min_capability"):
        CUDAProperties(95, 90)
    with pytest.raises(ValueError, match="min_capability"):
        ROCmProperties(95, 90)


def test_capability_must_be_int():
    with pytest.raises(TypeError, match="max_capability"):
        CUDAProperties(80, "90")  # type: ignore[arg-type]


def test_properties_must_match_device_type():
    with pytest.raises(ValueError, match="properties"):
        Device("cpu", properties=CUDAProperties(80, 90))
    with pytest.raises(ValueError, match="properties"):
        Device("cuda", properties=ROCmProperties(90, 94))
    with pytest.raises(TypeError, match="properties"):
        Device("cuda", properties=(80, 90))  # type: ignore[arg-type]


def test_bad_type_and_index_are_rejected():
    with pytest.raises(ValueError, match="type"):
        Device("gpu")
    with pytest.raises(ValueError, match="index"):
        Device("cuda", -1)
    with pytest.raises(ValueError, match=r"`device`: a device index must be >= 0, got -1"):
        device_capability(-1)


def test_capability_is_per_index_whatever_was_asked_first(fake_gpus):
    assert device_capability(torch.device("cuda", 0)) == 80
    assert device_capability(torch.device("cuda", 1)) == 90
    assert device_capability("cuda:0") == 80
    fake_gpus.current = 1
    assert device_capability(torch.device("cuda", 0)) == 80


def test_properties_are_per_index(fake_gpus):
    assert device_properties("cuda:1").sm_count == 132
    assert device_properties("cuda:0").sm_count == 108
    assert device_properties("cuda:1").name == "FakeH100"
    assert device_properties("cuda:0").shared_memory_per_sm == 164 * 1024


def test_device_cache_is_emptied_with_the_device_caches(fake_gpus):
    from kernelhub.device import clear_device_caches, cuda_properties, device_cache

    derived = device_cache()
    derived[1] = cuda_properties(1).sm_count
    assert derived == {1: 132} and cuda_properties(1) is device_properties("cuda:1")
    fake_gpus.specs[1]["sm_count"] = 114
    clear_device_caches()
    assert derived == {} and cuda_properties(1).sm_count == 114


def test_device_without_index_means_current_device_at_call_time(fake_gpus):
    fake_gpus.current = 1
    assert as_torch_device("cuda") == torch.device("cuda", 1)
    assert device_capability("cuda") == 90
    fake_gpus.current = 0
    assert device_capability("cuda") == 80


def test_capability_of_cpu_is_an_error():
    with pytest.raises(ValueError, match="GPU device"):
        device_capability(torch.device("cpu"))


def test_module_device_prefers_own_parameters():
    m = nn.Sequential(nn.Linear(2, 2))
    assert module_device(m) == torch.device("cpu")
    assert module_device(nn.ReLU()) is None


def test_module_device_reads_fake_gpu_parameters():
    lin = nn.Linear(3, 4)
    lin.weight = nn.Parameter(fake_cuda_tensor((4, 3), 1), requires_grad=False)
    lin.bias = None
    assert module_device(lin) == torch.device("cuda", 1)


def test_device_guard_switches_and_restores(fake_gpus):
    fake_gpus.current = 0
    with device_guard(fake_cuda_tensor((2,), 1)) as dev:
        assert dev == torch.device("cuda", 1)
        assert torch.cuda.current_device() == 1
    assert torch.cuda.current_device() == 0
    assert fake_gpus.set_calls == [1, 0]


def test_device_guard_restores_on_error(fake_gpus):
    with pytest.raises(RuntimeError):
        with device_guard("cuda:1"):
            raise RuntimeError("boom")
    assert torch.cuda.current_device() == 0


def test_device_guard_is_noop_on_same_device_and_cpu(fake_gpus):
    with device_guard("cuda:0"):
        pass
    with device_guard(torch.zeros(1)):
        pass
    assert fake_gpus.set_calls == []


def test_device_guard_on_a_tensor_of_the_current_gpu_switches_nothing(fake_gpus):
    # the fast path: a reused no-op context, still yielding the tensor's device (nested too)
    fake_gpus.current = 1
    x = fake_cuda_tensor((2,), 1)
    with device_guard(x) as dev, device_guard(x) as inner:
        assert dev == inner == torch.device("cuda", 1)
    assert fake_gpus.set_calls == []
    fake_gpus.current = 0
    with device_guard(x) as dev:  # not current: switched and restored
        assert dev == torch.device("cuda", 1) and torch.cuda.current_device() == 1
    assert fake_gpus.set_calls == [1, 0]


def test_kernel_repositories_import_only_torch_triton_and_kernelhub_device():
    """DESIGN.md section 3: kernel code imports torch, triton and `kernelhub.device` (which also
    hands out the cached launcher), so a published kernel depends on that one stable module."""
    import ast
    from pathlib import Path

    import kernelhub.device as device
    from kernelhub.triton_launch import CachedLaunch

    assert device.CachedLaunch is CachedLaunch
    root = Path(__file__).resolve().parents[1] / "kernels_repo"
    files = sorted(root.glob("*/torch-ext/*/**/*.py"))
    assert len(files) >= 10
    bad = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            bad += [f"{path.relative_to(root)}: {n}" for n in names
                    if n.split(".")[0] == "kernelhub" and n != "kernelhub.device"]
    assert bad == [], bad
