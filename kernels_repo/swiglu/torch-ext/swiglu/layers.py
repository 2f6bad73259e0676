"""Stateless layers whose `forward` replaces a host module's forward (kernelize binds it).

`self` inside each forward is the *host* module (a transformers LlamaMLP, Qwen3MLP, ...), so
these classes hold no state and read the host's `gate_proj`/`up_proj`/`down_proj`. The classes are
generated from kernel.toml's `[layers.<class>]` tables: the layer itself (`SiluAndMul`,
`SwiGLUMLP`) picks the variant from the input's device at call time; a variant class
(`SwiGLUMLPSm90`, `SwiGLUMLPSm80`, `SwiGLUMLPReference`, ...) forces its kernels on any device.

`mismatch_reason(module)` (on the SwiGLUMLP classes) says why a module kernelhub found by its shape
is not SwiGLU after all (another activation, other maths).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ._recognise import activation_of, is_silu, mlp_mismatch_reason
from ._variants import declared_layers
from .ops import swiglu, swiglu_packed


def _impl_now(impl: str | None) -> str | None:
    # Under a torch.func transform (vmap, grad, ...) no kernel can run (batched tensors have no
    # addresses): a layer then computes the same fp32 math through the torch reference.
    return "reference" if torch._C._are_functorch_transforms_active() else impl


def _silu_and_mul_forward(impl: str | None):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x[..., :I]) * x[..., I:] for a packed [..., 2I] input."""
        return swiglu_packed(x, impl=_impl_now(impl))

    return forward


def _mlp_forward(impl: str | None):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down_proj(silu(gate_proj(x)) * up_proj(x)), the host MLP's own computation."""
        found = activation_of(self)
        act = None if found is None else found[1]
        if act is not None and not is_silu(act):
            # another gated activation (e.g. gelu) on a module that names this layer: its semantics
            return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), impl=_impl_now(impl)))

    return forward


# per layer name: the forward of its classes (given the variant), and its recogniser if it has one
_FORWARDS: dict[str, Callable] = {"SiluAndMul": _silu_and_mul_forward, "SwiGLUMLP": _mlp_forward}
_MISMATCH: dict[str, Callable] = {"SwiGLUMLP": mlp_mismatch_reason}


def _layer_class(name: str, spec: dict) -> type[nn.Module]:
    layer = spec.get("layer", name)
    if layer not in _FORWARDS:
        raise ValueError(f"swiglu: kernel.toml declares [layers.{name}] of layer {layer!r}; "
                         f"layers.py has forwards for {sorted(_FORWARDS)}")
    attrs = {
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": spec.get("description", ""),
        "has_backward": spec["has_backward"],
        "can_torch_compile": spec["can_torch_compile"],
        "forward": _FORWARDS[layer](spec.get("variant")),
    }
    if layer in _MISMATCH:
        attrs["mismatch_reason"] = staticmethod(_MISMATCH[layer])
    return type(name, (nn.Module,), attrs)


def _define_layers() -> list[str]:
    """Module-level classes, one per [layers.<class>] table (so pickling and `layers.<name>` find them)."""
    names = []
    for name, spec in declared_layers():
        globals()[name] = _layer_class(name, spec)
        names.append(name)
    return names


__all__ = _define_layers()  # the layer classes, as kernel.toml lists them
