"""SwiGLU recognition, owned by this repository: whether a gate/up/down MLP that kernelhub found by
its shape really is SwiGLUMLP (`SwiGLUMLP.mismatch_reason`, `_recognise`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernelhub.hub import get_local_kernel
from kernelhub.matching import match_layer

kernel = get_local_kernel(Path(__file__).resolve().parents[1])
recognise = kernel._recognise
SwiGLUMLP = kernel.layers.SwiGLUMLP


class MLP(nn.Module):
    def __init__(self, act=None, attr="act_fn"):
        super().__init__()
        self.gate_proj = nn.Linear(8, 12, bias=False)
        self.up_proj = nn.Linear(8, 12, bias=False)
        self.down_proj = nn.Linear(12, 8, bias=False)
        if act is not None:
            setattr(self, attr, act)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Llama4LikeMLP(MLP):
    def forward(self, x):
        return self.down_proj(self.activation_fn(self.gate_proj(x)) * self.up_proj(x))


class ScaledMLP(MLP):
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x) * 0.5) * self.up_proj(x)) * 3.0


class SiLUActivation(nn.Module):  # transformers' name for it
    def forward(self, x):
        return F.silu(x)


class Swish(nn.Module):  # a swish may take a beta: not taken for SiLU by its name
    def forward(self, x):
        return x * torch.sigmoid(2.0 * x)


@pytest.mark.parametrize(("act", "silu"), [(nn.SiLU(), True), (F.silu, True), (SiLUActivation(), True),
                                           (nn.GELU(), False), (Swish(), False), (torch.sigmoid, False)])
def test_is_silu(act, silu):
    assert recognise.is_silu(act) is silu


def test_a_silu_gated_mlp_is_swiglu_whatever_holds_its_activation():
    assert SwiGLUMLP.mismatch_reason(MLP(nn.SiLU())) is None
    assert SwiGLUMLP.mismatch_reason(Llama4LikeMLP(nn.SiLU(), attr="activation_fn")) is None
    # F.silu as the activation: the same maths, so the kernel serves it (matched, nothing to report)
    assert SwiGLUMLP.mismatch_reason(MLP(F.silu)) is None
    assert match_layer(MLP(F.silu)).unsupported_reason is None


@pytest.mark.parametrize(
    ("module", "reason"),
    [
        (MLP(), "MLP has no act_fn (or activation_fn); SwiGLUMLP needs a SiLU gate"),
        (MLP(nn.GELU()), "act_fn is GELU, SwiGLUMLP needs SiLU"),
        (MLP(Swish()), "act_fn is Swish, SwiGLUMLP needs SiLU"),
        (ScaledMLP(nn.SiLU()), "ScaledMLP.forward computes something other than "
                               "down_proj(act_fn(gate_proj(x)) * up_proj(x))"),
        (nn.Linear(2, 2), "Linear has no gate_proj, up_proj, down_proj; SwiGLUMLP reads"),
    ],
)
def test_what_is_not_swiglu_says_why(module, reason):
    assert reason in SwiGLUMLP.mismatch_reason(module)


def test_kernelhub_asks_this_repository():
    """matching.py keeps no SwiGLU knowledge: the reason it reports is this package's."""
    for module in (MLP(nn.GELU()), ScaledMLP(nn.SiLU()), MLP(nn.SiLU())):
        assert match_layer(module).unsupported_reason == SwiGLUMLP.mismatch_reason(module)
