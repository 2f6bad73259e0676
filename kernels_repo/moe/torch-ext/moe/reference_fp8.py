"""Torch reference of `fused_experts` on fp8 block-quantized expert weights, and the emulation
of the fp8 tensor-core kernels' activation quantization (what those kernels are judged against).

Weights: float8_e4m3fn values times the fp32 `scale_inv` of their 128x128 block (DeepSeek-V3,
transformers `FP8Experts`). Activations (the fp8 tensor-core path only): each token's row is
quantized per group of 128 columns, scale = amax / 448 (amax clamped below at 1e-4, so an
all-zero group has a finite scale), value = round-to-nearest-even e4m3fn of x * (448 / amax):
the input before the first GEMM and the SwiGLU output before the second. The W8A16 path (sm80)
and the CPU reference do not quantize activations: dequantized weights, then the plain experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._fp8_validate import BLOCK, validate_fp8_inputs

FP8_MAX = 448.0
AMAX_MIN = 1e-4  # an all-zero group's amax (DeepGEMM's clamp): finite scales, zeros stay zeros


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block_size=BLOCK,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [..., N, K] (fp8) x scale_inv [..., ceil(N/bn), ceil(K/bk)] per block, in `dtype`."""
    bn, bk = block_size
    n, k = weight.shape[-2:]
    s = scale_inv.to(dtype).repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return weight.to(dtype) * s


def quantize_blocks(weight: torch.Tensor, block_size=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, fp32 scale_inv) of a float weight [..., N, K], 128x128 blocks (edges partial),
    scale_inv = amax / 448 per block: how DeepSeek-V3 and transformers quantize checkpoints."""
    bn, bk = block_size
    *lead, n, k = weight.shape
    nb, kb = -(-n // bn), -(-k // bk)
    w = F.pad(weight.float(), (0, kb * bk - k, 0, nb * bn - n))
    blocks = w.reshape(*lead, nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=AMAX_MIN)
    q = (blocks * (FP8_MAX / amax)).to(torch.float8_e4m3fn).reshape(*lead, nb * bn, kb * bk)[..., :n, :k]
    return q.contiguous(), (amax / FP8_MAX).reshape(*lead, nb, kb).contiguous()


def quantize_rows(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 x, fp32 scale [R, ceil(C/group)]) of x [R, C], per row and group of columns."""
    r, c = x.shape
    g = -(-c // group)
    v = F.pad(x.float(), (0, g * group - c)).reshape(r, g, group)
    amax = v.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_MIN)
    q = (v * (FP8_MAX / amax)).to(torch.float8_e4m3fn).reshape(r, g * group)[:, :c]
    return q, (amax / FP8_MAX).reshape(r, g)


def fake_quantize_rows(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """x rounded through `quantize_rows` and back, in x's dtype (fp32 or fp64)."""
    q, s = quantize_rows(x, group)
    return (q.to(x.dtype) * s.to(x.dtype).repeat_interleave(group, dim=1)[:, : x.shape[1]]).to(x.dtype)


def fused_experts_fp8_reference(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    gate_up_proj_scale_inv: torch.Tensor,
    down_proj_scale_inv: torch.Tensor,
    block_size=BLOCK,
    quantize_activations: bool = False,
) -> torch.Tensor:
    """`fused_experts` on fp8 weights in torch: dequantized weights (fp32; fp64 for fp64 `x`).

    quantize_activations: also round x and the SwiGLU output per token and 128-column group to
    fp8 as the fp8 tensor-core kernels do (their emulation; not differentiable through the
    rounding). Without it: the CPU reference / the W8A16 kernels' math, differentiable in x and
    topk_weights. Ids outside [0, E) contribute nothing.
    """
    bs = validate_fp8_inputs(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv,
                             down_proj_scale_inv, block_size, False, fn="fused_experts_fp8_reference")
    return fp8_reference_unchecked(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv,
                                   down_proj_scale_inv, bs, quantize_activations)


def fp8_reference_unchecked(x, gate_up_proj, down_proj, topk_idx, topk_weights, gate_up_proj_scale_inv,
                            down_proj_scale_inv, block_size=BLOCK, quantize_activations: bool = False):
    """`fused_experts_fp8_reference` on checked inputs. Each routed expert's weights are dequantized
    on their own (one expert at a time in fp32, never all E: DeepSeek-V3's 256 experts dequantized
    at once would be ~44 GB per layer); the routed rows are read with `nonzero` (host syncs)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    inter = gate_up_proj.shape[1] // 2
    xc = x.to(compute)
    if quantize_activations:
        xc = fake_quantize_rows(xc.detach())
    out = torch.zeros(x.shape, dtype=compute, device=x.device)
    idx = topk_idx.to(torch.int64)
    routed = False
    for e in range(gate_up_proj.shape[0]):
        token, slot = torch.nonzero(idx == e, as_tuple=True)
        if token.numel() == 0:
            continue
        routed = True
        wgu = dequantize_blocks(gate_up_proj[e], gate_up_proj_scale_inv[e], block_size, compute)
        wd = dequantize_blocks(down_proj[e], down_proj_scale_inv[e], block_size, compute)
        gu = F.linear(xc[token], wgu)
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        if quantize_activations:
            h = fake_quantize_rows(h)
        y = F.linear(h, wd) * topk_weights[token, slot].to(compute)[:, None]
        out = out.index_add(0, token, y)
    if not routed:  # nothing routed: zeros still connected to x and topk_weights (zero gradients)
        out = out + (x[:0].sum() + topk_weights[:0].sum()).to(compute)
    return out.to(x.dtype)
