"""Expert parallelism: send each routed token to the rank that owns its expert, and back.

Experts are split contiguously: with E experts over W ranks, rank r owns experts
``[r * E/W, (r+1) * E/W)``. A token goes to a rank once, however many of its top-k experts live
there: it arrives with its K slots, the slots of experts owned elsewhere set to -1 (weight 0), so
the local experts function (``fused_experts`` convention: -1 means "no expert") sees [N, K] routing.

Pipeline (each rank): count rows per destination -> all-to-all the counts (one host sync, to size
the receive buffers) -> all-to-all rows, local routing and weights -> local experts -> all-to-all
the weighted outputs back -> sum each token's rows in fp32.

Backward: both all-to-alls are autograd Functions whose backward is the reverse all-to-all. Every
rank must run backward through both (collectives must match); `ep_combine` ties its output to the
dispatched tensors so the dispatch node is reached on every rank even where a rank got no tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from kernelhub.device import device_guard
from kernelhub.distributed._agree import collective_device, gather_ints, raise_if_any_failed

__all__ = [
    "EPDispatch",
    "EPHandle",
    "ExpertParallelMoE",
    "ep_combine",
    "ep_dispatch",
    "ep_moe",
    "local_expert_range",
    "reference_experts",
]

ExpertsFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def reference_experts(
    x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, topk_idx: Tensor, topk_weights: Tensor
) -> Tensor:
    """SwiGLU routed experts in fp32 (the ``fused_experts`` convention); -1 in `topk_idx` is skipped.

    Args:
        x: [N, H]. gate_up_proj: [E, 2I, H] (gate rows first). down_proj: [E, H, I].
        topk_idx: int64 [N, K], values in [-1, E). topk_weights: [N, K].

    Returns:
        [N, H] in x's dtype: ``sum_k w[n,k] * (silu(g) * u) @ down_proj[e].T`` with
        ``g, u = (x[n] @ gate_up_proj[e].T).chunk(2)``, accumulated in fp32.
    """
    _check_experts_args("reference_experts", x, gate_up_proj, down_proj, topk_idx, topk_weights)
    with device_guard(x):
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in range(gate_up_proj.shape[0]):
            tok, slot = (topk_idx == e).nonzero(as_tuple=True)  # host sync: reference path only
            if tok.numel() == 0:
                continue
            gate, up = (x[tok].float() @ gate_up_proj[e].float().T).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ down_proj[e].float().T
            out = out.index_add(0, tok, y * topk_weights[tok, slot].float().unsqueeze(-1))
        return out.to(x.dtype)


def local_expert_range(rank: int, num_experts: int, world_size: int) -> tuple[int, int]:
    """The experts ``[start, end)`` that `rank` owns when `num_experts` are split over `world_size`."""
    if num_experts % world_size:
        raise ValueError(
            f"local_expert_range: `num_experts` ({num_experts}) must be divisible by the world size "
            f"({world_size})"
        )
    per = num_experts // world_size
    return rank * per, (rank + 1) * per


@dataclass
class EPHandle:
    """What `ep_combine` needs from `ep_dispatch`: the route back."""

    group: dist.ProcessGroup | None
    num_tokens: int
    token_index: Tensor  # [S] int64: the token of each row this rank sent, destination-major
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    dispatched: tuple[Tensor, ...]  # the dispatched tensors, tied into combine's graph


@dataclass
class EPDispatch:
    """Rows this rank received: run the local experts on them, then `ep_combine(out, handle)`."""

    hidden_states: Tensor  # [N, H]
    topk_idx: Tensor  # int64 [N, K]: local expert index, -1 for slots owned by other ranks
    topk_weights: Tensor  # [N, K]: 0 where topk_idx is -1
    handle: EPHandle


def _all_to_all(t: Tensor, out_splits: list[int], in_splits: list[int], group) -> Tensor:
    out = t.new_empty((sum(out_splits), *t.shape[1:]))
    dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=group)
    return out


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, out_splits, in_splits, *tensors):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        ctx.floating = [t.is_floating_point() for t in tensors]
        outs = tuple(_all_to_all(t, out_splits, in_splits, group) for t in tensors)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        # Reverse every floating tensor on every rank, needed or not, so the collectives match.
        with device_guard(grads[0]):
            back = [
                _all_to_all(g, ctx.in_splits, ctx.out_splits, ctx.group) if floating else None
                for g, floating in zip(grads, ctx.floating, strict=True)
            ]
        return (None, None, None, *back)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, out_splits, in_splits, expert_out, *tied):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        ctx.tied = [(t.shape, t.dtype, t.device) for t in tied]
        return _all_to_all(expert_out, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        with device_guard(grad):
            grad_in = _all_to_all(grad, ctx.in_splits, ctx.out_splits, ctx.group)
        zeros = [
            torch.zeros(shape, dtype=dtype, device=device) if need else None
            for (shape, dtype, device), need in zip(ctx.tied, ctx.needs_input_grad[4:], strict=True)
        ]
        return (None, None, None, grad_in, *zeros)


def ep_dispatch(
    x: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    num_experts: int,
    *,
    group: dist.ProcessGroup | None = None,
) -> EPDispatch:
    """Send each token to every rank owning one of its experts (collective; one host sync).

    Args:
        x: [T, H] floating. topk_idx: int64 [T, K], global expert ids in [-1, E) (-1: no expert).
        topk_weights: [T, K] floating. num_experts: E, divisible by the group size.
        group: process group (default world); NCCL needs CUDA tensors, gloo CPU tensors.

    Raises:
        ValueError, TypeError: on every rank, if any rank's arguments are invalid (bad shapes,
            dtypes, devices, meta tensors, `topk_idx` out of range) or ranks disagree on H, K, E
            or dtypes: the failing rank raises its own error, the others one naming it.
    """
    return _dispatch("ep_dispatch", x, topk_idx, topk_weights, num_experts, group, None)


def _dispatch(
    fn: str, x, topk_idx, topk_weights, num_experts, group, more_checks: Callable[[], None] | None
) -> EPDispatch:
    """`ep_dispatch`, after `more_checks` (the caller's own argument checks, made collective too)."""
    error: Exception | None = None
    try:
        _check_routing(fn, x, topk_idx, topk_weights, num_experts)
        if more_checks is not None:
            more_checks()
    except (TypeError, ValueError) as e:
        error = e
    if error is not None and (not dist.is_available() or not dist.is_initialized()):
        raise error  # no group: no peer to wait
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if error is None and num_experts % world:
        error = ValueError(
            f"{fn}: `num_experts` ({num_experts}) must be divisible by the group size ({world})"
        )
    if error is not None:
        # Take part in the metadata exchange (every rank's first collective) with a failure flag,
        # so every rank raises now instead of the others waiting in it.
        dev = x.device if isinstance(x, Tensor) and x.device.type != "meta" else collective_device(group)
        with device_guard(dev):
            meta = torch.zeros((world, _META_COLUMNS), dtype=torch.int64, device=dev)
            meta[:, _FAILED] = 1
            recv_meta = torch.empty_like(meta)
            dist.all_to_all_single(recv_meta, meta, group=group)
            raise_if_any_failed(error, recv_meta[:, _FAILED].tolist(), where=fn, group=group)
        raise error  # not reached: raise_if_any_failed re-raises this rank's error
    per_rank = num_experts // world
    T, H = x.shape
    K = topk_idx.shape[1]
    with device_guard(x):
        dev = x.device
        owner = torch.where(topk_idx >= 0, topk_idx.div(per_rank, rounding_mode="floor"), -1)
        bad = ((topk_idx < -1) | (topk_idx >= num_experts)).sum()
        goes_to = (owner.unsqueeze(-1) == torch.arange(world, device=dev)).any(dim=1)  # [T, W]
        dest, tok = goes_to.T.nonzero(as_tuple=True)  # destination-major, tokens ascending
        send_counts = goes_to.sum(dim=0)
        meta = torch.stack(
            [
                send_counts,
                bad.expand(world),
                torch.full_like(send_counts, H),
                torch.full_like(send_counts, K),
                # what the transfers' sizes and meaning depend on too: ranks that disagree on E would
                # renumber ids apart (silently wrong); on dtypes, the all-to-alls would mismatch
                torch.full_like(send_counts, num_experts),
                torch.full_like(send_counts, _dtype_code(x.dtype)),
                torch.full_like(send_counts, _dtype_code(topk_weights.dtype)),
                torch.zeros_like(send_counts),  # _FAILED: this rank's arguments are valid
            ],
            dim=1,
        )
        recv_meta = torch.empty_like(meta)
        dist.all_to_all_single(recv_meta, meta, group=group)
        rows = recv_meta.tolist()  # host sync: receive buffers are sized by the counts
        raise_if_any_failed(None, [r[_FAILED] for r in rows], where=fn, group=group)
        send_splits = send_counts.tolist()
        _check_peers(fn, rows, rank, H, K, num_experts)
        recv_splits = [r[0] for r in rows]

        here = owner[tok] == dest.unsqueeze(-1)  # [S, K]: slot's expert lives on the destination
        send_idx = torch.where(here, topk_idx[tok] - (dest * per_rank).unsqueeze(-1), -1)
        send_w = torch.where(here, topk_weights[tok], torch.zeros((), dtype=topk_weights.dtype, device=dev))
        recv_x, recv_w, recv_idx = _Dispatch.apply(group, recv_splits, send_splits, x[tok], send_w, send_idx)
    handle = EPHandle(group, T, tok, send_splits, recv_splits, (recv_x, recv_w))
    return EPDispatch(recv_x, recv_idx, recv_w, handle)


def ep_combine(expert_out: Tensor, handle: EPHandle) -> Tensor:
    """Return each row to the rank it came from and sum each token's rows in fp32 (collective).

    Before the all-to-all, one all-gather (a host sync) checks every rank's `expert_out`.

    Args:
        expert_out: [N, H], the local experts' weighted output for `ep_dispatch`'s rows, in order.
        handle: from the matching `ep_dispatch`.

    Returns:
        [T, H] in expert_out's dtype, on this rank's original tokens.

    Raises:
        ValueError, TypeError: on every rank, if any rank's `expert_out` is not [N, H] floating
            (N: the rows it received), or ranks disagree on H or the dtype. A `handle` that is
            not an EPHandle raises on that rank only (it names no group to tell).
    """
    if not isinstance(handle, EPHandle):
        raise TypeError(f"ep_combine: `handle` must be an EPHandle, got {type(handle).__name__}")
    return _combine("ep_combine", expert_out, handle, None)


def _combine(fn: str, expert_out, handle: EPHandle, error: Exception | None) -> Tensor:
    """`ep_combine`, after an exchange of (failed, H, dtype) so that no rank is left waiting in it.

    `error`: what went wrong on this rank since the dispatch (e.g. in `experts_fn`), or None.
    """
    n = sum(handle.recv_splits)
    if error is None:
        if not isinstance(expert_out, Tensor) or expert_out.dim() != 2 or expert_out.shape[0] != n:
            got = tuple(expert_out.shape) if isinstance(expert_out, Tensor) else type(expert_out).__name__
            error = ValueError(f"{fn}: `expert_out` must be [{n}, H] (rows received), got {got}")
        elif not expert_out.is_floating_point():
            error = TypeError(f"{fn}: `expert_out` must be floating, got {expert_out.dtype}")
        elif expert_out.device != handle.dispatched[0].device:
            error = ValueError(
                f"{fn}: `expert_out` must be on {handle.dispatched[0].device} (the dispatched rows'), "
                f"got {expert_out.device}"
            )
    if dist.get_world_size(handle.group) == 1:
        if error is not None:
            raise error
        return _combine_rows(expert_out, handle)
    dev = handle.dispatched[0].device  # where the dispatch's collectives ran
    mine = [1, 0, 0] if error is not None else [0, expert_out.shape[1], _dtype_code(expert_out.dtype)]
    with device_guard(dev):
        rows = gather_ints(mine, handle.group, dev)  # host sync
        raise_if_any_failed(error, [r[0] for r in rows], where=fn, group=handle.group)
        if len({(r[1], r[2]) for r in rows}) != 1:
            detail = ", ".join(
                f"rank {src}: H={r[1]} {_dtype_name(r[2])}" for src, r in enumerate(rows)
            )
            raise ValueError(
                f"{fn}: ranks disagree on `expert_out`'s width or dtype ({detail}); "
                f"this is rank {dist.get_rank(handle.group)}"
            )
    return _combine_rows(expert_out, handle)


def _combine_rows(expert_out: Tensor, handle: EPHandle) -> Tensor:
    with device_guard(expert_out):
        back = _Combine.apply(
            handle.group, handle.send_splits, handle.recv_splits, expert_out, *handle.dispatched
        )
        out = torch.zeros((handle.num_tokens, expert_out.shape[1]), dtype=torch.float32, device=back.device)
        out = out.index_add(0, handle.token_index, back.float())
    return out.to(expert_out.dtype)


def ep_moe(
    x: Tensor,
    topk_idx: Tensor,
    topk_weights: Tensor,
    gate_up_proj_local: Tensor,
    down_proj_local: Tensor,
    num_experts: int,
    *,
    group: dist.ProcessGroup | None = None,
    experts_fn: ExpertsFn | None = None,
) -> Tensor:
    """Routed experts over the group: dispatch, `experts_fn` on this rank's experts, combine.

    Args:
        x, topk_idx, topk_weights, num_experts, group: as for `ep_dispatch`.
        gate_up_proj_local: [E/W, 2I, H], this rank's experts. down_proj_local: [E/W, H, I].
        experts_fn: ``(x, gate_up_proj, down_proj, topk_idx, topk_weights) -> [N, H]`` with -1
            slots skipped (``fused_experts``' signature); default `reference_experts`. Not called
            on a rank that received no rows (its local weights then get a zero gradient), so the
            weights are checked here first, on every rank: shapes against `x`, x's device and dtype.

    Returns:
        [T, H] in x's dtype: equal to the single-process routed experts over all E experts.

    Raises:
        On every rank, within one exchange: what `ep_dispatch` raises, a bad local weight on any
        rank, and an `experts_fn` that raised or returned something other than [N, H] floating on
        any rank (that rank re-raises its error; the others raise one naming the rank and it).
    """
    def check_weights() -> None:
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        if num_experts % world:
            raise ValueError(
                f"ep_moe: `num_experts` ({num_experts}) must be divisible by the group size ({world})"
            )
        per_rank = num_experts // world
        for name, w in (("gate_up_proj_local", gate_up_proj_local), ("down_proj_local", down_proj_local)):
            if not isinstance(w, Tensor) or w.dim() != 3 or w.shape[0] != per_rank:
                got = tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__
                raise ValueError(f"ep_moe: `{name}` must hold E/W = {per_rank} experts [E/W, ., .], got {got}")
            if w.dtype != x.dtype:
                raise TypeError(f"ep_moe: `{name}` must have x's dtype {x.dtype}, got {w.dtype}")
        _check_experts_args("ep_moe", x, gate_up_proj_local, down_proj_local, topk_idx, topk_weights)

    d = _dispatch("ep_moe", x, topk_idx, topk_weights, num_experts, group, check_weights)
    fn = reference_experts if experts_fn is None else experts_fn
    error: Exception | None = None
    with device_guard(x):
        N = d.hidden_states.shape[0]
        if N == 0:
            # Kernels need not accept empty inputs; the combine still runs (collective). Tying the
            # local weights into it gives them a zero gradient (not None), as in one process.
            y = d.hidden_states.new_zeros(d.hidden_states.shape)
            d.handle.dispatched = (*d.handle.dispatched, gate_up_proj_local, down_proj_local)
        else:
            # Anything raised here happens between two collectives: it is exchanged before the
            # combine (in _combine), so the other ranks raise too instead of waiting in it.
            try:
                y = fn(d.hidden_states, gate_up_proj_local, down_proj_local, d.topk_idx, d.topk_weights)
                if not isinstance(y, Tensor) or tuple(y.shape) != (N, x.shape[1]) or not y.is_floating_point():
                    got = f"{y.dtype} {tuple(y.shape)}" if isinstance(y, Tensor) else type(y).__name__
                    raise ValueError(
                        f"ep_moe: `experts_fn` must return a floating [{N}, {x.shape[1]}] tensor "
                        f"(rows received, H), got {got}"
                    )
                if y.device != x.device:
                    raise ValueError(f"ep_moe: `experts_fn` returned a tensor on {y.device}, x is on {x.device}")
            except Exception as e:  # noqa: BLE001 - re-raised on this rank by _combine, after telling the others
                error, y = e, None
            else:
                if y.dtype != x.dtype:  # every rank sends x's dtype back (a rank with no rows sends zeros)
                    y = y.to(x.dtype)
    return _combine("ep_moe", y, d.handle, error)


class ExpertParallelMoE(nn.Module):
    """Routed SwiGLU experts split over a process group; forward as transformers' ``*Experts``.

    Holds only this rank's experts (`gate_up_proj` [E/W, 2I, H], `down_proj` [E/W, H, I]).
    `experts_fn` computes the local experts (default `reference_experts`; plug in
    ``fused_experts`` from ``kernels_repo/moe``).
    """

    def __init__(
        self,
        gate_up_proj: Tensor,
        down_proj: Tensor,
        num_experts: int,
        *,
        group: dist.ProcessGroup | None = None,
        experts_fn: ExpertsFn | None = None,
    ) -> None:
        super().__init__()
        world = dist.get_world_size(group)
        start, end = local_expert_range(0, num_experts, world)
        if gate_up_proj.dim() != 3 or gate_up_proj.shape[0] != end - start or gate_up_proj.shape[1] % 2:
            raise ValueError(
                f"ExpertParallelMoE: `gate_up_proj` must be [{end - start}, 2I, H], "
                f"got {tuple(gate_up_proj.shape)}"
            )
        E, two_i, H = gate_up_proj.shape
        if tuple(down_proj.shape) != (E, H, two_i // 2) or down_proj.dtype != gate_up_proj.dtype:
            raise ValueError(
                f"ExpertParallelMoE: `down_proj` must be [{E}, {H}, {two_i // 2}] of dtype {gate_up_proj.dtype} "
                f"like `gate_up_proj`, got {tuple(down_proj.shape)} {down_proj.dtype}"
            )
        self.gate_up_proj = nn.Parameter(gate_up_proj)
        self.down_proj = nn.Parameter(down_proj)
        self.num_experts = num_experts
        self.group = group
        self.experts_fn = experts_fn

    @classmethod
    def from_full(
        cls,
        gate_up_proj: Tensor,
        down_proj: Tensor,
        *,
        group: dist.ProcessGroup | None = None,
        experts_fn: ExpertsFn | None = None,
    ) -> ExpertParallelMoE:
        """This rank's slice (a copy) of full [E, 2I, H] / [E, H, I] weights."""
        num_experts = gate_up_proj.shape[0]
        start, end = local_expert_range(dist.get_rank(group), num_experts, dist.get_world_size(group))
        return cls(
            gate_up_proj[start:end].detach().clone(),
            down_proj[start:end].detach().clone(),
            num_experts,
            group=group,
            experts_fn=experts_fn,
        )

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return ep_moe(
            hidden_states,
            top_k_index,
            top_k_weights,
            self.gate_up_proj,
            self.down_proj,
            self.num_experts,
            group=self.group,
            experts_fn=self.experts_fn,
        )


def _check_experts_args(fn: str, x, gate_up_proj, down_proj, topk_idx, topk_weights) -> None:
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise ValueError(f"{fn}: `x` must be a 2-D [N, H] tensor")
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[2] != x.shape[1] or gate_up_proj.shape[1] % 2:
        raise ValueError(
            f"{fn}: `gate_up_proj` must be [E, 2I, {x.shape[1]}], got {tuple(gate_up_proj.shape)}"
        )
    E, I2, H = gate_up_proj.shape
    if tuple(down_proj.shape) != (E, H, I2 // 2):
        raise ValueError(f"{fn}: `down_proj` must be [{E}, {H}, {I2 // 2}], got {tuple(down_proj.shape)}")
    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if t.device != x.device:
            raise ValueError(f"{fn}: `{name}` must be on {x.device} like `x`, got {t.device}")
    if topk_idx.dtype != torch.int64:
        raise TypeError(f"{fn}: `topk_idx` must be int64, got {topk_idx.dtype}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0] or topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"{fn}: `topk_idx` and `topk_weights` must both be [{x.shape[0]}, K], got "
            f"{tuple(topk_idx.shape)} and {tuple(topk_weights.shape)}"
        )


def _check_routing(fn: str, x, topk_idx, topk_weights, num_experts) -> None:
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: `{name}` must be a Tensor, got {type(t).__name__}")
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{fn}: `x` must be a floating [T, H] tensor, got {x.dtype} {tuple(x.shape)}")
    if topk_idx.dtype != torch.int64:
        raise TypeError(f"{fn}: `topk_idx` must be int64, got {topk_idx.dtype}")
    if not topk_weights.is_floating_point():
        raise TypeError(f"{fn}: `topk_weights` must be floating, got {topk_weights.dtype}")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0] or topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"{fn}: `topk_idx` and `topk_weights` must both be [{x.shape[0]}, K], got "
            f"{tuple(topk_idx.shape)} and {tuple(topk_weights.shape)}"
        )
    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"{fn}: `{name}` must be on {x.device} like `x`, got {t.device}")
    if x.device.type == "meta":
        # which rows go where depends on the values: there is no shape-only (meta) dispatch
        raise ValueError(f"{fn}: `x` is on the meta device; expert parallelism moves real data between ranks")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
        raise ValueError(f"{fn}: `num_experts` must be an int > 0, got {num_experts!r}")


# Columns of the dispatch's metadata exchange: counts, bad-id flag, H, K, E, x dtype, weights dtype,
# and whether this rank's arguments failed its checks.
_META_COLUMNS = 8
_FAILED = 7

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _dtype_code(dtype: torch.dtype) -> int:
    """A dtype as an int for the metadata exchange (other floating dtypes: one code after these)."""
    return _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]).replace("torch.", "") if code < len(_DTYPES) else "another dtype"


def _check_peers(fn: str, rows: list[list[int]], rank: int, H: int, K: int, num_experts: int) -> None:
    """Raise on every rank when any rank's routing is invalid (a one-rank raise would hang the rest)."""
    bad = [src for src, r in enumerate(rows) if r[1]]
    if bad:
        raise ValueError(
            f"{fn}: `topk_idx` holds values outside [-1, {num_experts}) on rank(s) {bad} "
            f"(raised on every rank; this is rank {rank})"
        )
    shapes = {(r[2], r[3]) for r in rows}
    if len(shapes) != 1:
        detail = ", ".join(f"rank {src}: H={r[2]} K={r[3]}" for src, r in enumerate(rows))
        raise ValueError(f"{fn}: ranks disagree on hidden size or top-k ({detail}); this is rank {rank}")
    if len({r[4] for r in rows}) != 1:
        detail = ", ".join(f"rank {src}: {r[4]}" for src, r in enumerate(rows))
        raise ValueError(f"{fn}: ranks disagree on `num_experts` ({detail}); this is rank {rank}")
    if len({(r[5], r[6]) for r in rows}) != 1:
        detail = ", ".join(f"rank {src}: x {_dtype_name(r[5])}, topk_weights {_dtype_name(r[6])}"
                           for src, r in enumerate(rows))
        raise ValueError(f"{fn}: ranks disagree on dtypes ({detail}); this is rank {rank}")
