"""The kernelize mode: what the kernelized model will be used for."""

from __future__ import annotations

from enum import Flag, auto

__all__ = ["Mode"]


class Mode(Flag):
    """INFERENCE or TRAINING, optionally combined with TORCH_COMPILE; FALLBACK stands alone.

    FALLBACK is the mode of a mapping entry that applies to every mode; it cannot be requested
    together with anything else, and INFERENCE and TRAINING exclude each other.
    """

    _NONE = 0
    FALLBACK = auto()
    TRAINING = auto()
    INFERENCE = auto()
    TORCH_COMPILE = auto()

    def __or__(self, other: Mode) -> Mode:
        union = super().__or__(other)
        if Mode.INFERENCE in union and Mode.TRAINING in union:
            raise ValueError(
                "Mode: Mode.INFERENCE and Mode.TRAINING are mutually exclusive "
                "(INFERENCE and TRAINING cannot be combined)"
            )
        if Mode.FALLBACK in union and union != Mode.FALLBACK:
            raise ValueError("Mode: Mode.FALLBACK cannot be combined with other modes")
        return union


# For a requested mode, the mapping entries to try, best first (as Hugging Face `kernels`).
MODE_PRIORITY: dict[Mode, list[Mode]] = {
    Mode.INFERENCE: [
        Mode.INFERENCE,
        Mode.INFERENCE | Mode.TORCH_COMPILE,
        Mode.TRAINING,
        Mode.TRAINING | Mode.TORCH_COMPILE,
        Mode.FALLBACK,
    ],
    Mode.TRAINING: [Mode.TRAINING, Mode.TRAINING | Mode.TORCH_COMPILE, Mode.FALLBACK],
    Mode.INFERENCE | Mode.TORCH_COMPILE: [
        Mode.INFERENCE | Mode.TORCH_COMPILE,
        Mode.TRAINING | Mode.TORCH_COMPILE,
        Mode.FALLBACK,
    ],
    Mode.TRAINING | Mode.TORCH_COMPILE: [Mode.TRAINING | Mode.TORCH_COMPILE, Mode.FALLBACK],
}
