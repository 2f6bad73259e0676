"""MoE routing entry points (names and semantics of DeepSeek TileKernels `tile_kernels.moe`).

Each entry point: validate -> allocate on the input's device -> `device_guard(input)` -> choose a
config by that device's capability -> launch. CPU tensors run the torch reference, or the Triton
kernels under `TRITON_INTERPRET=1`. Mapping tensors are int32, as in TileKernels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kernelhub.device import CachedLaunch, device_guard

from . import _routing_checks as _c
from . import _routing_kernels as _k
from . import reference_routing as _ref

__all__ = [
    "topk_gate",
    "normalize_weight",
    "group_count",
    "aux_fi",
    "mask_indices_by_tp",
    "inplace_unique_group_indices",
    "get_fused_mapping",
    "expand_to_fused",
    "reduce_fused",
    "set_num_sms",
    "get_num_sms",
]

# Every kernel through a cached launcher: Triton's own `kernel[grid](...)` costs tens of us of
# Python per launch, more than these kernels take on the GPU at decode and prefill sizes.
_launch = {name: CachedLaunch(getattr(_k, name)) for name in dir(_k) if name.endswith("_kernel")}


def _index(t: Tensor) -> int:
    """The device index a launch is for (-1 on the CPU: the interpreter takes Triton's path)."""
    return t.device.index if t.is_cuda else -1


set_num_sms = _c.set_num_sms
get_num_sms = _c.get_num_sms
_MAX_EXPERTS = 8192  # histogram and prefix-sum vectors are next_pow2(E + 1) wide per program


# Plain-Python twins of triton.cdiv / next_power_of_2: those go through Triton's JIT call path
# (about 8 us each on the host), which the graph-free launch path cannot afford.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def topk_gate(scores: Tensor, num_topk: int) -> Tensor:
    """int64 [T, K] indices of the K largest scores per row; ties go to the smaller index.

    Args:
        scores: [T, E] float32, any strides. NaN ranks above every number (as in torch.topk),
            so a row's NaN scores are picked first, by index; ids are always in [0, E).
        num_topk: 1 <= K <= E.
    """
    fn = "topk_gate"
    _c.check_tensor(fn, "scores", scores, ndim=2, dtypes=(torch.float32,))
    t, e = scores.shape
    _c.check_int(fn, "num_experts (scores.shape[1])", e, minimum=1, maximum=_MAX_EXPERTS)
    _c.check_int(fn, "num_topk", num_topk, minimum=1, maximum=e)
    if not _c.use_triton(scores):
        return _ref.topk_gate_ref(scores, num_topk)
    out = torch.empty((t, num_topk), dtype=torch.int64, device=scores.device)
    if t == 0:
        return out
    scores = _c.int32_columns(scores)
    e_pow2 = _pow2(e)
    block_t = max(1, min(16, 4096 // e_pow2))  # <= 32 scores per thread (register pressure)
    with device_guard(scores):
        _launch["_topk_gate_kernel"](
            (_cdiv(t, block_t),), _index(scores), scores, out, t, e, scores.stride(0), scores.stride(1),
            K=num_topk, BLOCK_T=block_t, E_POW2=e_pow2, num_warps=4,
        )
    return out


def normalize_weight(topk_weights: Tensor) -> tuple[Tensor, Tensor]:
    """(denominator [T], normalized [T, K]) with denominator = 1e-20 + sum_k w[:, k], in k order.

    Args:
        topk_weights: [T, K] float32, any strides. Where it requires grad (and grad mode is on) the
            torch reference runs, so the results carry the gradient (the kernel builds no graph).
    """
    fn = "normalize_weight"
    w = _c.check_tensor(fn, "topk_weights", topk_weights, ndim=2, dtypes=(torch.float32,))
    if not _c.use_triton(w) or _c.needs_grad(w):  # (the reference is differentiable)
        return _ref.normalize_weight_ref(w)
    w = _c.int32_columns(w)
    t, k = w.shape
    denom = torch.empty((t,), dtype=torch.float32, device=w.device)
    out = torch.empty((t, k), dtype=torch.float32, device=w.device)
    if t == 0:
        return denom, out
    block_t = 128
    with device_guard(w):
        _launch["_normalize_weight_kernel"](
            (_cdiv(t, block_t),), _index(w), w, denom, out, t, w.stride(0), w.stride(1),
            K=k, BLOCK_T=block_t, num_warps=4,
        )
    return denom, out


def _count(fn: str, name: str, idx: Tensor, num_groups: int, what: str) -> Tensor:
    """int32 [num_groups] histogram of ids >= 0; ids < -1 or >= num_groups fail loudly."""
    flat = idx.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    buf = torch.zeros((num_groups + 1,), dtype=torch.int32, device=idx.device)
    numel = flat.numel()
    if numel == 0:
        return buf[:num_groups]
    cfg, sms = _c.select_config(idx.device)
    block = 1024
    grid = min(_cdiv(numel, block), cfg.hist_programs_per_sm * sms)
    with device_guard(idx):
        _launch["_group_count_kernel"](
            (grid,), _index(idx), flat, buf, numel, num_groups, BLOCK=block, NB=_pow2(num_groups + 1),
            num_warps=4,
        )
        # No host sync here (graph capturable): the last slot counts invalid ids.
        _c.assert_async(fn, buf[num_groups] == 0,
                        f"`{name}` holds {what} ids < -1 or >= {num_groups}")
    return buf[:num_groups]


def group_count(group_idx: Tensor, num_groups: int) -> Tensor:
    """int32 [num_groups]: how many entries of group_idx equal each group; -1 entries ignored.

    Args:
        group_idx: [T, K] int32/int64 with entries in [-1, num_groups).
        num_groups: >= 1.
    """
    fn = "group_count"
    _c.check_tensor(fn, "group_idx", group_idx, ndim=2, dtypes=_c._INT_DTYPES)
    _c.check_int(fn, "num_groups", num_groups, minimum=1, maximum=_MAX_EXPERTS)
    if not _c.use_triton(group_idx):
        _c.check_ids_host(fn, "group_idx", group_idx, num_groups, "group")
        return _ref.group_count_ref(group_idx, num_groups)
    return _count(fn, "group_idx", group_idx, num_groups, "group")


def aux_fi(topk_idx: Tensor, num_experts: int, num_aux_topk: int) -> Tensor:
    """float32 [E] load-balance frequency f_i = count[e] * E / (T * num_aux_topk).

    Args:
        topk_idx: [T, K] int32/int64 with entries in [-1, E).
        num_experts: E >= 1.
        num_aux_topk: >= 1, the top-k the auxiliary loss normalises by.
    """
    fn = "aux_fi"
    _c.check_tensor(fn, "topk_idx", topk_idx, ndim=2, dtypes=_c._INT_DTYPES)
    _c.check_int(fn, "num_experts", num_experts, minimum=1, maximum=_MAX_EXPERTS)
    _c.check_int(fn, "num_aux_topk", num_aux_topk, minimum=1)
    if not _c.use_triton(topk_idx):
        _c.check_ids_host(fn, "topk_idx", topk_idx, num_experts, "expert")
        return _ref.aux_fi_ref(topk_idx, num_experts, num_aux_topk)
    t = topk_idx.shape[0]
    if t == 0:
        return torch.zeros((num_experts,), dtype=torch.float32, device=topk_idx.device)
    counts = _count(fn, "topk_idx", topk_idx, num_experts, "expert")
    with device_guard(topk_idx):
        # Same expression as the reference, so the result is bit-identical to it.
        return counts.float() * num_experts / (t * num_aux_topk)


def mask_indices_by_tp(indices: Tensor, n: int, num_ep_ranks: int, tp_rank: int,
                       num_tp_ranks: int) -> Tensor:
    """Keep expert ids owned by TP rank `tp_rank`, renumbered to its local range; others -1.

    TileKernels' layout: n experts in num_ep_ranks slices of per_gpu = n // num_ep_ranks; slice s
    belongs to TP rank s % num_tp_ranks, and a rank's slices are numbered consecutively.

    Args:
        indices: [T, K] int32/int64 expert ids in [-1, n) (-1 stays -1). Others raise: ValueError
            on the reference path; on Triton's, without a host sync, a device-side assert
            (RuntimeError in the interpreter), after a launch that maps them to -1.
        n: total experts, a multiple of num_ep_ranks.
        num_ep_ranks, num_tp_ranks: >= 1; tp_rank in [0, num_tp_ranks).
    """
    fn = "mask_indices_by_tp"
    _c.check_tensor(fn, "indices", indices, ndim=2, dtypes=_c._INT_DTYPES)
    _c.check_int(fn, "num_ep_ranks", num_ep_ranks, minimum=1)
    _c.check_int(fn, "n", n, minimum=num_ep_ranks, maximum=_c.INT32_MAX)
    if n % num_ep_ranks:
        raise ValueError(f"{fn}: `n` ({n}) must be a multiple of `num_ep_ranks` ({num_ep_ranks})")
    _c.check_int(fn, "num_tp_ranks", num_tp_ranks, minimum=1)
    _c.check_int(fn, "tp_rank", tp_rank, minimum=0, maximum=num_tp_ranks - 1)
    if not _c.use_triton(indices):
        _c.check_ids_host(fn, "indices", indices, n, "expert")
        return _ref.mask_indices_by_tp_ref(indices, n, num_ep_ranks, tp_rank, num_tp_ranks)
    src = indices.contiguous()
    out = torch.empty_like(src)
    numel = src.numel()
    if numel == 0:
        return out
    per_gpu = n // num_ep_ranks
    block = 1024
    valid = torch.ones(1, dtype=torch.int32, device=indices.device)
    with device_guard(indices):
        _launch["_mask_indices_by_tp_kernel"](
            (_cdiv(numel, block),), _index(indices), src, out, valid, numel, n, per_gpu,
            num_tp_ranks * per_gpu, num_tp_ranks, tp_rank, BLOCK=block,
        )
    _c.assert_async(fn, valid, f"`indices` holds an expert id outside [-1, {n}) (n = {n})")
    return out


def inplace_unique_group_indices(group_indices: Tensor, num_groups: int) -> None:
    """In place: a group id repeated within a row becomes -1; its first occurrence stays.

    Args:
        group_indices: [T, K] int32/int64, any strides; modified in place.
        num_groups: >= 1 (kept for TileKernels signature parity).
    """
    fn = "inplace_unique_group_indices"
    g = _c.check_tensor(fn, "group_indices", group_indices, ndim=2, dtypes=_c._INT_DTYPES)
    _c.check_int(fn, "num_groups", num_groups, minimum=1)
    _c.check_no_self_overlap(fn, "group_indices", g)
    if not _c.use_triton(g):
        _ref.inplace_unique_group_indices_ref(g, num_groups)
        return
    t, k = g.shape
    if t == 0 or k <= 1:
        return
    work = _c.int32_columns(g)  # (a copy, written back below, where columns need 64-bit offsets)
    block_t = 256
    with device_guard(g):
        _launch["_unique_group_kernel"](
            (_cdiv(t, block_t),), _index(work), work, t, work.stride(0), work.stride(1), K=k, BLOCK_T=block_t,
        )
    if work is not g:
        g.copy_(work)



# ----------------------------------------------------------------------------------------------
# fused (expert-major) layout
# ----------------------------------------------------------------------------------------------


def _upper_bound_pos(numel: int, num_experts: int, alignment: int) -> int:
    """Largest P any routing can need: sum_e align(c_e) <= numel + (alignment - 1) * E."""
    return (numel + (alignment - 1) * num_experts) // alignment * alignment


class _Mapping(NamedTuple):
    pos_to_expert: Tensor
    pos_to_token: Tensor
    pos_to_token_topk: Tensor
    token_topk_to_pos: Tensor
    expert_start: Tensor
    expert_end: Tensor
    meta: Tensor  # [aligned count per expert (E), invalid ids, P needed, 1 if both fine]
    counts: Tensor  # real (unaligned) rows per expert [E]


def _int32_views(sizes: tuple[int, ...], device: torch.device) -> list[Tensor]:
    """int32 views of these sizes over one allocation, each starting 16-byte aligned."""
    chunks = []
    for size in sizes:
        chunks += (size, -size % 4)
    return torch.empty((sum(chunks),), dtype=torch.int32, device=device).split_with_sizes(chunks)[::2]


def _mapping(topk_idx: Tensor, num_experts: int, num_pos: int, alignment: int) -> _Mapping:
    """The three mapping launches on topk_idx's device, unchecked (callers validate).

    Ids outside [0, num_experts) are dropped (no row, position -1) and counted in `meta`; rows past
    `num_pos` are never written. `fused_experts` calls this directly: a bound P that always fits,
    and dropping rather than asserting on out-of-range ids (the EP sentinel of transformers).
    """
    t, k = topk_idx.shape
    numel = t * k
    dev = topk_idx.device
    cfg, sms = _c.select_config(dev)
    e1 = num_experts + 1
    sub = cfg.map_sub
    nsub_total = max(1, _cdiv(numel, sub))
    n_tiles = min(nsub_total, cfg.map_programs_per_sm * sms)
    nsub = _cdiv(nsub_total, n_tiles)
    n_tiles = _cdiv(nsub_total, nsub)
    # One allocation for every int32 output and scratch (each torch.empty costs host time):
    # 3 x P position arrays | T*K inverse | start E | end E | meta E+3 | tile counts | totals.
    sizes = (num_pos, num_pos, num_pos, numel, num_experts, num_experts, num_experts + 3,
             n_tiles * e1, e1)
    # split_with_sizes: one C++ call for the nine views (Tensor.split's Python wrapper costs ~30 us
    # of host time here, nine slices about twice this). Each view starts 16-byte aligned (a gap
    # after each one): a launch with a misaligned pointer takes CachedLaunch's slower path, and its
    # replay (fused_experts inference) is refused.
    (pos_to_expert, pos_to_token, pos_to_token_topk, inverse, expert_start, expert_end, meta,
     tile_counts, totals) = _int32_views(sizes, dev)
    src = topk_idx if topk_idx.is_contiguous() else topk_idx.contiguous()
    nb = _pow2(e1)
    index = _index(topk_idx)
    with device_guard(topk_idx):
        # split launches: (tensors, ints, constexprs) in the kernels' order, a cheaper host key
        _launch["_map_count_kernel"].split(
            (n_tiles,), index, (src, tile_counts, pos_to_expert, pos_to_token, pos_to_token_topk),
            (numel, num_experts, num_pos, nsub, _cdiv(num_pos, n_tiles)),
            (sub, nb, 1024), num_warps=cfg.map_warps,  # SUB, NB, FILL_BLOCK
        )
        block_e = 16
        _launch["_map_scan_kernel"].split(
            (_cdiv(e1, block_e),), index, (tile_counts, totals), (n_tiles, e1), (128, block_e),  # BLOCK_T, BLOCK_E
            num_warps=4,
        )
        _launch["_map_scatter_kernel"].split(
            (n_tiles,), index,
            (src, tile_counts, totals, meta, pos_to_expert, pos_to_token, pos_to_token_topk, inverse,
             expert_start, expert_end),
            (numel, num_experts, num_pos, nsub, alignment, max(k, 1)), (sub, nb), num_warps=cfg.map_warps,
        )
    return _Mapping(pos_to_expert, pos_to_token, pos_to_token_topk, inverse.view(t, k), expert_start,
                    expert_end, meta, totals[:num_experts])


def get_fused_mapping(
    topk_idx: Tensor,
    num_experts: int,
    num_expanded_tokens: int,
    alignment: int,
    force_no_sync: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, list[int]]:
    """Map (token, k) pairs to rows of an expert-major buffer of P rows, and back.

    Expert e owns rows [expert_start[e], expert_end[e]) of length align(count_e, alignment),
    ranges contiguous in expert order; its real rows come first, in token order, then padding
    rows holding -1 in pos_to_expert/pos_to_token/pos_to_token_topk.

    Args:
        topk_idx: [T, K] int32/int64 expert ids in [-1, E); -1 means "no expert".
        num_experts: E, 1..8192.
        num_expanded_tokens: P. 0 (and not force_no_sync): P is computed exactly with one host
            sync and the list output is filled. 0 with force_no_sync: P is the upper bound
            (T*K + (alignment-1)*E rounded down to alignment), no sync. > 0: that P, no sync
            (CUDA-graph capturable); a P too small for the routing is never written past, and
            fails loudly via a device-side assert (RuntimeError on the CPU).
        alignment: >= 1, rows per expert are padded to a multiple of it.
        force_no_sync: see num_expanded_tokens.

    Returns:
        (pos_to_expert [P], pos_to_token [P], pos_to_token_topk [P] (= t*K + k),
        token_topk_to_pos [T, K] (-1 where topk_idx is -1), expert_start [E], expert_end [E],
        num_tokens_per_expert [E] (aligned lengths), num_tokens_per_expert_list (the same
        numbers as a list after a host sync, else [])); tensors int32 on topk_idx's device.

    Raises:
        TypeError: topk_idx not int32/int64. ValueError: bad shapes or arguments, or (where a
        host sync happens) ids out of range or P too small.
    """
    fn = "get_fused_mapping"
    _c.check_tensor(fn, "topk_idx", topk_idx, ndim=2, dtypes=_c._INT_DTYPES)
    _c.check_int(fn, "num_experts", num_experts, minimum=1, maximum=_MAX_EXPERTS)
    _c.check_int(fn, "num_expanded_tokens", num_expanded_tokens, minimum=0, maximum=_c.INT32_MAX)
    _c.check_int(fn, "alignment", alignment, minimum=1, maximum=1 << 20)
    if not isinstance(force_no_sync, bool):
        raise TypeError(f"{fn}: `force_no_sync` must be a bool, got {type(force_no_sync).__name__}")
    t, k = topk_idx.shape
    numel = t * k
    if numel > _c.INT32_MAX:
        raise ValueError(f"{fn}: `topk_idx` has {numel} entries; at most {_c.INT32_MAX} supported")
    sync = num_expanded_tokens == 0 and not force_no_sync
    bound = _upper_bound_pos(numel, num_experts, alignment)
    if bound > _c.INT32_MAX:  # kernels count rows in int32
        raise ValueError(f"{fn}: T*K + (alignment-1)*E = {bound} rows do not fit int32 positions")
    num_pos = num_expanded_tokens or bound
    if not _c.use_triton(topk_idx):
        # CPU reference: a host sync costs nothing here, so every check is a plain ValueError.
        _c.check_ids_host(fn, "topk_idx", topk_idx, num_experts, "expert")
        counts = torch.bincount(topk_idx[topk_idx >= 0].long(), minlength=num_experts)
        needed = int(((counts + alignment - 1) // alignment * alignment).sum())
        if needed > num_pos:
            raise ValueError(f"{fn}: `num_expanded_tokens` ({num_pos}) is too small; the routing "
                             f"needs {needed} rows")
        outs = _ref.get_fused_mapping_ref(topk_idx, num_experts, needed if sync else num_pos, alignment)
        return (*outs, outs[6].tolist() if sync else [])

    (pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos, expert_start, expert_end,
     meta, _) = _mapping(topk_idx, num_experts, num_pos, alignment)
    with device_guard(topk_idx):
        num_tokens_per_expert = meta[:num_experts]
        if not sync:
            # No host sync (CUDA-graph capturable): invalid ids and an overflowing P assert on
            # the device. Nothing was written out of bounds either way.
            _c.assert_async(fn, meta[num_experts + 2],
                            f"`topk_idx` holds expert ids < -1 or >= {num_experts}, or "
                            f"`num_expanded_tokens` ({num_pos}) is smaller than the routing needs")
            return (pos_to_expert, pos_to_token, pos_to_token_topk, token_topk_to_pos,
                    expert_start, expert_end, num_tokens_per_expert, [])
        # The one host sync: the aligned counts, the invalid-id count and the P needed.
        host = meta[: num_experts + 2].tolist()
    if host[num_experts]:
        raise ValueError(f"{fn}: `topk_idx` holds {host[num_experts]} expert ids < -1 or "
                         f">= {num_experts}")
    needed = host[num_experts + 1]
    return (pos_to_expert[:needed], pos_to_token[:needed], pos_to_token_topk[:needed],
            token_topk_to_pos, expert_start, expert_end, num_tokens_per_expert,
            host[:num_experts])


def _positions_message(num_pos: int, what: str) -> str:
    return f"`token_topk_to_pos` holds positions < -1 or >= {num_pos} ({what})"


def _check_positions(fn: str, token_topk_to_pos: Tensor, num_pos: int, what: str) -> None:
    """The reference path's check (CPU tensors: a host check costs nothing)."""
    bad = (token_topk_to_pos < -1) | (token_topk_to_pos >= num_pos)
    if bool(bad.any()):
        raise ValueError(f"{fn}: {_positions_message(num_pos, what)}, e.g. "
                         f"{int(token_topk_to_pos[bad][0])}")


def expand_to_fused(x: Tensor, token_topk_to_pos: Tensor, pos_to_expert: Tensor) -> Tensor:
    """[P, H]: row pos[t, k] holds x[t] for every pos >= 0; padding rows (expert -1) are zero.

    Args:
        x: [T, H], any dtype; rows may be strided. Where it requires grad (and grad mode is on) the
            torch reference runs, so the result carries the gradient (the kernel builds no graph).
        token_topk_to_pos: [T, K] int32/int64 from get_fused_mapping: positions in [0, P), or -1.
        pos_to_expert: [P] int32/int64 from get_fused_mapping (P = its length).

    A position outside [-1, P) raises: ValueError on the reference path; on Triton's, without a
    host sync, a device-side assert (RuntimeError in the interpreter), after a launch that wrote
    nothing out of bounds.
    """
    fn = "expand_to_fused"
    _c.check_tensor(fn, "x", x, ndim=2)
    _c.check_tensor(fn, "token_topk_to_pos", token_topk_to_pos, ndim=2, dtypes=_c._INT_DTYPES)
    _c.check_tensor(fn, "pos_to_expert", pos_to_expert, ndim=1, dtypes=_c._INT_DTYPES)
    _c.check_same_device(fn, x=x, token_topk_to_pos=token_topk_to_pos, pos_to_expert=pos_to_expert)
    t, h = x.shape
    if token_topk_to_pos.shape[0] != t:
        raise ValueError(f"{fn}: `token_topk_to_pos` must have {t} rows like `x`, got "
                         f"{tuple(token_topk_to_pos.shape)}")
    num_pos = pos_to_expert.shape[0]
    if not _c.use_triton(x) or _c.needs_grad(x):
        _check_positions(fn, token_topk_to_pos, num_pos, "`pos_to_expert`'s length")
        return _ref.expand_to_fused_ref(x, token_topk_to_pos, num_pos)
    if x.is_complex():  # Triton has no complex types: the (real, imaginary) pairs as 2H reals
        real = expand_to_fused(torch.view_as_real(x).reshape(t, 2 * h), token_topk_to_pos, pos_to_expert)
        return torch.view_as_complex(real.view(num_pos, h, 2))
    out = torch.empty((num_pos, h), dtype=x.dtype, device=x.device)
    if h == 0:
        return out
    if t == 0:  # no tokens: every row is a padding row
        return out.zero_()
    valid = torch.ones(1, dtype=torch.int32, device=x.device)
    x = _c.row_major(x)
    mapping = _c.row_major(token_topk_to_pos)
    pte = pos_to_expert.contiguous()
    cfg, _ = _c.select_config(x.device)
    block_h = min(cfg.copy_block_h, _pow2(h))
    pad_rows = 128
    grid = (t + _cdiv(num_pos, pad_rows), _cdiv(h, block_h))
    with device_guard(x):
        _launch["_expand_kernel"](
            grid, _index(x), x, out, mapping, pte, valid, t, num_pos, h, x.stride(0), mapping.stride(0),
            K=mapping.shape[1], BLOCK_H=block_h, PAD_ROWS=pad_rows, PAD_R=16, SUB_H=min(block_h, 128),
            num_warps=cfg.copy_warps,
        )
    _c.assert_async(fn, valid, _positions_message(num_pos, "`pos_to_expert`'s length"))
    return out


def reduce_fused(x: Tensor, topk_weights: Tensor | None, token_topk_to_pos: Tensor,
                 out: Tensor | None = None) -> Tensor:
    """[T, H]: out[t] = sum_k w[t, k] * x[pos[t, k]] over pos >= 0, accumulated in fp32.

    Args:
        x: [P, H] fp16/bf16/fp32 expert outputs; rows may be strided.
        topk_weights: [T, K] float weights, or None for a plain sum. The weight of a slot with
            position -1 is never used (a NaN or inf there changes nothing). Where `x` or these
            require grad (and grad mode is on) the torch reference runs, so the result carries the
            gradient.
        token_topk_to_pos: [T, K] int32/int64 from get_fused_mapping: positions in [0, P), or -1
            (others raise as in `expand_to_fused`).
        out: optional [T, H] contiguous, dtype x.dtype or float32, on x's device; written in
            place and returned (never reallocated). It shares no memory with the other arguments
            (ValueError on every path: programs would overwrite rows others still read).
    """
    fn = "reduce_fused"
    _c.check_tensor(fn, "x", x, ndim=2, dtypes=_c._FLOAT_DTYPES)
    _c.check_tensor(fn, "token_topk_to_pos", token_topk_to_pos, ndim=2, dtypes=_c._INT_DTYPES)
    if topk_weights is not None:
        _c.check_tensor(fn, "topk_weights", topk_weights, ndim=2, dtypes=_c._FLOAT_DTYPES)
        if topk_weights.shape != token_topk_to_pos.shape:
            raise ValueError(f"{fn}: `topk_weights` must have shape {tuple(token_topk_to_pos.shape)}"
                             f" like `token_topk_to_pos`, got {tuple(topk_weights.shape)}")
    if out is not None:
        _c.check_tensor(fn, "out", out, ndim=2, dtypes=(x.dtype, torch.float32))
    _c.check_same_device(fn, x=x, token_topk_to_pos=token_topk_to_pos, topk_weights=topk_weights,
                         out=out)
    num_pos, h = x.shape
    t, k = token_topk_to_pos.shape
    if out is not None:
        if tuple(out.shape) != (t, h):
            raise ValueError(f"{fn}: `out` must have shape {(t, h)}, got {tuple(out.shape)}")
        if not out.is_contiguous():
            raise ValueError(f"{fn}: `out` must be contiguous, got strides {out.stride()}")
        _c.check_no_overlap(fn, out, x=x, topk_weights=topk_weights, token_topk_to_pos=token_topk_to_pos)
    if not _c.use_triton(x) or _c.needs_grad(x, topk_weights):
        _check_positions(fn, token_topk_to_pos, num_pos, "the rows of `x`")
        res = _ref.reduce_fused_ref(x, topk_weights, token_topk_to_pos)
        if out is None:
            return res.to(x.dtype)
        return out.copy_(res)
    if out is None:
        out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t == 0 or h == 0:
        return out
    x = _c.row_major(x)
    mapping = _c.row_major(token_topk_to_pos)
    w = _c.int32_columns(topk_weights) if topk_weights is not None else mapping  # dummy pointer when unused
    cfg, _ = _c.select_config(x.device)
    block_h = min(cfg.reduce_block_h, _pow2(h))
    valid = torch.ones(1, dtype=torch.int32, device=x.device)
    with device_guard(x):
        _launch["_reduce_kernel"](
            (t, _cdiv(h, block_h)), _index(x), x, w, mapping, out, valid, num_pos, h, x.stride(0),
            w.stride(0), w.stride(1), mapping.stride(0), out.stride(0),
            K=k, HAS_W=topk_weights is not None, BLOCK_H=block_h, num_warps=cfg.reduce_warps,
        )
    _c.assert_async(fn, valid, _positions_message(num_pos, "the rows of `x`"))
    return out
