"""kernelhub: a kernel hub and capability-aware, per-module dispatch framework for PyTorch."""

from kernelhub.config import KernelhubConfig, load_config
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
from kernelhub.hub import (
    LayerRepository,
    LocalLayerRepository,
    LockedLayerRepository,
    get_kernel,
    get_local_kernel,
    has_kernel,
)
from kernelhub.kernelize import KernelizeEntry, KernelizeReport, kernelize, unkernelize
from kernelhub.layer import use_kernel_forward_from_hub
from kernelhub.load import (
    LoadedKernel,
    RepoInfo,
    get_kernel_variants,
    get_loaded_kernels,
    install_kernel,
    load_kernel,
)
from kernelhub.lock import get_locked_kernel
from kernelhub.mode import Mode
from kernelhub.registry import get_kernel_mapping, register_kernel_mapping, use_kernel_mapping
from kernelhub.variants import VariantAccepted, VariantRejected

__all__ = [
    "CUDAProperties",
    "Device",
    "KernelizeEntry",
    "KernelhubConfig",
    "KernelizeReport",
    "LayerRepository",
    "LoadedKernel",
    "LocalLayerRepository",
    "LockedLayerRepository",
    "Mode",
    "ROCmProperties",
    "RepoInfo",
    "VariantAccepted",
    "VariantRejected",
    "default_kernel_mapping",
    "device_capability",
    "device_guard",
    "device_properties",
    "get_kernel",
    "get_kernel_mapping",
    "get_kernel_variants",
    "get_loaded_kernels",
    "get_local_kernel",
    "get_locked_kernel",
    "has_kernel",
    "install_kernel",
    "kernelize",
    "load_config",
    "load_kernel",
    "module_device",
    "register_kernel_mapping",
    "unkernelize",
    "use_kernel_forward_from_hub",
    "use_kernel_mapping",
]

register_kernel_mapping(default_kernel_mapping())

from kernelhub.integrations import transformers as _transformers_integration  # noqa: E402

_transformers_integration.install()
