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

# Small tiles for the Triton interpreter (CPU tests): few programs, every mask exercised.
INTERPRETER_CONFIG = {
    "block_m": 16,
    "gate_up": {"BLOCK_N": 16, "BLOCK_K": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 1},
    "down": {"BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 1},
    "dgrad": {"BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 1},
    "wgrad": {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1},
}


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
            _cache[path] = cfg
    return cfg


def clear_config_cache() -> None:
    with _lock:
        _cache.clear()
        _resolved.clear()


def shape_key(num_experts: int, hidden: int, intermediate: int) -> str:
    return f"E{num_experts}_H{hidden}_I{intermediate}"


def pick_config(capability: int, num_experts: int, hidden: int, intermediate: int, num_pairs: int) -> dict:
    """The bucket for this shape and load: shape-specific buckets first, then the defaults."""
    cfg = _load(capability)
    buckets = cfg.get("shapes", {}).get(shape_key(num_experts, hidden, intermediate)) or cfg["buckets"]
    rows_per_expert = num_pairs / max(num_experts, 1)
    for bucket in buckets:
        limit = bucket.get("max_rows_per_expert")
        if limit is None or rows_per_expert <= limit:
            return bucket
    return buckets[-1]
