"""A symmetric workspace: one buffer per rank, every rank's buffer mapped by every peer.

Peer addressing is by offset: the allocation a rank gets at byte offset ``o`` of its own buffer is
"the same allocation" as byte ``o`` of every peer's buffer. That is only true while every rank
allocates the same sizes in the same order. Allocators that compute peer addresses from their own
bump pointer (TileScale's, for one) do not check it, and a rank that allocates one private scratch
buffer first makes all later peer writes land early, silently. This heap documents the rule and
checks it: cheaply at every `barrier()`/`close()`, and per allocation with
``KERNELHUB_CHECK_ALLOC_SYMMETRY=1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from kernelhub._env import env_flag
from kernelhub.device import as_torch_device, device_guard
from kernelhub.distributed._agree import (
    agree,
    collective_device,
    gather_ints,
    raise_failures,
    raise_if_any_failed,
)
from kernelhub.distributed._backing import CpuSharedBacking, CudaSymmetricBacking
from kernelhub.errors import AllocationSymmetryError, SymmetricHeapFullError  # re-exported: their earlier path

__all__ = [
    "Allocation",
    "AllocationSymmetryError",
    "SymmetricHeap",
    "SymmetricHeapFullError",
    "CHECK_ENV",
]

CHECK_ENV = "KERNELHUB_CHECK_ALLOC_SYMMETRY"
_RULE = (
    "every rank must allocate the same sizes, dtypes and shapes in the same order (see docs/distributed.md)"
)


@dataclass(frozen=True)
class Allocation:
    """What one `allocate` call took: compared across ranks by the symmetry check."""

    index: int
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    tag: str | None

    def describe(self) -> str:
        return (
            f"offset={self.offset} nbytes={self.nbytes} dtype={self.dtype} "
            f"shape={self.shape} tag={self.tag!r}"
        )


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


class SymmetricHeap:
    """A bump allocator over one buffer per rank, with views of the same allocation on any peer.

    **The rule:** every rank of the group must call `allocate` with the same shapes and dtypes, in
    the same order. Peer views are computed from the local offset, so one rank allocating
    something extra (or in another order) shifts every later peer view on it, silently.

    Checks: `barrier()` and `close()` always compare the allocation count and bytes used across
    ranks (one all-gather of two integers) and raise `AllocationSymmetryError` on every rank on a
    difference. With ``KERNELHUB_CHECK_ALLOC_SYMMETRY=1`` (or ``check_symmetry=True``) every
    `allocate` all-gathers (offset, nbytes, dtype, shape, tag) and raises on every rank at the
    first divergent allocation, naming the ranks, the allocation number and both sides' values.
    The setting must be the same on every rank (checked at construction).

    Backings: CUDA heaps use ``torch.distributed._symmetric_memory`` (peer mappings over NVLink or
    PCIe; multicast is kept off via ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``); CPU heaps use shared
    memory files in /dev/shm (all ranks on one host), which is what CI tests with gloo.

    Args:
        nbytes: bytes per rank; the same on every rank.
        group: process group (default: the world group). `torch.distributed` must be initialised.
        device: heap device. ``None`` means the current CUDA device when the group's backend is
            NCCL, else the CPU; ``"cuda"`` without an index means the current CUDA device.
        alignment: every allocation starts at a multiple of this (a power of two; default 256),
            and at least of its dtype's size.
        check_symmetry: per-allocation check; ``None`` reads ``KERNELHUB_CHECK_ALLOC_SYMMETRY``.

    Tensors from the heap are valid until `close()`. Peer writes are visible to the peer after
    both have passed a `barrier()` (which synchronises the device's current stream).
    """

    def __init__(
        self,
        nbytes: int,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | int | None = None,
        alignment: int = 256,
        check_symmetry: bool | None = None,
    ) -> None:
        problem = _check_args(nbytes, alignment)
        if not dist.is_available() or not dist.is_initialized():
            if problem is not None:
                raise problem
            raise RuntimeError(
                "SymmetricHeap: torch.distributed is not initialised; call init_process_group first"
            )
        self._group = group if group is not None else dist.group.WORLD
        self._rank = dist.get_rank(self._group)
        if self._rank < 0:
            raise ValueError("SymmetricHeap: this process is not a member of `group`")
        self._world_size = dist.get_world_size(self._group)
        self._backend = str(dist.get_backend(self._group)).lower()
        self._device = torch.device("cpu")
        if problem is None:
            try:
                self._device = self._resolve_device(device)
            except (TypeError, ValueError) as e:
                problem = e
        self._capacity = nbytes
        self._alignment = alignment
        self._check = False
        if problem is None:
            try:
                self._check = env_flag(CHECK_ENV) if check_symmetry is None else bool(check_symmetry)
            except ValueError as e:
                problem = e
        self._allocations: list[Allocation] = []
        self._top = 0
        self._closed = False
        self._backing: CpuSharedBacking | CudaSymmetricBacking | None = None

        # Arguments that are wrong on one rank only must fail on every rank: the settings exchange
        # carries a validity flag, so it runs before anything is raised.
        ok = problem is None
        device_code = _DEVICE_CODES[self._device.type]
        mine = [int(ok), nbytes if ok else 0, alignment if ok else 0, int(self._check), device_code]
        with device_guard(self._device):  # (the CPU placeholder when the arguments were bad)
            collective = collective_device(self._group)  # the heap's GPU under NCCL, as every later check
            settings = gather_ints(mine, self._group, collective)
            failed = [1 - row[0] for row in settings]
            raise_if_any_failed(problem, failed, where="SymmetricHeap", group=self._group)
            if any(row != settings[0] for row in settings):
                rows = "; ".join(
                    f"rank {r}: nbytes={n} alignment={a} check_symmetry={bool(c)} device={_DEVICE_TYPES[d]}"
                    for r, (_, n, a, c, d) in enumerate(settings)
                )
                raise ValueError(f"SymmetricHeap: ranks were created with different settings: {rows}")
            agreed = partial(agree, group=self._group, device=collective)
            if self._device.type == "cuda":
                self._backing = CudaSymmetricBacking(
                    nbytes, self._group, self._rank, self._world_size, self._device, agreed
                )
            else:
                self._backing = CpuSharedBacking(nbytes, self._group, self._rank, self._world_size, agreed)
        self._buffers = self._backing.buffers

    # -- properties -------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def alignment(self) -> int:
        return self._alignment

    @property
    def used(self) -> int:
        """Bytes from the start of the buffer to the end of the last allocation."""
        return self._top

    @property
    def check_symmetry(self) -> bool:
        return self._check

    @property
    def allocations(self) -> tuple[Allocation, ...]:
        return tuple(self._allocations)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- allocation -------------------------------------------------------------------------
    def allocate(
        self, shape: int | Sequence[int] | torch.Size, dtype: torch.dtype, *, tag: str | None = None
    ) -> torch.Tensor:
        """A contiguous tensor in this rank's buffer; `peer(t, r)` is the same allocation on rank r.

        Raises:
            AllocationSymmetryError: with the check on, another rank's allocation of this number
                differs (raised on every rank).
            SymmetricHeapFullError: the allocation does not fit (message names the sizes).
        """
        self._check_open("allocate")
        try:
            dims = _check_shape(shape)
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"SymmetricHeap.allocate: `dtype` must be a torch.dtype, got {dtype!r}")
            if tag is not None and not isinstance(tag, str):
                raise TypeError(f"SymmetricHeap.allocate: `tag` must be a str or None, got {type(tag).__name__}")
        except (TypeError, ValueError) as e:
            if self._check:  # the peers are in this allocation's comparison: they raise too
                self._compare(("failed", type(e).__name__, str(e)), "SymmetricHeap.allocate", error=e)
            raise
        itemsize = dtype.itemsize
        numel = 1
        for d in dims:
            numel *= d
        offset = _align_up(self._top, max(self._alignment, itemsize))
        record = Allocation(len(self._allocations), offset, numel * itemsize, str(dtype), dims, tag)
        if self._check:
            self._compare(("allocate", record), "SymmetricHeap.allocate")
        if offset + record.nbytes > self._capacity:
            raise SymmetricHeapFullError(
                f"SymmetricHeap.allocate: {record.nbytes} bytes ({dtype}, shape {dims}, tag {tag!r}) "
                f"do not fit: aligned offset {offset} + {record.nbytes} > capacity {self._capacity} "
                f"({self._top} bytes used by {len(self._allocations)} allocations, "
                f"{self._capacity - offset if offset < self._capacity else 0} free after alignment)"
            )
        self._allocations.append(record)
        self._top = offset + record.nbytes
        contiguous = torch._prims_common.make_contiguous_strides_for(dims) if dims else ()
        return _view(self._buffers[self._rank], offset, dims, tuple(contiguous), dtype)

    def peer(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """The same allocation (same offset, shape, strides, dtype) in `rank`'s buffer."""
        self._check_open("peer")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"SymmetricHeap.peer: `tensor` must be a Tensor, got {type(tensor).__name__}")
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"SymmetricHeap.peer: `rank` must be an int, got {type(rank).__name__}")
        if not 0 <= rank < self._world_size:
            raise ValueError(f"SymmetricHeap.peer: `rank` must be in [0, {self._world_size}), got {rank}")
        if tensor.device != self._device:
            raise ValueError(
                f"SymmetricHeap.peer: `tensor` is on {tensor.device}, the heap on {self._device}"
            )
        if tensor.numel() == 0:  # no bytes to find (torch reports address 0): any empty view is it
            return _view(self._buffers[rank], 0, tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        local = self._buffers[self._rank]
        offset = tensor.data_ptr() - local.data_ptr()
        itemsize = tensor.element_size()
        span = _span_bytes(tuple(tensor.shape), tuple(tensor.stride()), itemsize)
        if offset < 0 or offset + span > self._capacity or offset % itemsize:
            raise ValueError(
                f"SymmetricHeap.peer: `tensor` (data_ptr {tensor.data_ptr():#x}, {span} bytes) is not "
                f"inside this heap's buffer [{local.data_ptr():#x}, +{self._capacity})"
            )
        return _view(self._buffers[rank], offset, tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)

    # -- synchronisation and checks ---------------------------------------------------------
    def barrier(self) -> None:
        """Wait for every rank (and this device's current stream); check allocation counts and bytes.

        Raises:
            AllocationSymmetryError: ranks hold different numbers of allocations or bytes.
        """
        self._check_open("barrier")
        self._barrier("SymmetricHeap.barrier")

    def close(self) -> None:
        """Check symmetry as `barrier()` does, then release the buffers (idempotent; collective)."""
        if self._closed:
            return
        try:
            self._barrier("SymmetricHeap.close")
        finally:
            self._release()

    def __enter__(self) -> SymmetricHeap:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            # Another rank may not reach a collective after an error here: release locally only.
            self._release()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._top}/{self._capacity} bytes used"
        return (
            f"SymmetricHeap(rank={self._rank}/{self._world_size}, device={self._device}, "
            f"{len(self._allocations)} allocations, {state})"
        )

    # -- internals --------------------------------------------------------------------------
    def _resolve_device(self, device: object) -> torch.device:
        if device is None:
            if "nccl" in self._backend and ":" not in self._backend and torch.cuda.is_available():
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device("cpu")
        dev = as_torch_device(device, argument="device")
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"SymmetricHeap: `device` must be a CPU or CUDA device, got {dev}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"SymmetricHeap: `device` is {dev}, but CUDA is not available")
        return dev

    def _gather_ints(self, values: list[int]) -> list[list[int]]:
        return gather_ints(values, self._group, collective_device(self._group))  # host sync

    def _gather_objects(self, obj: object) -> list[object]:
        out: list[object] = [None] * self._world_size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def _barrier(self, where: str) -> None:
        with device_guard(self._device):
            if self._device.type == "cuda":
                # Peer writes issued on this stream must land before any rank passes the barrier.
                torch.cuda.current_stream(self._device).synchronize()
            if self._check:
                self._compare(("barrier", len(self._allocations), self._top), where)
                return
            rows = self._gather_ints([len(self._allocations), self._top])
        if any(row != rows[0] for row in rows):
            detail = "; ".join(f"rank {r}: {n} allocations, {b} bytes" for r, (n, b) in enumerate(rows))
            raise AllocationSymmetryError(
                f"{where}: ranks disagree on what they allocated: {detail}. Peer views are wrong "
                f"on the ranks that differ; {_RULE}. Set {CHECK_ENV}=1 to find the first "
                "divergent allocation."
            )

    def _compare(self, entry: tuple, where: str, error: Exception | None = None) -> None:
        with device_guard(self._device):
            entries = self._gather_objects(entry)
        # a rank whose arguments failed sends ("failed", type name, message) instead of its entry
        raise_failures(error, [e[1:] if e[0] == "failed" else None for e in entries], where=where, rank=self._rank)
        if all(e == entries[0] for e in entries):
            return
        ref = entries[0]
        differing = [r for r, e in enumerate(entries) if e != ref]
        parts = [f"rank 0: {_describe(ref)}"] + [f"rank {r}: {_describe(entries[r])}" for r in differing]
        number = next((e[1].index for e in entries if e[0] == "allocate"), len(self._allocations))
        raise AllocationSymmetryError(
            f"{where}: allocation #{number} (0-based) differs between rank 0 and rank(s) "
            f"{', '.join(map(str, differing))}: " + "; ".join(parts) + f". {_RULE}."
        )

    def _check_open(self, where: str) -> None:
        if self._closed:
            raise RuntimeError(f"SymmetricHeap.{where}: the heap is closed")

    def _release(self) -> None:
        self._closed = True
        self._buffers = []
        if self._backing is not None:
            self._backing.close()
            self._backing = None
        # A closed heap that still held its group would keep the process group alive past
        # destroy_process_group; with gloo that aborted ~1 run in 4 at interpreter exit
        # ("terminate called without an active exception").
        self._group = None


_DEVICE_TYPES = ("cpu", "cuda")
_DEVICE_CODES = {t: i for i, t in enumerate(_DEVICE_TYPES)}


def _check_args(nbytes: object, alignment: object) -> Exception | None:
    """What is wrong with the sizes (checked on every rank before it is raised on any), or None."""
    for name, value in (("nbytes", nbytes), ("alignment", alignment)):
        if isinstance(value, bool) or not isinstance(value, int):
            return TypeError(f"SymmetricHeap: `{name}` must be an int, got {type(value).__name__}")
    if nbytes <= 0 or nbytes >= 1 << 62:
        return ValueError(f"SymmetricHeap: `nbytes` must be > 0 and < 2**62, got {nbytes}")
    if alignment <= 0 or alignment & (alignment - 1) or alignment >= 1 << 62:
        return ValueError(f"SymmetricHeap: `alignment` must be a power of two, got {alignment}")
    return None


def _describe(entry: tuple) -> str:
    if entry[0] == "allocate":
        return entry[1].describe()
    return f"at barrier/close after {entry[1]} allocations ({entry[2]} bytes), allocating nothing"


def _check_shape(shape: object) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int) and not isinstance(shape, bool) else shape
    if not isinstance(dims, Sequence | torch.Size) or isinstance(dims, str):
        raise TypeError(
            f"SymmetricHeap.allocate: `shape` must be an int or a sequence of ints, got {shape!r}"
        )
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"SymmetricHeap.allocate: `shape` must hold ints >= 0, got {shape!r}")
        out.append(int(d))
    return tuple(out)


def _view(
    buffer: torch.Tensor, offset: int, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """A (shape, stride, dtype) tensor starting at byte `offset` of a uint8 buffer."""
    span = _span_bytes(shape, stride, dtype.itemsize)
    return buffer[offset : offset + span].view(dtype).as_strided(shape, stride)


def _span_bytes(shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    """Bytes from a tensor's first element to just past its last one (0 when it has none)."""
    if any(s == 0 for s in shape):
        return 0
    return (sum((s - 1) * st for s, st in zip(shape, stride, strict=True)) + 1) * itemsize
