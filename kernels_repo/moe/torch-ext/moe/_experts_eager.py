"""The eager path of `fused_experts`: replay, checks, then the reference, the autograd Function or
the inference pipeline (recorded for replay on a key's second call).

Also the body of the custom inference op that torch.compile calls (`_experts_custom_ops`), so
that a compiled graph replays recorded launches as an eager call does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernelhub.device import CachedLaunch, device_guard

from . import _experts_autograd as autograd
from . import _experts_pipeline as pipeline
from . import _experts_replay as replay
from . import _experts_validate as checks
from . import _gluon_gemm as gluon_gemm
from .reference_experts import reference_unchecked


def run(x, gate_up_proj, down_proj, topk_idx, topk_weights, variant: str | None, config: dict | None,
        check_indices: bool, default_variant: Callable[[torch.device], str] | None = None) -> torch.Tensor:
    """`fused_experts` outside torch.compile tracing; `variant` None: `default_variant(x.device)`,
    asked only after a replay miss and the checks (a replayed call never asks)."""
    # Inference with the shipped buckets: a call whose key was recorded replays its launches; the
    # key covers everything the checks below depend on but the ids' values (see _experts_replay).
    key = replay.replay_key(x, gate_up_proj, down_proj, topk_idx, topk_weights, variant) if config is None else None
    plan = replay.recorded(key) if key is not None else None
    if plan is not None:
        if check_indices:
            checks.check_ids(x, topk_idx, gate_up_proj.shape[0])
            check_indices = False  # done, also for the ordinary path below (a misaligned address)
        with device_guard(x):
            out = replay.replay(plan, (x, gate_up_proj, down_proj, topk_idx, topk_weights))
        if out is not None:
            return out
    checks.validate_inputs(x, gate_up_proj, down_proj, topk_idx, topk_weights, check_indices)
    checks.check_config(config)  # on every variant, the reference too
    dev = x.device
    variant = checks.checked_variant(x, default_variant(dev) if variant is None else variant)
    if variant == "reference":
        return reference_unchecked(x, gate_up_proj, down_proj, topk_idx, topk_weights)
    if any(checks.inner_offset_too_large(t) for t in (x, gate_up_proj, down_proj)):
        # offsets within a row of x / an expert's weights are 32-bit in the kernels: a view whose
        # inner strides reach past 2**31 elements (e.g. a transposed x of > 2**31) runs on copies,
        # never recorded for replay (the copies are not the caller's tensors)
        x, gate_up_proj, down_proj = (t.contiguous() if checks.inner_offset_too_large(t) else t
                                      for t in (x, gate_up_proj, down_proj))
        key = None
    if torch._C._are_functorch_transforms_active():
        raise ValueError(f"{checks.FN}: torch.func transforms (vmap, grad, ...) are not supported by variant "
                         f"{variant!r} (its kernels read raw addresses); use variant='reference'")
    T, H = x.shape
    if T == 0:  # nothing to route; keep autograd connected (zero gradients) without reading weights
        link = x.sum() + gate_up_proj.reshape(-1)[:1].sum() + down_proj.reshape(-1)[:1].sum()
        return x.new_zeros(0, H) + 0 * (link + topk_weights.sum()).to(x.dtype)
    E, two_i, _ = gate_up_proj.shape
    cfg = pipeline.bucket(variant, E, H, two_i // 2, topk_idx.numel(), config, dev, x.element_size())
    if checks.needs_grad(x, gate_up_proj, down_proj, topk_weights):
        return autograd.apply(x, gate_up_proj, down_proj, topk_idx, topk_weights, variant, cfg)
    with device_guard(x):
        if key is None or not replay.should_record(key):
            return pipeline.infer(x, gate_up_proj, down_proj, topk_idx, topk_weights, variant, cfg)
        launched = gluon_gemm.launches[0]  # (Gluon GEMMs: never replayed, see _gluon_gemm.launches)
        with CachedLaunch.recording() as calls:  # the second call of a replay key
            out = pipeline.infer(x, gate_up_proj, down_proj, topk_idx, topk_weights, variant, cfg)
    if gluon_gemm.launches[0] != launched:  # (not recorded: another thread's launch also refuses, safely)
        replay.refuse(key)
    else:
        replay.remember(key, calls, (x, gate_up_proj, down_proj, topk_idx, topk_weights), out)
    return out
