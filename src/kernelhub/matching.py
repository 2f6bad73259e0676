"""Which layer a module is: by `kernel_layer_name`, or by class for Hugging Face transformers v5.

transformers v5 sets no `kernel_layer_name` when Hugging Face `kernels` is not installed, so its
modules are recognised by shape: stacked-expert modules and SiLU-gated MLPs.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["LayerMatch", "match_layer"]

MOE_EXPERTS = "MoEExperts"
SWIGLU_MLP = "SwiGLUMLP"
_SILU_NAMES = {"SiLU", "SiLUActivation", "SwishActivation", "Swish"}


@dataclass(frozen=True)
class LayerMatch:
    layer_name: str
    # Set when the module looks like the layer but cannot use it (kernelize reports it).
    unsupported_reason: str | None = None


def _is_silu(act: object) -> bool:
    if isinstance(act, nn.SiLU):
        return True
    return type(act).__name__ in _SILU_NAMES


def match_layer(module: nn.Module) -> LayerMatch | None:
    """The kernel layer `module` corresponds to, or None if it is not one we kernelize."""
    name = getattr(type(module), "kernel_layer_name", None) or getattr(module, "kernel_layer_name", None)
    if isinstance(name, str) and name:
        return LayerMatch(name)
    cls_name = type(module).__name__
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if cls_name.endswith("Experts") and isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter):
        if gate_up.dim() == 3 and down.dim() == 3:
            return LayerMatch(MOE_EXPERTS)
    projections = [getattr(module, a, None) for a in ("gate_proj", "up_proj", "down_proj")]
    if all(isinstance(p, nn.Linear) for p in projections):
        act = getattr(module, "act_fn", None)
        if act is None:
            return LayerMatch(SWIGLU_MLP, f"{cls_name} has no act_fn; SwiGLUMLP needs a SiLU gate")
        if not _is_silu(act):
            return LayerMatch(SWIGLU_MLP, f"act_fn is {type(act).__name__}, SwiGLUMLP needs SiLU")
        return LayerMatch(SWIGLU_MLP)
    return None
