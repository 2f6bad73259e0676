"""Shared test setup: the Triton interpreter on CPU, the `gpu` marker, and faked GPUs."""

from __future__ import annotations

import os

# Must precede the definition of any @triton.jit function (kernels are imported by tests).
if os.environ.get("KERNELHUB_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Under pytest-xdist (`-n`), the workers share the cores: each takes its part for torch's threads
# and for the processes it starts, instead of every worker oversubscribing all of them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _threads = max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    torch.set_num_threads(_threads)

from kernelhub.device import clear_device_caches  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and TRITON_INTERPRET=0")
    for item in items:
        if "gpu" in item.keywords or "multigpu" in item.keywords:
            item.add_marker(skip)


class FakeGPUs:
    """Answers torch.cuda's per-index queries from a table, and records `set_device` calls."""

    def __init__(self, specs: dict[int, dict]):
        self.specs = specs
        self.current = 0
        self.set_calls: list[int] = []

    def capability(self, index=None):
        index = self.current if index is None else _index(index)
        cap = self.specs[index]["capability"]
        return (cap // 10, cap % 10)

    def properties(self, index=None):
        index = self.current if index is None else _index(index)
        s = self.specs[index]
        cap = s["capability"]

        class _Props:
            name = s.get("name", f"FakeGPU{index}")
            major, minor = cap // 10, cap % 10
            multi_processor_count = s.get("sm_count", 100)
            shared_memory_per_multiprocessor = s.get("smem", 228 * 1024)
            shared_memory_per_block_optin = s.get("smem", 228 * 1024) - 1024
            total_memory = 80 << 30

        return _Props()

    def set_device(self, index):
        index = _index(index)
        self.set_calls.append(index)
        self.current = index


def _index(device) -> int:
    if isinstance(device, torch.device):
        return device.index if device.index is not None else 0
    if isinstance(device, str):
        return torch.device(device).index or 0
    return int(device)


@pytest.fixture
def fake_gpus(monkeypatch):
    """Two fake GPUs: cuda:0 is sm80 (108 SMs), cuda:1 is sm90 (132 SMs). Call to reconfigure."""
    fake = FakeGPUs(
        {
            0: {"capability": 80, "sm_count": 108, "name": "FakeA100", "smem": 164 * 1024},
            1: {"capability": 90, "sm_count": 132, "name": "FakeH100", "smem": 228 * 1024},
        }
    )
    clear_device_caches()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(fake.specs))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: fake.current)
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    monkeypatch.setattr(torch.cuda, "get_device_capability", fake.capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties", fake.properties)
    yield fake
    clear_device_caches()


def fake_cuda_tensor(shape, index: int, dtype=torch.float32):
    """A tensor that reports device cuda:<index> without a GPU (FakeTensor over meta storage)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    return FakeTensor(mode, torch.empty(shape, device="meta", dtype=dtype), torch.device("cuda", index))


_HUGE_VIEW = """
import torch
from kernelhub.hub import get_local_kernel
kernel = get_local_kernel({repo!r})
S = 2 ** 30
try:
    base = torch.empty(2 * S + 1, dtype=torch.float16)  # untouched but for the three elements below
except (RuntimeError, MemoryError) as e:
    print("SKIP", e)
    raise SystemExit(0)
for i, v in enumerate((1.0, 2.0, 3.0)):
    base[i * S] = v
view = base.as_strided((1, 3), (3 * S, S))
{call}
"""


def run_with_a_huge_strided_view(repo, call: str) -> list[str]:
    """Run `call` in a subprocess (Triton interpreter) where `kernel` is the kernel repository at
    `repo` and `view` a float16 [1, 3] view holding 1, 2, 3 with column stride 2**30 (4 GiB of
    virtual memory, a few pages touched): offsets past int32 for real. A subprocess, so that a crash
    (the interpreter reading out of bounds) fails the test rather than the run. Returns the lines it
    printed; skips where the memory cannot be reserved."""
    import subprocess
    import sys

    code = _HUGE_VIEW.format(repo=str(repo), call=call)
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    if run.stdout.startswith("SKIP"):
        pytest.skip(f"cannot reserve 4 GiB of virtual memory here: {run.stdout.strip()}")
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip().splitlines()
