"""Tile configs of `fused_experts` as data: `configs/sm<capability>.json`, one bucket per load.

Why data: the best tiles depend on the card and on rows per expert (T*K/E); users pin or retune
them without editing code. `KERNELHUB_MOE_CONFIG_DIR` points to another directory of the same
files (what `benchmarks/tune_moe.py --out` writes). Configs are read once per (directory, file).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

_DIR = Path(__file__).resolve().parent / "configs"
_lock = threading.Lock()
_cache: dict[Path, dict] = {}
# (directory setting, capability) -> config: no filesystem call per fused_experts call (decode is
# launch-bound, a stat costs microseconds there).
_resolved: dict[tuple[str | None, int], dict] = {}
# (id of a cached bucket, device index, element size) -> bucket with stages fitted to that device.
_fitted: dict[tuple[int, int, int], dict] = {}

# Small tiles for the Triton interpreter (CPU tests): few programs, every mask exercised.
INTERPRETER_CONFIG = {
    "block_m": 16,
    "gate_up": {"BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 1},
    "down": {"BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 1},
    "dgrad": {"BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 1},
    "wgrad": {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 1},
}


_GEMM_STAGES = ("gate_up", "down", "dgrad")
_GEMM_KEYS = ("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
_WGRAD_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
# "maxnreg" (any stage): ptx .maxnreg, a register cap per thread so that more CTAs share an SM.
_GEMM_OPTIONAL = {"maxnreg": int}
# gate_up / down / dgrad only (sm90): "A_TMA" a non-gathered A by TMA (down, dL/dx), "PERSISTENT"
# programs per SM looping over the tiles in one flattened loop (_experts_launch.gemm); gate_up only: "ROWS"
# (the forward reads a row-ordered copy of x instead of gathering it, so A_TMA applies there too) and
# "EPI_HALVES" (the training epilogue, which also saves [g | u], in two column halves).
# gate_up / down "GLUON" (sm90, block_m 128): inference runs that GEMM in the warp-specialized Gluon
# kernel of `_gluon_gemm` (its own 128 x 256 tiles, GROUP_M and num_stages from the stage; its other
# keys are for the Triton kernel, which runs elsewhere: training, other devices, shapes it does not fit).
_GEMM_ONLY = {"A_TMA": bool, "PERSISTENT": int, "ROWS": bool, "EPI_HALVES": bool, "GLUON": bool}
_GATE_UP_ONLY = ("ROWS", "EPI_HALVES")
_WGRAD_OPTIONAL = {"GROUP_M": int, "ROWS_PARTS": int, "ROWS": bool, "TMA": bool, "TMA_STORE": bool,
                   "PERSISTENT": int, "FLAT_STEPS": int, **_GEMM_OPTIONAL}
_BUCKET_OPTIONAL = {"max_rows_per_expert", "tma", "pair_m", "decode"}
# "decode": the token-major inference path (`_experts_decode`) for calls of at most `max_tokens`
# tokens: {"max_tokens": n, "gate_up": {...}, "down": {...}}, each stage BLOCK_N (a power of two
# >= 4: rows of the weight per program), BLOCK_K, num_warps, num_stages.
_DECODE_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")

MAX_BLOCK_M = 256  # the largest routing alignment a bucket may ask for

def _pow2(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1 and v & (v - 1) == 0


def check_stage(where: str, stage: object, required: tuple, optional: dict) -> None:
    """One GEMM stage of a bucket (also the fp8 buckets'): a dict of the required keys and known
    optional ones (`optional`: key -> bool or int), each of a valid kind and range."""
    if not isinstance(stage, dict):
        raise TypeError(f"{where} must be a dict, got {type(stage).__name__}")
    unknown = sorted(set(stage) - set(required) - set(optional))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {sorted(set(required) | set(optional))}")
    for key in required:
        if key not in stage:
            raise ValueError(f"{where}: missing key {key!r}")
    for key, value in stage.items():
        kind = optional.get(key, int)
        if kind is bool:
            if not isinstance(value, bool):
                raise TypeError(f"{where}[{key!r}] must be true or false, got {value!r}")
        elif key.startswith("BLOCK_"):
            if not _pow2(value) or value < 16:
                raise ValueError(f"{where}[{key!r}] must be a power of two >= 16, got {value!r}")
        elif key == "maxnreg":
            if not isinstance(value, int) or isinstance(value, bool) or not 24 <= value <= 255:
                raise ValueError(f"{where}[{key!r}] must be an int in [24, 255] (registers per thread), got {value!r}")
        elif key == "num_warps":
            if value not in (1, 2, 4, 8, 16) or isinstance(value, bool):
                raise ValueError(f"{where}[{key!r}] must be 1, 2, 4, 8 or 16, got {value!r}")
        else:
            low = 0 if key in ("PERSISTENT", "FLAT_STEPS") else 1  # 0: off (PERSISTENT: one program per tile)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{where}[{key!r}] must be an int >= {low}, got {value!r}")


def check_bucket(bucket: object, where: str) -> None:
    """A tile bucket as `fused_experts` reads it; a clear error instead of a KeyError or a Triton
    compile error deep in a launch (pinned `config=`, or a file under KERNELHUB_MOE_CONFIG_DIR)."""
    if not isinstance(bucket, dict):
        raise TypeError(f"{where} must be a dict (a bucket of configs/sm*.json), got {type(bucket).__name__}")
    stages = (*_GEMM_STAGES, "wgrad")
    unknown = sorted(set(bucket) - {"block_m", *stages, *_BUCKET_OPTIONAL})
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: "
                         f"{sorted({'block_m', *stages, *_BUCKET_OPTIONAL})}")
    for key in ("block_m", *stages):
        if key not in bucket:
            raise ValueError(f"{where}: missing key {key!r}")
    # (an upper bound too: block_m pads every expert's rows, so a huge one from a file allocates E * block_m rows)
    if not _pow2(bucket["block_m"]) or not 16 <= bucket["block_m"] <= MAX_BLOCK_M:
        raise ValueError(f"{where}['block_m'] must be a power of two >= 16 and <= {MAX_BLOCK_M}, "
                         f"got {bucket['block_m']!r}")
    limit = bucket.get("max_rows_per_expert")  # compared with the load T*K/E: a number (NaN never matches)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit >= 0):
        raise ValueError(f"{where}['max_rows_per_expert'] must be a number >= 0 or null, got {limit!r}")
    for flag in ("tma", "pair_m"):
        if flag in bucket and not isinstance(bucket[flag], bool):
            raise TypeError(f"{where}[{flag!r}] must be true or false, got {bucket[flag]!r}")
    for stage in _GEMM_STAGES:
        check_stage(f"{where}[{stage!r}]", bucket[stage], _GEMM_KEYS, {**_GEMM_OPTIONAL, **_GEMM_ONLY})
        for key in _GATE_UP_ONLY:
            if stage != "gate_up" and key in bucket[stage]:
                raise ValueError(f"{where}[{stage!r}]: {key!r} is a gate_up key")
        if bucket[stage].get("GLUON", False) and (stage == "dgrad" or bucket["block_m"] != 128):
            raise ValueError(f"{where}[{stage!r}]['GLUON'] needs a gate_up or down stage and block_m 128 "
                             f"(the Gluon kernel's row tile), got stage {stage!r} and block_m {bucket['block_m']!r}")
    check_stage(f"{where}['wgrad']", bucket["wgrad"], _WGRAD_KEYS, _WGRAD_OPTIONAL)
    if "decode" in bucket:
        _check_decode(f"{where}['decode']", bucket["decode"])
    if bucket["wgrad"].get("FLAT_STEPS") and not bucket["wgrad"].get("PERSISTENT"):
        raise ValueError(f"{where}['wgrad']['FLAT_STEPS'] flattens the persistent tile loop; "
                         f"set 'PERSISTENT' (programs per SM) >= 1 too")


def _check_decode(where: str, decode: object) -> None:
    if not isinstance(decode, dict):
        raise TypeError(f"{where} must be a dict, got {type(decode).__name__}")
    unknown = sorted(set(decode) - {"max_tokens", "gate_up", "down"})
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: ['down', 'gate_up', 'max_tokens']")
    for key in ("max_tokens", "gate_up", "down"):
        if key not in decode:
            raise ValueError(f"{where}: missing key {key!r}")
    tokens = decode["max_tokens"]
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"{where}['max_tokens'] must be an int >= 1, got {tokens!r}")
    for stage in ("gate_up", "down"):
        c = decode[stage]
        # BLOCK_N may be as small as 4 here (rows of one expert's weight, not an MMA tile)
        check_stage(f"{where}[{stage!r}]", {**c, "BLOCK_N": 16} if isinstance(c, dict) and "BLOCK_N" in c else c,
                     _DECODE_KEYS, {"LOAD_STAGES": int})
        if not _pow2(c["BLOCK_N"]) or c["BLOCK_N"] < 4:
            raise ValueError(f"{where}[{stage!r}]['BLOCK_N'] must be a power of two >= 4, got {c['BLOCK_N']!r}")
        if c.get("LOAD_STAGES", 1) > 8:  # (as the fp8 decode key: more stages only add shared memory)
            raise ValueError(f"{where}[{stage!r}]['LOAD_STAGES'] must be in [1, 8], got {c['LOAD_STAGES']!r}")


def _check_lists(cfg: object, path: Path) -> None:
    """The file's bucket lists: `pick_config` falls back to the last default bucket (an empty shape
    list means the defaults)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: must hold a JSON object with `buckets`, got {type(cfg).__name__}")
    if not isinstance(cfg.get("buckets"), list) or not cfg["buckets"]:
        raise ValueError(f"{path}: `buckets` must be a non-empty list, got {cfg.get('buckets')!r}")
    shapes = cfg.get("shapes", {})
    if not isinstance(shapes, dict):
        raise ValueError(f"{path}: `shapes` must be an object of bucket lists, got {type(shapes).__name__}")
    for key, buckets in shapes.items():
        if not isinstance(buckets, list):
            raise ValueError(f"{path}: `shapes[{key!r}]` must be a list of buckets, got {buckets!r}")


def _load(capability: int) -> dict:
    key = (os.environ.get("KERNELHUB_MOE_CONFIG_DIR"), capability)
    cfg = _resolved.get(key)
    if cfg is None:
        cfg = _read(capability)
        with _lock:
            _resolved[key] = cfg
    return cfg


def _read(capability: int) -> dict:
    directory = Path(os.environ.get("KERNELHUB_MOE_CONFIG_DIR", _DIR))
    if not directory.is_dir():  # a typo would otherwise fall back to the shipped tiles silently
        raise ValueError(f"KERNELHUB_MOE_CONFIG_DIR={str(directory)!r} is not a directory "
                         "(it should hold the sm<capability>.json files tune_moe.py writes)")
    path = directory / f"sm{capability}.json"
    if not path.exists():
        # Unknown capability: the sm80 tiles are the safe generic choice (smaller shared memory).
        path = directory / ("sm90.json" if capability >= 90 else "sm80.json")
    if not path.exists():
        path = _DIR / ("sm90.json" if capability >= 90 else "sm80.json")
    with _lock:
        cfg = _cache.get(path)
        if cfg is None:
            cfg = json.loads(path.read_text())
            _check_lists(cfg, path)
            for i, bucket in enumerate(cfg["buckets"]):
                check_bucket(bucket, f"{path}: buckets[{i}]")
            for key, buckets in cfg.get("shapes", {}).items():
                for i, bucket in enumerate(buckets):
                    check_bucket(bucket, f"{path}: shapes[{key!r}][{i}]")
            _cache[path] = cfg
    return cfg


# Caches of answers derived from the buckets (the replayed decode launches), emptied with ours.
_derived: list[dict] = []


def derived_cache(cache: dict | None = None) -> dict:
    """`cache` (or a new dict) for answers derived from the picked buckets, emptied by
    `clear_config_cache`."""
    cache = {} if cache is None else cache
    with _lock:
        _derived.append(cache)
    return cache


def clear_config_cache() -> None:
    with _lock:
        _cache.clear()
        _resolved.clear()
        _fitted.clear()
        _picked.clear()
        for cache in _derived:
            cache.clear()


def shape_key(num_experts: int, hidden: int, intermediate: int) -> str:
    return f"E{num_experts}_H{hidden}_I{intermediate}"


def shape_buckets(capability: int, num_experts: int, hidden: int, intermediate: int) -> list[dict]:
    """The buckets `pick_config` walks for this shape, in order: shape-specific ones, else the defaults."""
    cfg = _load(capability)
    return cfg.get("shapes", {}).get(shape_key(num_experts, hidden, intermediate)) or cfg["buckets"]


def pick_config(capability: int, num_experts: int, hidden: int, intermediate: int, num_pairs: int) -> dict:
    """The bucket for this shape and load: shape-specific buckets first, then the defaults."""
    buckets = shape_buckets(capability, num_experts, hidden, intermediate)
    rows_per_expert = num_pairs / max(num_experts, 1)
    for bucket in buckets:
        limit = bucket.get("max_rows_per_expert")
        if limit is None or rows_per_expert <= limit:
            return bucket
    return buckets[-1]


def fit_shared_memory(bucket: dict, smem_per_block: int, element_size: int) -> dict:
    """A copy of `bucket` whose num_stages fit `smem_per_block` bytes (never below 2 stages).

    Why: the sm80 tiles also serve GPUs with ~100 KB of shared memory per block (sm86, sm89, sm120),
    where a 3-stage 64x128x64 gated tile (~120 KB if every stage is buffered) would not launch.
    The estimate is conservative: every stage buffered (true with TMA; Triton buffers one fewer
    with cp.async).
    """
    bm = bucket["block_m"] * (2 if bucket.get("pair_m") else 1)  # pair_m: tiles twice block_m tall
    out = dict(bucket)
    for stage, n_b in (("gate_up", 2), ("down", 1), ("dgrad", 1), ("wgrad", None)):
        c = dict(bucket[stage])
        fixed = 0
        if n_b is None:
            per_stage = (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * element_size
            if c.get("TMA_STORE"):  # the tile staged for its TMA store (its own buffer when persistent)
                fixed = c["BLOCK_M"] * c["BLOCK_N"] * element_size
        else:
            per_stage = (bm + n_b * c["BLOCK_N"]) * c["BLOCK_K"] * element_size
        while c["num_stages"] > 2 and c["num_stages"] * per_stage + fixed > smem_per_block:
            c["num_stages"] -= 1
        out[stage] = c
    if "decode" in bucket:
        decode = dict(bucket["decode"])
        for stage, n_w in (("gate_up", 2), ("down", 1)):
            c = dict(decode[stage])
            per_stage = (n_w * c["BLOCK_N"] + 1) * c["BLOCK_K"] * element_size  # weight rows + the vector
            while c["num_stages"] > 2 and c["num_stages"] * per_stage > smem_per_block:
                c["num_stages"] -= 1
            decode[stage] = c
        out["decode"] = decode
    return out


def fitted_config(bucket: dict, device_index: int, element_size: int, smem_per_block) -> dict:
    """`fit_shared_memory` cached per (bucket, device index); `smem_per_block()` is read on a miss."""
    key = (id(bucket), device_index, element_size)
    fitted = _fitted.get(key)
    if fitted is None:
        smem = smem_per_block()
        fitted = fit_shared_memory(bucket, smem, element_size) if smem else bucket
        with _lock:
            _fitted[key] = fitted
    return fitted


_picked: dict[tuple, dict] = {}
_MAX_PICKED = 4096  # a sweep over many token counts must not grow it forever


def picked_config(capability: int, num_experts: int, hidden: int, intermediate: int, num_pairs: int,
                  device_index: int, element_size: int, smem_per_block) -> dict:
    """`fitted_config(pick_config(...))` behind one dict lookup: an eager decode step pays for
    the bucket search and the environment read once per (shape, load, device)."""
    if type(num_pairs) is not int:  # a symbolic count (torch.compile, dynamic shapes): no cache key
        bucket = pick_config(capability, num_experts, hidden, intermediate, num_pairs)
        return fitted_config(bucket, device_index, element_size, smem_per_block)
    key = (os.environ.get("KERNELHUB_MOE_CONFIG_DIR"), capability, num_experts, hidden, intermediate, num_pairs,
           device_index, element_size)
    cfg = _picked.get(key)
    if cfg is None:
        bucket = pick_config(capability, num_experts, hidden, intermediate, num_pairs)
        cfg = fitted_config(bucket, device_index, element_size, smem_per_block)
        with _lock:
            if len(_picked) >= _MAX_PICKED:
                _picked.clear()
            _picked[key] = cfg
    return cfg
