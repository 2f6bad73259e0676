"""Make an error on one rank an error on every rank.

A rank that raises on its own leaves its peers waiting in their next collective until the process
group's timeout (30 minutes by default). So each step that can fail on some ranks only exchanges a
failure flag (in a collective the step makes anyway where possible), and every rank raises: the
failing rank its own exception, the others one naming the failing ranks and their messages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["agree", "collective_device", "gather_ints", "raise_failures", "raise_if_any_failed"]

# Exception types a peer re-raises as such (bad input, out of memory); anything else: RuntimeError.
_KINDS: dict[str, type[Exception]] = {"TypeError": TypeError, "ValueError": ValueError, "MemoryError": MemoryError}


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where small exchange tensors go: NCCL-only groups take CUDA tensors; gloo (and mixed) CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and ":" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_ints(values: list[int], group: dist.ProcessGroup | None, device: torch.device) -> list[list[int]]:
    """Every rank's `values` (same length on every rank), indexed by group rank (one host sync)."""
    local = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, local, group=group)
    return [t.tolist() for t in out]


def raise_if_any_failed(
    error: BaseException | None, flags: list[int], *, where: str, group: dist.ProcessGroup | None
) -> None:
    """Raise on every rank if any rank's flag is set; `flags` were exchanged by the caller.

    Costs one object all-gather (the messages), and only when some rank failed.
    """
    if not any(flags):
        return
    messages: list[object] = [None] * dist.get_world_size(group)
    mine = None if error is None else (type(error).__name__, str(error))
    dist.all_gather_object(messages, mine, group=group)
    raise_failures(error, messages, where=where, rank=dist.get_rank(group))


def raise_failures(error: BaseException | None, messages: list, *, where: str, rank: int) -> None:
    """Raise if any rank failed: `messages[r]` is rank r's (exception type name, message) or None."""
    failed = [r for r, m in enumerate(messages) if m is not None]
    if not failed:
        return
    if error is not None:
        raise error
    kinds = {messages[r][0] for r in failed}
    kind = _KINDS.get(kinds.pop(), RuntimeError) if len(kinds) == 1 else RuntimeError
    detail = "; ".join(f"rank {r}: {messages[r][0]}: {messages[r][1]}" for r in failed)
    raise kind(f"{where} failed on rank(s) {failed}, so every rank raises (this is rank {rank}): {detail}")


def agree(
    error: BaseException | None, *, where: str, group: dist.ProcessGroup | None, device: torch.device | None = None
) -> None:
    """Exchange a failure flag (one all-gather) and raise on every rank if any rank failed."""
    device = collective_device(group) if device is None else device
    flags = [row[0] for row in gather_ints([int(error is not None)], group, device)]
    raise_if_any_failed(error, flags, where=where, group=group)
