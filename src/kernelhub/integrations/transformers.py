"""The transformers experts implementation "kernelhub".

`from_pretrained(..., experts_implementation="kernelhub")` routes every `*Experts` forward here;
each call resolves the `MoEExperts` kernel for the device of *its* hidden states, so a model
spread over GPUs of different generations gets the right kernel per layer.

Importing transformers' MoE integration costs seconds, so `import kernelhub` does not do it: it
registers at once if transformers is already imported and otherwise when it is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kernelhub.device import device_capability
from kernelhub.layer import layer_problem
from kernelhub.mode import Mode
from kernelhub.registry import resolve_repository

__all__ = ["EXPERTS_IMPLEMENTATION", "kernelhub_experts_forward", "register_experts_implementation"]

EXPERTS_IMPLEMENTATION = "kernelhub"
_MOE_MODULE = "transformers.integrations.moe"
_cache: dict[tuple[type, torch.device, Mode], Callable | None] = {}
_lock = threading.Lock()


def _eager_forward(module: nn.Module) -> Callable:
    forward = type(module).forward
    return getattr(forward, "__wrapped__", forward)


def _layer_for(module: nn.Module, device: torch.device, mode: Mode) -> Callable | None:
    key = (type(module), device, mode)
    if key in _cache:
        return _cache[key]
    capability = device_capability(device) if device.type == "cuda" else None
    resolution = resolve_repository("MoEExperts", device, capability, mode)
    forward = None
    if resolution.repository is not None:
        layer = resolution.repository.load()
        if layer_problem(layer, module, mode) is None:
            forward = layer.forward
    with _lock:
        _cache[key] = forward
    return forward


def kernelhub_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers experts forward: the MoEExperts kernel for hidden_states' device, else eager."""
    training = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters(recurse=False))
    mode = Mode.TRAINING if training else Mode.INFERENCE
    forward = _layer_for(self, hidden_states.device, mode)
    if forward is None:
        forward = _eager_forward(self)
    return forward(self, hidden_states, top_k_index, top_k_weights)


def register_experts_implementation() -> None:
    """Register "kernelhub" with transformers' ExpertsInterface (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, kernelhub_experts_forward)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Runs `register_experts_implementation` right after transformers' MoE module is imported."""

    def find_spec(self, fullname: str, path: Any, target: types.ModuleType | None = None):
        if fullname != _MOE_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            original_exec(module)
            register_experts_implementation()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Register now if transformers' MoE integration is loaded, else as soon as it is."""
    if _MOE_MODULE in sys.modules:
        register_experts_implementation()
    elif not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
