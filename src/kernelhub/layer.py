"""Marking modules as kernelizable, and checking that a layer class may replace a module's forward."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TypeVar

from torch import nn

from kernelhub.mode import Mode

__all__ = ["use_kernel_forward_from_hub", "layer_problem", "keyword_renames"]

M = TypeVar("M", bound=type[nn.Module])


def use_kernel_forward_from_hub(layer_name: str) -> Callable[[M], M]:
    """Class decorator: instances of the class are kernelized as layer `layer_name`."""
    if not isinstance(layer_name, str) or not layer_name:
        raise ValueError(f"use_kernel_forward_from_hub: `layer_name` must be a non-empty str, got {layer_name!r}")

    def decorate(cls: M) -> M:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"use_kernel_forward_from_hub: decorates nn.Module classes, got {cls!r}")
        cls.kernel_layer_name = layer_name
        return cls

    return decorate


def _forward_params(fn: Callable) -> list[inspect.Parameter]:
    fn = inspect.unwrap(fn)
    return list(inspect.signature(fn).parameters.values())[1:]  # drop self


def keyword_renames(layer: type, host: nn.Module) -> dict[str, str]:
    """{host's parameter name: the layer's} where the two forwards name a parameter differently.

    Layers are matched by their parameters' number and kinds, as Hugging Face `kernels` does
    (transformers MLPs call their input x, hidden_state or hidden_states); a caller that passes
    the input by the host's keyword still reaches the layer through this map.
    """
    try:
        pairs = zip(_forward_params(type(host).forward), _forward_params(layer.forward))
    except (TypeError, ValueError):
        return {}
    return {h.name: m.name for h, m in pairs
            if h.name != m.name and h.kind is not inspect.Parameter.POSITIONAL_ONLY}


def layer_problem(layer: object, host: nn.Module, mode: Mode) -> str | None:
    """Why `layer` cannot replace `host.forward` in `mode`, or None if it can.

    A layer must be a stateless nn.Module (its forward runs with the host as `self`, so any state
    of its own would be silently missing), take the parameters of the host's forward (number and
    kinds; names may differ, see `keyword_renames`), declare
    `has_backward = True` to be used for TRAINING and `can_torch_compile = True` for TORCH_COMPILE.
    """
    if not (isinstance(layer, type) and issubclass(layer, nn.Module)):
        return f"layer {layer!r} is not an nn.Module class"
    if layer.__init__ is not nn.Module.__init__:
        return f"layer {layer.__name__} defines __init__; kernel layers must be stateless"
    # The layer's own verdict first: it names the real difference (e.g. GPT-OSS weight layout).
    check = getattr(layer, "unsupported_reason", None)
    if callable(check):
        reason = check(host)
        if reason:
            return f"layer {layer.__name__}: {reason}"
    try:
        mine = _forward_params(layer.forward)
        theirs = _forward_params(type(host).forward)
    except (TypeError, ValueError):
        mine = theirs = []
    if [p.kind for p in mine] != [p.kind for p in theirs]:
        return (
            f"layer {layer.__name__}.forward{[p.name for p in mine]} does not match "
            f"{type(host).__name__}.forward{[p.name for p in theirs]}"
        )
    if Mode.TRAINING in mode and getattr(layer, "has_backward", False) is not True:
        return f"layer {layer.__name__} has no backward (has_backward is not True), mode is {mode}"
    if Mode.TORCH_COMPILE in mode and getattr(layer, "can_torch_compile", False) is not True:
        return f"layer {layer.__name__} does not support torch.compile (can_torch_compile is not True)"
    return None
