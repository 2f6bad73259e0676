"""Torch reference of `fused_experts`: the CPU path and the oracle of the tests.

Same math as transformers' `Qwen3MoeExperts.forward` (gate = first I rows of gate_up_proj[e],
up = last I rows, silu(gate) * up, then down_proj[e], weighted, summed per token), computed in
fp32 (or fp64 for fp64 inputs) and rounded once, differentiable by autograd. Ids outside
[0, E) (-1 or the EP sentinel E) contribute nothing. The per-expert loop reads each touched
expert's rows with `nonzero`, a host sync: fine for a reference, not for the GPU paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._experts_validate import validate_inputs


def fused_experts_reference(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """out[t] = sum_k w[t,k] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])), e = idx[t,k].

    Takes what `fused_experts` takes (checked the same way, but for the ids' range: ids outside
    [0, E) contribute nothing), float64 `x` included.

    Raises:
        TypeError: a non-tensor argument or an unsupported dtype.
        ValueError: shapes or devices are wrong.
    """
    validate_inputs(x, gate_up_proj, down_proj, topk_idx, topk_weights, False, fn="fused_experts_reference")
    return reference_unchecked(x, gate_up_proj, down_proj, topk_idx, topk_weights)


def reference_unchecked(x, gate_up_proj, down_proj, topk_idx, topk_weights) -> torch.Tensor:
    """`fused_experts_reference` on inputs already checked (by `fused_experts`)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    E = gate_up_proj.shape[0]
    inter = gate_up_proj.shape[1] // 2
    out = torch.zeros(x.shape, dtype=compute, device=x.device)
    idx = topk_idx.to(torch.int64)
    routed = False
    for e in range(E):
        token, slot = torch.nonzero(idx == e, as_tuple=True)
        if token.numel() == 0:
            continue
        routed = True
        xe = x[token].to(compute)
        gu = F.linear(xe, gate_up_proj[e].to(compute))
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        y = F.linear(h, down_proj[e].to(compute))
        y = y * topk_weights[token, slot].to(compute)[:, None]
        out = out.index_add(0, token, y)
    if not routed:  # no pair routed: zeros that still reach every input (zero gradients, as the kernels give)
        # sums of empty slices: exactly 0 whatever the inputs hold (0 * a sum is NaN beside an inf)
        link = x[:0].sum() + gate_up_proj[:0].sum() + down_proj[:0].sum() + topk_weights[:0].sum()
        out = out + link.to(compute)
    return out.to(x.dtype)
