"""Replayed launches of the inference path of `fused_experts`.

Why: an eager decode step is host-bound. Its GPU work is a few tens of us, while the Python that
checks the arguments, picks the bucket, aligns the rows, builds four launches' arguments and
allocates five buffers costs several times that (docs/performance.md). Every argument of those
launches except the tensor addresses depends only on the call's shapes, strides, dtypes, devices
and bucket. So the second call of a key runs the ordinary
path (every check included) under `CachedLaunch.recording()` (the first only marks the key as
seen: a prefill whose length never repeats pays nothing for recording), and its launches are kept
as a `_Replay`: the compiled handle, grid, ints and constexprs of each launch, plus where each
address comes from. A later call with the same key - everything the checks and the launches
depend on - allocates one workspace for the internal buffers and one output, computes the
addresses and launches the same kernels with the same arguments: the same bits as the ordinary
path, without its Python.

Device safety: the key holds every tensor's device, the caller runs the replay under
`device_guard(x)`, and the launches go to that device's current stream (`CachedLaunch.run_hit`).
Nothing is kept across calls but ints and compiled handles: no tensor (so no buffer is shared by
two streams or a graph, and no model weight is kept alive).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from kernelhub.device import CachedLaunch, device_cache

from . import _routing_checks
from ._experts_configs import derived_cache

_MAX_REPLAYS = 512
_ALIGN = 256  # workspace offsets of the internal buffers (the allocator's alignment is 512)
_SEEN = "seen"  # a key met once: the next call records
_MISSING = object()
# key -> _Replay, None where the recorded call cannot be replayed (so it is not recorded again), or
# _SEEN; emptied with the device caches (fake devices in tests) and the config cache (new buckets)
_REPLAYS: dict[tuple, _Replay | str | None] = derived_cache(device_cache())


class _Replay:
    """The launches of one recorded call and where each of their addresses comes from."""

    __slots__ = ("launches", "workspace_bytes", "out_shape")

    def __init__(self, launches: list, workspace_bytes: int, out_shape: tuple[int, int]) -> None:
        # (hit, grid, device index, address slots, descriptors, ints + constexprs); a descriptor is
        # None or (class, source, fields): source the index of an external, or (workspace byte
        # offset, dtype, shape, strides) of a view of an internal buffer (e.g. the down GEMM's h)
        self.launches = launches
        self.workspace_bytes = workspace_bytes
        self.out_shape = out_shape


def replay_key(x, gate_up_proj, down_proj, topk_idx, topk_weights, variant: object, *scales) -> tuple | None:
    """Everything the checks of `fused_experts` and the recorded launches depend on, for an
    inference call with the shipped (or KERNELHUB_MOE_CONFIG_DIR) buckets; None where the call is
    not replayed: not all tensors, not CUDA, a gradient is needed, no pairs, compiling, Triton
    hooks set, or ids that are not contiguous (the ordinary path copies them, a buffer a replay
    would not fill). `scales`: the fp8 path's block scales, externals after topk_weights."""
    tensors = (x, gate_up_proj, down_proj, topk_idx, topk_weights, *scales)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or not x.is_cuda:
        return None
    if not topk_idx.numel() or not topk_idx.is_contiguous() or torch.compiler.is_compiling():
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    state = CachedLaunch.launch_state()
    if state is None:
        return None
    key = (state, os.environ.get("KERNELHUB_MOE_CONFIG_DIR"), _routing_checks.sms_version, variant,
           x.device, x.dtype, x.shape, x.stride(),
           gate_up_proj.device, gate_up_proj.dtype, gate_up_proj.shape, gate_up_proj.stride(),
           down_proj.device, down_proj.dtype, down_proj.shape, down_proj.stride(),
           topk_idx.device, topk_idx.dtype, topk_idx.shape,
           topk_weights.device, topk_weights.dtype, topk_weights.shape, topk_weights.stride())
    for s in scales:
        key += (s.device, s.dtype, s.shape, s.stride())
    return key


def recorded(key: tuple) -> _Replay | None:
    """The launches recorded for `key`, if any."""
    plan = _REPLAYS.get(key)
    return plan if isinstance(plan, _Replay) else None


def replay(plan: _Replay, externals: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """The output of the recorded launches run on these tensors (x, gate_up_proj, down_proj,
    topk_idx, topk_weights, then any fp8 scales, in the recording's order); None where an address
    is not 16-byte aligned (the compiled kernels assume it; the ordinary path then launches through
    Triton). Call with x's device current."""
    x = externals[0]
    ptrs = [t.data_ptr() for t in externals]
    bits = 0
    for p in ptrs:
        bits |= p
    if bits & 15:
        return None
    out = torch.empty(plan.out_shape, device=x.device, dtype=x.dtype)
    workspace = torch.empty(plan.workspace_bytes, device=x.device, dtype=torch.uint8)
    ptrs.append(out.data_ptr())
    ptrs.append(workspace.data_ptr())
    for hit, grid, index, slots, descriptors, suffix in plan.launches:
        args = tuple([ptrs[base] + offset for base, offset in slots])
        if descriptors:
            args += tuple([None if d is None else d[0](base=_descriptor_base(d[1], externals, workspace), **d[2])
                           for d in descriptors])
        CachedLaunch.run_hit(hit, grid, index, args + suffix)
    return out


def _descriptor_base(source, externals: tuple[torch.Tensor, ...], workspace: torch.Tensor) -> torch.Tensor:
    if type(source) is int:
        return externals[source]
    if len(source) == 2:  # an external read as another dtype of the same size (fp8 weights as uint8)
        return externals[source[0]].view(source[1])
    offset, dtype, shape, strides = source
    return workspace[offset:].view(dtype).as_strided(shape, strides)


def should_record(key: tuple) -> bool:
    """Whether this call (with no replay for its key) should record its launches: the key's second
    call does; the first marks the key as seen; a key whose recording could not be replayed never."""
    state = _REPLAYS.get(key, _MISSING)
    if state is _MISSING:
        _make_room()
        _REPLAYS[key] = _SEEN
        return False
    return state is _SEEN


def remember(key: tuple, calls: list, externals: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
    """Keep the launches recorded while the ordinary path computed `out` from `externals`."""
    _make_room()
    _REPLAYS[key] = _plan(calls, externals, out)


def refuse(key: tuple) -> None:
    """Never replay `key`: its recorded call made a launch a plan cannot rebuild (the Gluon GEMMs)."""
    _REPLAYS[key] = None


def _make_room() -> None:
    """At the bound, forget the keys seen once (prefill lengths that did not repeat) before the
    recordings (the decode shapes that do)."""
    if len(_REPLAYS) < _MAX_REPLAYS:
        return
    for key in [k for k, v in _REPLAYS.items() if v is _SEEN]:
        del _REPLAYS[key]
    if len(_REPLAYS) >= _MAX_REPLAYS:
        _REPLAYS.clear()


def _storage(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _same_view(t: torch.Tensor, externals: tuple[torch.Tensor, ...]) -> tuple[int, torch.dtype] | None:
    """(i, dtype) where `t` is externals[i].view(dtype): the same address, shape and strides, an
    element of the same size (the W8A16 kernels read fp8 weights' bits as uint8 through TMA)."""
    for i, x in enumerate(externals):
        if (x.data_ptr() == t.data_ptr() and x.element_size() == t.element_size() and x.shape == t.shape
                and x.stride() == t.stride() and x.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()):
            return i, t.dtype
    return None


def _plan(calls: list, externals: tuple[torch.Tensor, ...], out: torch.Tensor) -> _Replay | None:
    """Address slots (base, byte offset) of every recorded tensor argument. Bases: the externals in
    order, then the output, then the workspace; a tensor in none of the externals' or the output's
    storage is an internal buffer, given a region of the workspace per distinct storage."""
    named = [*externals, out]
    spans = [_storage(t) for t in named]
    for i, (start, size) in enumerate(spans):  # overlapping storages: which base is ambiguous
        for other, other_size in spans[i + 1:]:
            if start < other + other_size and other < start + size:
                return None
    workspace: dict[int, int] = {}  # internal storage address -> its offset in the workspace
    size = 0
    launches = []
    ws_base = len(named)
    for call in calls:
        hit = call.launcher.split_hit(call)
        if hit is None:
            return None
        slots = []

        def workspace_offset(start: int, nbytes: int) -> int:
            nonlocal size
            if start not in workspace:
                workspace[start] = size
                size += -(-nbytes // _ALIGN) * _ALIGN
            return workspace[start]

        for t in call.tensors:
            start, nbytes = _storage(t)
            base = next((i for i, (s, _) in enumerate(spans) if s == start), None)
            if base is not None:
                slots.append((base, t.data_ptr() - named[base].data_ptr()))
                continue
            slots.append((ws_base, workspace_offset(start, nbytes) + t.data_ptr() - start))
        descriptors = []
        for e in call.extras:
            if e is None:
                descriptors.append(None)
                continue
            t = getattr(e, "base", None)
            if not isinstance(t, torch.Tensor) or not dataclasses.is_dataclass(e):
                return None
            source = next((i for i, x in enumerate(externals) if x is t), None)
            if source is None:
                source = _same_view(t, externals)
            if source is None:  # a view of an internal buffer: rebuilt over the workspace each call
                start, nbytes = _storage(t)
                if any(s == start for s, _ in spans) or (t.data_ptr() - start) % 16:
                    return None  # over the output, or a view inside an external: not replayed
                source = (workspace_offset(start, nbytes) + t.data_ptr() - start, t.dtype, tuple(t.shape),
                          tuple(t.stride()))
            # its fields but the tensor: a kept descriptor would keep the model's weight alive
            fields = {f.name: getattr(e, f.name) for f in dataclasses.fields(e) if f.name != "base"}
            descriptors.append((type(e), source, fields))
        launches.append((hit, call.grid, call.device_index, tuple(slots), tuple(descriptors),
                         call.ints + call.constexprs))
    return _Replay(launches, max(size, 1), tuple(out.shape))
