"""Stateless layers whose `forward` replaces a host module's forward (kernelize binds it).

`self` inside each forward is the *host* module (a transformers LlamaMLP, Qwen3MLP, ...), so
these classes hold no state and read the host's `gate_proj`/`up_proj`/`down_proj`. The generic
layers pick the variant from the input's device at call time; the Sm90/Sm80 layers force theirs
on any CUDA GPU; the Reference layers use torch.
"""

from __future__ import annotations

import torch
from torch import nn

from .ops import swiglu, swiglu_packed

__all__ = [
    "SiluAndMul",
    "SiluAndMulSm90",
    "SiluAndMulSm80",
    "SiluAndMulReference",
    "SwiGLUMLP",
    "SwiGLUMLPSm90",
    "SwiGLUMLPSm80",
    "SwiGLUMLPReference",
]


def _is_silu(act: object) -> bool:
    # transformers' ACT2FN["silu"] is SiLUActivation; torch's is nn.SiLU
    return act is None or isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


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
        act = getattr(self, "act_fn", None)
        if act is None:  # Llama4TextMLP's name for it
            act = getattr(self, "activation_fn", None)
        if not _is_silu(act):
            # another gated activation (e.g. gelu): keep the host's semantics
            return self.down_proj(act(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), impl=_impl_now(impl)))

    return forward


class SiluAndMul(nn.Module):
    """Packed SwiGLU; variant chosen by the input's device capability at call time."""

    has_backward = True
    can_torch_compile = True
    forward = _silu_and_mul_forward(None)


class SiluAndMulSm90(nn.Module):
    """Packed SwiGLU, the sm90 (persistent) Triton kernels on any CUDA GPU."""

    has_backward = True
    can_torch_compile = True
    forward = _silu_and_mul_forward("sm90")


class SiluAndMulSm80(nn.Module):
    """Packed SwiGLU, the sm80 (one tile per program) Triton kernels on any CUDA GPU."""

    has_backward = True
    can_torch_compile = True
    forward = _silu_and_mul_forward("sm80")


class SiluAndMulReference(nn.Module):
    """Packed SwiGLU in torch (fp32 math, one rounding)."""

    has_backward = True
    can_torch_compile = True
    forward = _silu_and_mul_forward("reference")


class SwiGLUMLP(nn.Module):
    """A SiLU-gated MLP's forward; variant chosen by the input's device capability at call time."""

    has_backward = True
    can_torch_compile = True
    forward = _mlp_forward(None)


class SwiGLUMLPSm90(nn.Module):
    """A SiLU-gated MLP's forward with the sm90 Triton kernels on any CUDA GPU."""

    has_backward = True
    can_torch_compile = True
    forward = _mlp_forward("sm90")


class SwiGLUMLPSm80(nn.Module):
    """A SiLU-gated MLP's forward with the sm80 Triton kernels on any CUDA GPU."""

    has_backward = True
    can_torch_compile = True
    forward = _mlp_forward("sm80")


class SwiGLUMLPReference(nn.Module):
    """A SiLU-gated MLP's forward in torch."""

    has_backward = True
    can_torch_compile = True
    forward = _mlp_forward("reference")
