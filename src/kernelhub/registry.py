"""Kernel mappings: which repository provides a layer, per device (type, index, capability) and mode.

Resolution for one concrete device (type, index, capability):
1. entries for another device type, another index, or a capability range that excludes the
   device's capability never match;
2. an entry with the device's index beats an index-agnostic one;
3. among the rest, the narrowest capability range wins (an entry without a range is the widest);
4. within that entry the requested mode is looked up with Hugging Face `kernels`' priority
   (e.g. INFERENCE tries INFERENCE, INFERENCE|TORCH_COMPILE, TRAINING, ..., FALLBACK); if the
   entry has none of them, the next-best entry is tried.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from kernelhub.device import CUDAProperties, Device, ROCmProperties
from kernelhub.mode import MODE_PRIORITY, Mode

__all__ = [
    "Repository",
    "Resolution",
    "register_kernel_mapping",
    "use_kernel_mapping",
    "get_kernel_mapping",
    "mapping_in_effect",
    "resolve_repository",
]


@runtime_checkable
class Repository(Protocol):
    """Anything that can load a layer class: local directories, Hub repositories, locked ones."""

    layer_name: str

    def load(self) -> type[nn.Module]: ...


# the mode keys a request can reach (Mode.INFERENCE alone, TRAINING | TORCH_COMPILE, FALLBACK, ...)
_MAPPABLE_MODES = frozenset(m for modes in MODE_PRIORITY.values() for m in modes)

# layer name -> Device -> Mode -> Repository
KernelMapping = dict[str, dict[Device, dict[Mode, Any]]]

# The global mapping is a plain module attribute, not a ContextVar default: threads started by
# the user (data loaders, servers) begin with an empty context and would otherwise see no kernels.
_GLOBAL_MAPPING: KernelMapping = {}
# Set only inside `use_kernel_mapping` blocks.
_KERNEL_MAPPING: contextvars.ContextVar[KernelMapping | None] = contextvars.ContextVar(
    "_KERNEL_MAPPING", default=None
)


def _current() -> KernelMapping:
    scoped = _KERNEL_MAPPING.get()
    return _GLOBAL_MAPPING if scoped is None else scoped


def _is_repository(value: object) -> bool:
    # function repositories (FuncRepository, ...) name a function instead of a layer
    name = getattr(value, "layer_name", None)
    if name is None:
        name = getattr(value, "func_name", None)
    return callable(getattr(value, "load", None)) and isinstance(name, str)


def _parse_device_key(layer: str, key: object) -> Device:
    if isinstance(key, Device):
        return key
    if isinstance(key, str):
        # "rocm", "npu", "neuron" and "tpu" are mapping keys as in Hugging Face `kernels`, though
        # torch.device (without their plugins) knows none of them: "type" or "type:index" is parsed here.
        kind, _, index = key.partition(":")
        if kind in ("rocm", "npu", "neuron", "tpu") and (not index or index.isdigit()):
            return Device(kind, int(index) if index else None)
        try:
            dev = torch.device(key)
        except RuntimeError as e:
            raise ValueError(f"kernel mapping for {layer!r}: device key {key!r} is not a device") from e
        return Device(dev.type, dev.index)
    raise TypeError(
        f"kernel mapping for {layer!r}: device key must be a Device or str, got {type(key).__name__}"
    )


def _normalize(mapping: Mapping[str, Any]) -> KernelMapping:
    if not isinstance(mapping, Mapping):
        raise TypeError(f"kernel mapping must be a dict, got {type(mapping).__name__}")
    out: KernelMapping = {}
    for layer, per_device in mapping.items():
        if not isinstance(layer, str):
            raise TypeError(f"kernel mapping: layer name must be a str, got {layer!r}")
        if not isinstance(per_device, Mapping):
            raise TypeError(
                f"kernel mapping for {layer!r}: value must be a dict of devices, got {type(per_device).__name__}"
            )
        devices: dict[Device, dict[Mode, Any]] = {}
        for key, value in per_device.items():
            device = _parse_device_key(layer, key)
            if isinstance(value, Mapping):
                modes = {}
                for mode, repo in value.items():
                    if not isinstance(mode, Mode):
                        raise TypeError(
                            f"kernel mapping for {layer!r} on {device}: mode key must be a Mode, got {mode!r}"
                        )
                    if mode not in _MAPPABLE_MODES:  # e.g. TORCH_COMPILE alone: no request ever reaches it
                        raise ValueError(
                            f"kernel mapping for {layer!r} on {device}: mode key {mode} is never looked up; "
                            f"use one of {sorted(str(m) for m in _MAPPABLE_MODES)}"
                        )
                    if not _is_repository(repo):
                        raise TypeError(
                            f"kernel mapping for {layer!r} on {device} ({mode}): value must be a "
                            f"repository (LayerRepository, LocalLayerRepository, ...), got {type(repo).__name__}"
                        )
                    modes[mode] = repo
            elif _is_repository(value):
                modes = {Mode.FALLBACK: value}
            else:
                raise TypeError(
                    f"kernel mapping for {layer!r} on {device}: value must be a repository "
                    f"(LayerRepository, LocalLayerRepository, ...) or a dict of Mode -> repository, "
                    f"got {type(value).__name__}"
                )
            devices[device] = modes
        out[layer] = devices
    return out


def _merge(base: KernelMapping, update: KernelMapping) -> KernelMapping:
    merged = {layer: {dev: dict(modes) for dev, modes in devs.items()} for layer, devs in base.items()}
    for layer, devs in update.items():
        target = merged.setdefault(layer, {})
        for dev, modes in devs.items():
            target.setdefault(dev, {}).update(modes)
    return merged


def register_kernel_mapping(mapping: Mapping[str, Any], inherit_mapping: bool = True) -> None:
    """Add `mapping` to the global mapping, merging per (layer, device, mode).

    Inside a `use_kernel_mapping` block the block's mapping is updated too.
    """
    global _GLOBAL_MAPPING
    new = _normalize(mapping)
    _GLOBAL_MAPPING = _merge(_GLOBAL_MAPPING if inherit_mapping else {}, new)
    scoped = _KERNEL_MAPPING.get()
    if scoped is not None:
        _KERNEL_MAPPING.set(_merge(scoped if inherit_mapping else {}, new))


@contextlib.contextmanager
def use_kernel_mapping(mapping: Mapping[str, Any], *, inherit_mapping: bool = True) -> Iterator[None]:
    """Use `mapping` (merged into the current one unless inherit_mapping=False) inside the block."""
    new = _normalize(mapping)
    base = _current() if inherit_mapping else {}
    token = _KERNEL_MAPPING.set(_merge(base, new))
    try:
        yield
    finally:
        _KERNEL_MAPPING.reset(token)


def mapping_in_effect() -> object:
    """The mapping object in effect here: a new object whenever the mapping changes, so a cache
    of resolutions can tell, by identity, that it was made under another mapping."""
    return _current()


def get_kernel_mapping() -> KernelMapping:
    """A copy of the mapping in effect (for reports and debugging)."""
    return _merge({}, _current())


@dataclass(frozen=True)
class Resolution:
    """The outcome of a lookup: the repository and the entry that provided it, or why none did."""

    repository: Any | None
    device_key: Device | None
    mode: Mode | None
    reason: str | None


def _registry_type(device: torch.device) -> str:
    if device.type == "cuda" and torch.version.hip is not None:
        return "rocm"
    return device.type


def _matches(key: Device, dev_type: str, index: int | None, capability: int | None) -> bool:
    if key.type != dev_type:
        return False
    if key.index is not None and key.index != index:
        return False
    props = key.properties
    if props is None:
        return True
    if capability is None or not isinstance(props, (CUDAProperties, ROCmProperties)):
        return False
    return props.matches(capability)


def _rank(key: Device) -> tuple[int, int]:
    width = key.properties.width if key.properties is not None else 1 << 30
    return (0 if key.index is not None else 1, width)


def resolve_repository(
    layer_name: str, device: torch.device, capability: int | None, mode: Mode
) -> Resolution:
    """Pick the repository for `layer_name` on a concrete device, by the rules in this module's doc."""
    if mode not in MODE_PRIORITY:
        raise ValueError(f"resolve_repository: `mode` must be one of {list(MODE_PRIORITY)}, got {mode}")
    per_device = _current().get(layer_name)
    cap = f" (capability {capability})" if capability is not None else ""
    if not per_device:
        return Resolution(None, None, None, f"no kernel mapping for layer {layer_name!r}")
    dev_type = _registry_type(device)
    candidates = sorted(
        (k for k in per_device if _matches(k, dev_type, device.index, capability)), key=_rank
    )
    if not candidates:
        return Resolution(None, None, None, f"no {layer_name!r} kernel registered for {device}{cap}")
    for key in candidates:
        modes = per_device[key]
        for wanted in MODE_PRIORITY[mode]:
            if wanted in modes:
                return Resolution(modes[wanted], key, wanted, None)
    return Resolution(
        None, None, None, f"no {layer_name!r} kernel for mode {mode} on {device}{cap}"
    )
