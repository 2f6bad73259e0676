"""The compiled configurations every benchmark times (kernelhub and its peers alike).

Shared by the benchmark scripts (bench_swiglu, bench_moe, bench_fp8, bench_model_slice) so that
each names, builds and steps its `torch.compile` configurations the same way.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

# COMPILE's words -> the configuration names the rows carry
COMPILE_MODES = {"default": "compiled", "reduce-overhead": "reduce-overhead"}


def compile_configs(script: str) -> list[str]:
    """The configurations COMPILE names (default both; "none": eager only); a SystemExit naming
    `script` for any other word."""
    out = []
    for c in (c for c in os.environ.get("COMPILE", "default,reduce-overhead").split(",") if c):
        if c == "none":
            continue
        if c not in COMPILE_MODES:
            raise SystemExit(f"{script}: COMPILE takes {', '.join(COMPILE_MODES)} or none, got {c!r}")
        out.append(COMPILE_MODES[c])
    return out


def compiled(fn: Callable, config: str) -> Callable:
    """torch.compile(fn, fullgraph=True) with static shapes; under reduce-overhead every call first
    marks a new CUDA-graph step (outputs of the previous replay may be overwritten)."""
    if config == "compiled":
        return torch.compile(fn, fullgraph=True, dynamic=False)
    graphed = torch.compile(fn, fullgraph=True, dynamic=False, mode="reduce-overhead")

    def stepped(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return graphed(*args, **kwargs)

    return stepped


def raise_recompile_limit(limit: int = 64) -> None:
    """Dynamo's recompile limit at least `limit` (a benchmark compiles once per shape and mode: an
    exhausted limit would fall back to eager silently)."""
    for knob in ("cache_size_limit", "recompile_limit"):  # (newer torch's name; the old one its alias)
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), limit))
