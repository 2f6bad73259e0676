"""kernelhub: a kernel hub and capability-aware, per-module dispatch framework for PyTorch."""

import importlib.metadata as _metadata

try:
    __version__ = _metadata.version("kernelhub")
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

from kernelhub.benchmark import Benchmark
from kernelhub.config import KernelhubConfig, load_config
from kernelhub.default_mapping import default_kernel_mapping
from kernelhub.deps import get_kernel_dep
from kernelhub.device import (
    CUDAProperties,
    Device,
    ROCMProperties,
    ROCmProperties,
    device_capability,
    device_guard,
    device_properties,
    module_device,
)
from kernelhub.errors import (
    AllocationSymmetryError,
    ConfigError,
    HubKernelNotFoundError,
    KernelHubError,
    KernelLockError,
    KernelNotFoundError,
    KernelVariantNotFoundError,
    KernelVersionNotFoundError,
    SymmetricHeapFullError,
    UntrustedKernelError,
    UntrustedKernelWarning,
)
from kernelhub.func import (
    FuncRepository,
    LocalFuncRepository,
    LockedFuncRepository,
    use_kernel_func_from_hub,
)
from kernelhub.hub import (
    LayerRepository,
    LocalLayerRepository,
    LockedLayerRepository,
    get_kernel,
    get_local_kernel,
    has_kernel,
)
from kernelhub.kernelize import KernelizeEntry, KernelizeReport, kernelize, kernelize_report, unkernelize
from kernelhub.layer import replace_kernel_forward_from_hub, use_kernel_forward_from_hub, use_kernelized_func
from kernelhub.load import (
    LoadedKernel,
    RepoInfo,
    get_kernel_variants,
    get_loaded_kernels,
    install_kernel,
    load_kernel,
)
from kernelhub.lock import get_locked_kernel
from kernelhub.metadata import Metadata
from kernelhub.mode import Mode
from kernelhub.registry import get_kernel_mapping, register_kernel_mapping, use_kernel_mapping
from kernelhub.variants import VariantAccepted, VariantRejected

__all__ = [
    "__version__",
    "AllocationSymmetryError",
    "Benchmark",
    "CUDAProperties",
    "ConfigError",
    "Device",
    "FuncRepository",
    "HubKernelNotFoundError",
    "KernelHubError",
    "KernelLockError",
    "KernelNotFoundError",
    "KernelVariantNotFoundError",
    "KernelVersionNotFoundError",
    "KernelizeEntry",
    "KernelhubConfig",
    "KernelizeReport",
    "LayerRepository",
    "LoadedKernel",
    "LocalFuncRepository",
    "LocalLayerRepository",
    "LockedFuncRepository",
    "LockedLayerRepository",
    "Metadata",
    "Mode",
    "ROCMProperties",
    "ROCmProperties",
    "RepoInfo",
    "SymmetricHeapFullError",
    "UntrustedKernelError",
    "UntrustedKernelWarning",
    "VariantAccepted",
    "VariantRejected",
    "default_kernel_mapping",
    "device_capability",
    "device_guard",
    "device_properties",
    "get_kernel",
    "get_kernel_dep",
    "get_kernel_mapping",
    "get_kernel_variants",
    "get_loaded_kernels",
    "get_local_kernel",
    "get_locked_kernel",
    "has_kernel",
    "install_kernel",
    "kernelize",
    "kernelize_report",
    "load_config",
    "load_kernel",
    "module_device",
    "register_kernel_mapping",
    "replace_kernel_forward_from_hub",
    "unkernelize",
    "use_kernel_forward_from_hub",
    "use_kernel_func_from_hub",
    "use_kernel_mapping",
    "use_kernelized_func",
]

register_kernel_mapping(default_kernel_mapping())

from kernelhub.integrations import transformers as _transformers_integration  # noqa: E402

_transformers_integration.install()
