"""SwiGLU (silu(gate) * up) Triton kernels for sm90 and sm80, with a torch reference."""

from . import layers
from .ops import IMPLS, swiglu, swiglu_packed

__all__ = ["IMPLS", "layers", "swiglu", "swiglu_packed"]
