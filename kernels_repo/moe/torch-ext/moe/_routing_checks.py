"""Argument checks and per-device launch choices shared by the routing entry points.

Everything device-dependent is keyed by the input's device index: the capability picks the
config, the SM count sizes persistent grids, and `set_num_sms` overrides one index only.
"""

from __future__ import annotations

import math
import os
import threading

import torch
from torch import Tensor

from kernelhub.device import as_torch_device, device_capability, device_properties

from ._routing_kernels import SM80, SM90, RoutingConfig

_INT_DTYPES = (torch.int32, torch.int64)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The interpreter runs programs one by one; a small "SM count" keeps CPU grids to a few programs.
_INTERPRETER_SMS = 4
INT32_MAX = 2**31 - 1
COLUMN_OFFSET_MAX = INT32_MAX  # the small routing kernels' column offsets are 32-bit (int32_columns)

_lock = threading.Lock()
_num_sms_override: dict[tuple[str, int], int] = {}
# bumped by every set_num_sms: callers that keep launch arguments sized by it (the replayed
# fused_experts launches) hold it in their keys
sms_version = 0


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: Tensor) -> bool:
    """Triton on GPUs; on the CPU only under the interpreter (else the torch reference runs)."""
    return t.device.type == "cuda" or (t.device.type == "cpu" and interpreting())


def set_num_sms(device: object, num_sms: int | None) -> None:
    """Override the SM count that sizes persistent grids on *that* device index (None: clear)."""
    dev = as_torch_device(device)
    if dev.type != "cuda":
        raise ValueError(f"set_num_sms: `device` must be a CUDA device, got {dev}")
    key = (dev.type, int(dev.index))
    global sms_version
    with _lock:
        sms_version += 1
        if num_sms is None:
            _num_sms_override.pop(key, None)
            return
        check_int("set_num_sms", "num_sms", num_sms, minimum=1)
        _num_sms_override[key] = num_sms


def get_num_sms(device: object) -> int:
    """The SM count used for `device`: its override, else that index's own multiprocessor count."""
    dev = as_torch_device(device)
    if dev.type != "cuda":
        return _INTERPRETER_SMS
    override = _num_sms_override.get((dev.type, int(dev.index)))
    return override if override is not None else device_properties(dev).sm_count


def select_config(device: torch.device) -> tuple[RoutingConfig, int]:
    """(config, SM count) for the input's device: sm90 configs from capability 90 up, else sm80."""
    if device.type != "cuda":
        return SM80, _INTERPRETER_SMS
    cfg = SM90 if device_capability(device) >= 90 else SM80
    return cfg, get_num_sms(device)


def check_int(fn: str, name: str, value: object, *, minimum: int | None = None,
              maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}: `{name}` must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{fn}: `{name}` must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{fn}: `{name}` must be <= {maximum}, got {value}")
    return value


def check_tensor(fn: str, name: str, t: object, *, ndim: int | None = None,
                 dtypes: tuple[torch.dtype, ...] | None = None) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{fn}: `{name}` must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        want = ", ".join(dict.fromkeys(str(d).replace("torch.", "") for d in dtypes))
        raise TypeError(f"{fn}: `{name}` must be one of ({want}), got {t.dtype}")
    if t.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{fn}: `{name}` must be on a CUDA device or the CPU, got {t.device}")
    return t


def check_same_device(fn: str, **tensors: Tensor | None) -> torch.device:
    """All given tensors on one device; a ValueError names the first and the differing one."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(
                f"{fn}: `{name}` is on {t.device} but `{first_name}` is on {first.device}; "
                "all tensors must be on one device"
            )
    return first.device


def int32_columns(t: Tensor) -> Tensor:
    """t, or a contiguous copy where a column offset (column * last stride) would not fit int32:
    the kernels index rows in 64 bits but columns in 32 (e.g. a transposed view of > 2**31 elements)."""
    return t.contiguous() if t.dim() and (t.shape[-1] - 1) * t.stride(-1) > COLUMN_OFFSET_MAX else t


def needs_grad(*tensors: Tensor | None) -> bool:
    """A result must carry a gradient: the kernels build no graph, so the torch reference runs."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _shares_elements(t: Tensor) -> bool:
    """Whether two indices of a 1-D or 2-D tensor address one element (exact).

    2-D: (i, j) and (i + di, j + dj) meet iff di * a + dj * b = 0 with |di| < rows, |dj| < columns;
    the smallest such step is di = b / gcd, dj = a / gcd (strides a, b > 0).
    """
    sizes, strides = tuple(t.shape), t.stride()
    if t.numel() == 0:
        return False
    if any(st == 0 and n > 1 for n, st in zip(sizes, strides, strict=True)):
        return True
    if len(sizes) != 2 or min(sizes) <= 1:
        return False
    (rows, cols), (a, b) = sizes, strides
    g = math.gcd(a, b)
    return b // g < rows and a // g < cols


def check_no_self_overlap(fn: str, name: str, t: Tensor) -> None:
    """An in-place argument whose elements share memory (an expanded or as_strided view whose rows
    overlap) has no defined result."""
    if _shares_elements(t):
        raise ValueError(f"{fn}: `{name}` is modified in place, so its elements must not share memory; got "
                         f"shape {tuple(t.shape)} with strides {t.stride()} (an expanded or as_strided view?)")


def _span(t: Tensor) -> tuple[int, int]:
    """[first, one past the last) byte address of a non-empty tensor's elements (torch strides are
    never negative)."""
    start = t.data_ptr()
    if t.is_contiguous():  # the usual case, without the Python loop below
        return start, start + t.nbytes
    last = sum([(n - 1) * st for n, st in zip(t.shape, t.stride())])
    return start, start + (last + 1) * t.element_size()


def check_no_overlap(fn: str, out: Tensor, **inputs: Tensor | None) -> None:
    """A written `out` shares no memory with what the launch reads: one program's store would
    change what another still has to read. Byte ranges that intersect are refused (conservative
    where a strided input's gaps would hold `out`), whatever the dtypes."""
    if out.numel() == 0:
        return
    lo, hi = _span(out)
    for name, t in inputs.items():
        if t is None or t.numel() == 0:
            continue
        start, end = _span(t)
        if start < hi and lo < end:
            raise ValueError(f"{fn}: `out` overlaps `{name}`'s memory; pass a separate tensor")


def row_major(t: Tensor) -> Tensor:
    """Unit stride along the last dimension (kernels take the other strides as arguments)."""
    return t if t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def check_ids_host(fn: str, name: str, ids: Tensor, upper: int, what: str) -> None:
    """Host check of ids in [-1, upper); used only where a host sync is already allowed."""
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < -1 or hi >= upper:
        bad = lo if lo < -1 else hi
        raise ValueError(f"{fn}: `{name}` holds {what} id {bad}; expected -1 or 0..{upper - 1}")


def assert_async(fn: str, cond: Tensor, message: str) -> None:
    """Fail loudly without a host sync: a device-side assert (CUDA) or a RuntimeError (CPU).

    On CUDA the failure surfaces at the next synchronisation as "device-side assert triggered"
    and leaves the CUDA context unusable; that is the price of a check that a CUDA graph can
    capture. Kernels never write out of bounds before it fires (their stores are masked).
    """
    torch._assert_async(cond, f"{fn}: {message}")
