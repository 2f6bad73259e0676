"""Torch reference in fp32: the CPU path (without the Triton interpreter) and the test oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, rounded once to the input dtype; autograd through torch. Contiguous,
    like the kernels' result (the product alone would keep a transposed input's layout)."""
    return (F.silu(gate.float()) * up.float()).contiguous().to(gate.dtype)


def swiglu_packed_reference(x: torch.Tensor) -> torch.Tensor:
    """`swiglu_reference` of the left (gate) and right (up) halves of the last dimension."""
    gate, up = x.chunk(2, dim=-1)
    return swiglu_reference(gate, up)


def swiglu_backward_reference(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) in fp32, rounded once: the closed form the kernels compute."""
    g, u, d = gate.float(), up.float(), dy.float()
    s = torch.sigmoid(g)
    dg = d * u * (s + g * s * (1 - s))
    du = d * g * s
    return dg.to(gate.dtype), du.to(up.dtype)
