"""kernelhub: a kernel hub and capability-aware, per-module dispatch framework for PyTorch."""

from kernelhub.device import (
    CUDAProperties,
    Device,
    ROCmProperties,
    device_capability,
    device_guard,
    device_properties,
    module_device,
)
from kernelhub.mode import Mode

__all__ = [
    "CUDAProperties",
    "Device",
    "Mode",
    "ROCmProperties",
    "device_capability",
    "device_guard",
    "device_properties",
    "module_device",
]
