"""cProfile of n eager calls on the GPU machine, shared by the host-time scripts in tools/."""

import cProfile
import pstats
from collections.abc import Callable

import torch


def print_profile(step: Callable[[], object], n: int, top: int) -> None:
    """Profile n calls of step (after the GPU has caught up) and print the top entries by own time."""
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)
