"""The device model: which device a module or tensor lives on and what that device can do.

Every answer here is for one device *index*. Process-wide caches of "the GPU's" capability or
SM count are the bug this project exists to prevent (mixed-generation GPUs in one process), so
the caches below are keyed by ``(type, index)`` and there is no zero-argument device query.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "CUDAProperties",
    "ROCmProperties",
    "ROCMProperties",
    "Device",
    "DeviceProperties",
    "device_capability",
    "device_properties",
    "cuda_properties",
    "device_cache",
    "module_device",
    "device_guard",
    "as_torch_device",
    "clear_device_caches",
]

_GPU_TYPES = ("cuda",)
_KNOWN_TYPES = ("cuda", "rocm", "cpu", "mps", "xpu", "npu", "neuron", "tpu", "meta")


def _check_int(owner: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: `{name}` must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{owner}: `{name}` must be >= 0, got {value}")
    return value


@dataclass(frozen=True)
class _CapabilityRange:
    """An inclusive range of capabilities, as ``major * 10 + minor``; validated on creation."""

    min_capability: int
    max_capability: int

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the fields again (`kernels`' strict dataclasses have this method): TypeError/ValueError."""
        owner = type(self).__name__
        _check_int(owner, "min_capability", self.min_capability)
        _check_int(owner, "max_capability", self.max_capability)
        self.validate_capability_range()

    def validate_capability_range(self) -> None:
        """ValueError where the range is empty (min above max), as `kernels`' validator of that name."""
        if self.min_capability > self.max_capability:
            raise ValueError(
                f"{type(self).__name__}: `min_capability` ({self.min_capability}) must be <= "
                f"`max_capability` ({self.max_capability})"
            )

    def matches(self, capability: int) -> bool:
        return self.min_capability <= capability <= self.max_capability

    @property
    def width(self) -> int:
        return self.max_capability - self.min_capability


@dataclass(frozen=True)
class CUDAProperties(_CapabilityRange):
    """A range of CUDA compute capabilities (90 is sm90), inclusive."""


@dataclass(frozen=True)
class ROCmProperties(_CapabilityRange):
    """A range of ROCm GPU capabilities (``major * 10 + minor`` as torch reports them), inclusive."""


# Hugging Face `kernels` spells it ROCMProperties.
ROCMProperties = ROCmProperties


@dataclass(frozen=True)
class Device:
    """A registry key: device type, optional index (None = any index), optional capability range."""

    type: str
    index: int | None = None
    properties: CUDAProperties | ROCmProperties | None = None

    def __post_init__(self) -> None:
        # `Device("cuda", CUDAProperties(...))`, as Hugging Face `kernels` (which has no index) is called
        if isinstance(self.index, _CapabilityRange) and self.properties is None:
            object.__setattr__(self, "properties", self.index)
            object.__setattr__(self, "index", None)
        self.validate()

    def validate(self) -> None:
        """Check the fields again (`kernels`' strict dataclasses have this method): TypeError/ValueError."""
        if not isinstance(self.type, str) or self.type not in _KNOWN_TYPES:
            raise ValueError(f"Device: `type` must be one of {_KNOWN_TYPES}, got {self.type!r}")
        if self.index is not None:
            _check_int("Device", "index", self.index)
        props = self.properties
        if props is None:
            return
        if isinstance(props, CUDAProperties):
            if self.type != "cuda":
                raise ValueError(
                    f"Device: `properties` CUDAProperties needs type 'cuda', got type {self.type!r}"
                )
        elif isinstance(props, ROCmProperties):
            if self.type != "rocm":
                raise ValueError(
                    f"Device: `properties` ROCmProperties needs type 'rocm', got type {self.type!r}"
                )
        else:
            raise TypeError(
                "Device: `properties` must be CUDAProperties, ROCmProperties or None, "
                f"got {type(props).__name__}"
            )

    def __str__(self) -> str:
        s = self.type if self.index is None else f"{self.type}:{self.index}"
        if self.properties is not None:
            p = self.properties
            s += f"[sm{p.min_capability}-{p.max_capability}]"
        return s


@dataclass(frozen=True)
class DeviceProperties:
    """What kernels size themselves by; read for one device index."""

    name: str
    capability: int
    sm_count: int
    shared_memory_per_sm: int
    shared_memory_per_block: int
    total_memory: int


DeviceLike = "torch.device | str | int | Device | torch.Tensor"

_lock = threading.Lock()
_capability_cache: dict[tuple[str, int], int] = {}
_properties_cache: dict[tuple[str, int], DeviceProperties] = {}
_derived_caches: list[dict] = []


def clear_device_caches() -> None:
    """Forget every cached device answer (tests that fake devices call this)."""
    with _lock:
        _capability_cache.clear()
        _properties_cache.clear()
        for cache in _derived_caches:
            cache.clear()


def device_cache() -> dict:
    """A new dict for answers derived from device properties (a kernel's variant per device
    index, say), emptied by `clear_device_caches` with the caches here, so it never outlives them."""
    cache: dict = {}
    with _lock:
        _derived_caches.append(cache)
    return cache


def as_torch_device(device: object, *, argument: str = "device") -> torch.device:
    """Normalise to a ``torch.device`` with an explicit index for GPU types.

    ``torch.device("cuda")`` means "the current device" to torch; we resolve it *now* so no cache
    or binding ever stores the ambiguous form.
    """
    if isinstance(device, torch.Tensor):
        dev = device.device
    elif isinstance(device, torch.device):
        dev = device
    elif isinstance(device, Device):
        if device.type == "rocm":
            dev = torch.device("cuda", device.index) if device.index is not None else torch.device("cuda")
        else:
            dev = torch.device(device.type, device.index) if device.index is not None else torch.device(
                device.type
            )
    elif isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"`{argument}`: not a device: {device!r}") from e
    elif isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise ValueError(f"`{argument}`: a device index must be >= 0, got {device}")
        dev = torch.device("cuda", device)
    else:
        raise TypeError(
            f"`{argument}` must be a torch.device, str, int, Device or Tensor, got {type(device).__name__}"
        )
    if dev.type in _GPU_TYPES and dev.index is None:
        dev = torch.device(dev.type, torch.get_device_module(dev.type).current_device())
    elif dev.type == "cpu" and dev.index is not None:  # CPU tensors are on "cpu", never "cpu:N"
        dev = torch.device("cpu")
    return dev


def _gpu_key(device: object, fn: str) -> tuple[str, int]:
    dev = as_torch_device(device)
    if dev.type not in _GPU_TYPES:
        raise ValueError(f"{fn}: `device` must be a GPU device, got {dev}")
    assert dev.index is not None
    return dev.type, dev.index


def device_capability(device: object) -> int:
    """Compute capability (``major*10+minor``) of *that* device index, cached per (type, index)."""
    key = _gpu_key(device, "device_capability")
    cap = _capability_cache.get(key)
    if cap is None:
        major, minor = torch.get_device_module(key[0]).get_device_capability(key[1])
        cap = int(major) * 10 + int(minor)
        with _lock:
            _capability_cache[key] = cap
    return cap


def device_properties(device: object) -> DeviceProperties:
    """SM count, shared memory and name of *that* device index, cached per (type, index)."""
    key = _gpu_key(device, "device_properties")
    props = _properties_cache.get(key)
    if props is None:
        p = torch.get_device_module(key[0]).get_device_properties(key[1])
        shared_sm = int(getattr(p, "shared_memory_per_multiprocessor", 0) or 0)
        shared_block = int(getattr(p, "shared_memory_per_block_optin", 0) or 0)
        props = DeviceProperties(
            name=str(getattr(p, "name", "unknown")),
            capability=int(p.major) * 10 + int(p.minor),
            sm_count=int(p.multi_processor_count),
            shared_memory_per_sm=shared_sm,
            shared_memory_per_block=shared_block or shared_sm,
            total_memory=int(getattr(p, "total_memory", 0) or 0),
        )
        with _lock:
            _properties_cache[key] = props
    return props


def cuda_properties(index: int) -> DeviceProperties:
    """`device_properties` of cuda:<index> for an eager hot path that has the index as an int
    (`tensor.get_device()`): one dict lookup once cached, no torch.device built."""
    props = _properties_cache.get(("cuda", index))
    return props if props is not None else device_properties(torch.device("cuda", index))


def module_device(module: torch.nn.Module) -> torch.device | None:
    """The device of a module's own parameters/buffers, else of its subtree, else None."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module_device: `module` must be a torch.nn.Module, got {type(module).__name__}")
    for t in module.parameters(recurse=False):
        return t.device
    for t in module.buffers(recurse=False):
        return t.device
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return None


# One reusable no-op context per CUDA index, for tensors whose device is current already.
_NO_SWITCH: dict[int, contextlib.nullcontext] = {}


def device_guard(tensor_or_device: object) -> contextlib.AbstractContextManager[torch.device]:
    """Make the tensor's (or device's) GPU current for the block; restore the caller's on exit.

    Work issued inside runs on that device's current stream, because torch and Triton both launch
    on the current stream *of the current device*. No-op for the CPU and other non-GPU types.
    A tensor on the current GPU (the usual case) gets a reused no-op context: eager launch paths
    enter a guard per call, and the generator below costs a few us of host time each.
    """
    if isinstance(tensor_or_device, torch.Tensor) and tensor_or_device.is_cuda:
        index = tensor_or_device.get_device()
        if torch.cuda.current_device() == index:
            ctx = _NO_SWITCH.get(index)
            if ctx is None:
                ctx = _NO_SWITCH.setdefault(index, contextlib.nullcontext(torch.device("cuda", index)))
            return ctx
    return _switch_device(tensor_or_device)


@contextlib.contextmanager
def _switch_device(tensor_or_device: object) -> Iterator[torch.device]:
    dev = as_torch_device(tensor_or_device, argument="tensor_or_device")
    if dev.type not in _GPU_TYPES:
        yield dev
        return
    mod = torch.get_device_module(dev.type)
    previous = mod.current_device()
    if previous != dev.index:
        mod.set_device(dev.index)
    try:
        yield dev
    finally:
        if previous != dev.index:
            mod.set_device(previous)


def __getattr__(name: str):
    # Kernel repositories import only torch, triton and this module (docs/publishing.md): the
    # cached Triton launcher is reached from here, and imported (with triton) on first use only.
    if name == "CachedLaunch":
        from kernelhub.triton_launch import CachedLaunch

        return CachedLaunch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
