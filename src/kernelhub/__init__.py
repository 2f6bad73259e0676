"""kernelhub: a kernel hub and capability-aware, per-module dispatch framework for PyTorch."""

from kernelhub.default_mapping import default_kernel_mapping
from kernelhub.device import (
    CUDAProperties,
    Device,
    ROCmProperties,
    device_capability,
    device_guard,
    device_properties,
    module_device,
)
from kernelhub.hub import LocalLayerRepository, get_local_kernel
from kernelhub.kernelize import KernelizeEntry, KernelizeReport, kernelize, unkernelize
from kernelhub.layer import use_kernel_forward_from_hub
from kernelhub.mode import Mode
from kernelhub.registry import get_kernel_mapping, register_kernel_mapping, use_kernel_mapping

__all__ = [
    "CUDAProperties",
    "Device",
    "KernelizeEntry",
    "KernelizeReport",
    "LocalLayerRepository",
    "Mode",
    "ROCmProperties",
    "default_kernel_mapping",
    "device_capability",
    "device_guard",
    "device_properties",
    "get_kernel_mapping",
    "get_local_kernel",
    "kernelize",
    "module_device",
    "register_kernel_mapping",
    "unkernelize",
    "use_kernel_forward_from_hub",
    "use_kernel_mapping",
]

register_kernel_mapping(default_kernel_mapping())

from kernelhub.integrations import transformers as _transformers_integration  # noqa: E402

_transformers_integration.install()
