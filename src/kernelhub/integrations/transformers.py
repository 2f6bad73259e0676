"""The transformers experts implementation "kernelhub".

`from_pretrained(..., experts_implementation="kernelhub")` routes every `*Experts` forward here;
each call resolves the `MoEExperts` kernel for the device of *its* hidden states, so a model
spread over GPUs of different generations gets the right kernel per layer. Resolution is
kernelize's: the kernel mapping in effect at the call (a `use_kernel_mapping` block included), the
pins of `kernelhub.toml` / `[tool.kernelhub]` in the working directory, the layer's own checks; a
kernel that cannot be loaded or used leaves that module eager, with a warning.

transformers' `FP8Experts` (block-quantized fp8 checkpoints) have their own interface; "kernelhub"
there resolves the `MoEExpertsFP8` layer the same way (the default mapping: kernel.toml's
`[dispatch_fp8]`), and modules it cannot serve run their eager forward.

Importing transformers' MoE integration costs seconds, so `import kernelhub` does not do it: it
registers at once if transformers is already imported and otherwise when it is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kernelhub.config import load_config
from kernelhub.kernelize import choose_layer
from kernelhub.layer import layer_problem
from kernelhub.mode import Mode
from kernelhub.registry import mapping_in_effect

__all__ = [
    "EXPERTS_IMPLEMENTATION",
    "kernelhub_experts_forward",
    "kernelhub_fp8_experts_forward",
    "register_experts_implementation",
]

EXPERTS_IMPLEMENTATION = "kernelhub"
_MOE_MODULE = "transformers.integrations.moe"
_FP8_MODULE = "transformers.integrations.finegrained_fp8"
# (layer name, class, device, mode) -> (the mapping it was resolved under, layer class or None for eager)
_cache: dict[tuple[str, type, torch.device, Mode], tuple[object, type[nn.Module] | None]] = {}
_MAX_CACHED = 256  # each use_kernel_mapping block is a new mapping, so a new resolution
# in a module's __dict__: (id of the layer class, mode, whether it may serve the module); the id,
# not the class, so that pickling the model does not reference a dynamically loaded kernel module
_FITS = "_kernelhub_experts_fits"
_lock = threading.Lock()


def _eager_forward(module: nn.Module) -> Callable:
    forward = type(module).forward
    return getattr(forward, "__wrapped__", forward)


def _layer_for(module: nn.Module, device: torch.device, mode: Mode, layer_name: str = "MoEExperts") -> Callable | None:
    """The `layer_name` layer forward for this class, device and mode, resolved as kernelize does
    (mapping in effect, then the pins of the working directory's config, then the layer's checks);
    None: eager. Resolved again when the mapping in effect changes."""
    key = (layer_name, type(module), device, mode)
    hit = _cache.get(key)
    # While torch.compile traces, a resolution made earlier is used as it is: the mapping in effect
    # is a context variable, which Dynamo cannot read without breaking the graph (a compiled model
    # follows a later mapping change after `torch._dynamo.reset()`).
    mapping = None if hit is not None and torch.compiler.is_compiling() else mapping_in_effect()
    if hit is None or (mapping is not None and hit[0] is not mapping):
        choice = choose_layer(module, layer_name, device, mode, load_config(None))
        if choice.layer is None and choice.repository is not None:
            # found but unusable (a failed download, a layer that does not fit): say so, run eager
            warnings.warn(f"kernelhub experts implementation: {type(module).__name__} on {device} runs "
                          f"eager: {choice.reason}", RuntimeWarning, stacklevel=3)
        hit = (mapping, choice.layer)
        with _lock:
            if len(_cache) >= _MAX_CACHED:
                _cache.clear()
            _cache[key] = hit
        if choice.layer is not None:  # the module it was resolved with fits: remember that too
            module.__dict__[_FITS] = (id(choice.layer), mode, True)
    layer = hit[1]
    if layer is None:
        return None
    # The class-level answer was checked against one instance; another instance of the class may
    # not fit (other weight shapes, say): each module's own verdict, kept in the module.
    fits = module.__dict__.get(_FITS)
    if fits is None or fits[0] != id(layer) or fits[1] is not mode:
        fits = module.__dict__[_FITS] = (id(layer), mode, layer_problem(layer, module, mode) is None)
    return layer.forward if fits[2] else None


def _experts_forward(self: nn.Module, layer_name: str, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    training = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters(recurse=False))
    mode = Mode.TRAINING if training else Mode.INFERENCE
    forward = _layer_for(self, hidden_states.device, mode, layer_name)
    if forward is None:
        forward = _eager_forward(self)
    return forward(self, hidden_states, top_k_index, top_k_weights)


def kernelhub_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers experts forward: the MoEExperts kernel for hidden_states' device, else eager."""
    return _experts_forward(self, "MoEExperts", hidden_states, top_k_index, top_k_weights)


def kernelhub_fp8_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers FP8Experts forward: the MoEExpertsFP8 kernel for hidden_states' device, else eager.

    transformers' fp8 weights are Parameters that require grad: a forward with grad enabled resolves
    for TRAINING (the fp8 layers have a backward for the activations and routing weights)."""
    return _experts_forward(self, "MoEExpertsFP8", hidden_states, top_k_index, top_k_weights)


def register_experts_implementation() -> None:
    """Register "kernelhub" with transformers' ExpertsInterface, and with its FP8 experts interface
    where this transformers has one (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, kernelhub_experts_forward)
    if _FP8_MODULE in sys.modules:  # imported by transformers' quantizer when an FP8 model loads
        _register_fp8()


def _register_fp8() -> None:
    try:
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    except ImportError:  # a transformers without FP8 experts
        return
    ALL_FP8_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, kernelhub_fp8_experts_forward)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers right after `module` is imported (transformers' MoE or FP8 integration)."""

    def __init__(self, module: str, register: Callable[[], None]):
        self.module, self.register = module, register

    def find_spec(self, fullname: str, path: Any, target: types.ModuleType | None = None):
        if fullname != self.module:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module
        register = self.register

        def exec_module(module: types.ModuleType) -> None:
            original_exec(module)
            register()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Register now where transformers' MoE / FP8 integrations are loaded, else as soon as they are."""
    for module, register in ((_MOE_MODULE, register_experts_implementation), (_FP8_MODULE, _register_fp8)):
        if module in sys.modules:
            register()
        elif not any(isinstance(f, _RegisterOnImport) and f.module == module for f in sys.meta_path):
            sys.meta_path.insert(0, _RegisterOnImport(module, register))
