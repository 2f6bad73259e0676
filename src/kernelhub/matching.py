"""Which layer a module is: by `kernel_layer_name`, or by shape for Hugging Face transformers v5.

transformers v5 sets no `kernel_layer_name` when Hugging Face `kernels` is not installed, so its
modules are found by shape (`BY_SHAPE`). Shape alone does not make a module the layer (an MLP with
another activation, or one that clamps on the way, has the shape of SwiGLUMLP): the kernel
repository that declares the layer knows, and says so through its layer class's
`mismatch_reason(module)` (kernels_repo/swiglu: the activation and the forward's maths; moe: a
forward that takes the routing, and 16-bit weights for MoEExperts, fp8 ones with block scales for
MoEExpertsFP8). This module holds no layer's knowledge beyond its shape.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["BY_SHAPE", "LayerMatch", "match_layer", "mismatch_reason"]


@dataclass(frozen=True)
class LayerMatch:
    layer_name: str
    # Set when the module looks like the layer but is not it (kernelize reports it and keeps it).
    unsupported_reason: str | None = None


def _stacked_experts(module: nn.Module) -> bool:
    """transformers v5 `*Experts`: stacked 3-D `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return (type(module).__name__.endswith("Experts") and isinstance(gate_up, nn.Parameter)
            and isinstance(down, nn.Parameter) and gate_up.dim() == 3 and down.dim() == 3)


def _fp8_stacked_experts(module: nn.Module) -> bool:
    """transformers `FP8Experts`: stacked experts with 8-bit weights (fp8, or fp4 packed in int8), or
    with `gate_up_proj_scale_inv` block scales beside them (checked before the 16-bit experts, which
    it would match too)."""
    if not _stacked_experts(module):
        return False
    return module.gate_up_proj.element_size() == 1 or isinstance(getattr(module, "gate_up_proj_scale_inv", None),
                                                                torch.Tensor)


def _gated_mlp(module: nn.Module) -> bool:
    """A gated MLP: `gate_proj`, `up_proj` and `down_proj` linears."""
    return all(isinstance(getattr(module, a, None), nn.Linear) for a in ("gate_proj", "up_proj", "down_proj"))


# The layers found by shape, first match wins: (layer name, shape). One line per such layer; the
# layer's kernel repository (kernels_repo/<name>, kernel.toml declares the layer) decides the rest.
BY_SHAPE: tuple[tuple[str, Callable[[nn.Module], bool]], ...] = (
    ("MoEExpertsFP8", _fp8_stacked_experts),
    ("MoEExperts", _stacked_experts),
    ("SwiGLUMLP", _gated_mlp),
)

_recognisers: dict[str, Callable[[nn.Module], str | None] | None] = {}
_recognisers_lock = threading.Lock()


def _refusal(why: str) -> Callable[[nn.Module], str]:
    return lambda module: why


def _recogniser(layer: str) -> Callable[[nn.Module], str | None] | None:
    """`mismatch_reason` of `layer`'s class in the bundled repository that declares it (loaded once)."""
    if layer not in _recognisers:
        from kernelhub.default_mapping import home_repository
        from kernelhub.hub import LocalLayerRepository

        home = home_repository(layer)
        check = None
        if home is not None:
            try:
                check = getattr(LocalLayerRepository(home, layer_name=layer).load(), "mismatch_reason", None)
            except Exception as e:  # noqa: BLE001 - unable to tell: keep such modules as they are
                check = _refusal(f"could not ask {home} whether it is {layer}: {type(e).__name__}: {e}")
        with _recognisers_lock:
            _recognisers[layer] = check if callable(check) else None
    return _recognisers[layer]


def mismatch_reason(layer: str, module: nn.Module) -> str | None:
    """Why `module`, found by shape, is not `layer` after all (its kernel repository's verdict), or None."""
    check = _recogniser(layer)
    return None if check is None else check(module)


def match_layer(module: nn.Module) -> LayerMatch | None:
    """The kernel layer `module` corresponds to, or None if it is not one we kernelize."""
    name = getattr(type(module), "kernel_layer_name", None) or getattr(module, "kernel_layer_name", None)
    if isinstance(name, str) and name:
        return LayerMatch(name)
    for layer, looks_like in BY_SHAPE:
        if looks_like(module):
            return LayerMatch(layer, mismatch_reason(layer, module))
    return None
