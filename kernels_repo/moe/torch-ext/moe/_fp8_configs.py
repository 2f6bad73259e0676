"""Tile configs of `fused_experts` on fp8 weights as data: `configs/fp8_<variant>.json`.

Why data, as for the 16-bit path (`_experts_configs`): the best tiles depend on the card and on
rows per expert (T*K/E), and `benchmarks/tune_moe.py --fp8` rewrites them. Same file shape:
"buckets" (applied while rows per expert <= "max_rows_per_expert", null = no limit) and
"shapes" ({"E{E}_H{H}_I{I}": [buckets]}) overriding them; `KERNELHUB_MOE_CONFIG_DIR` is read too.

A bucket: "block_m" (the routing alignment, power of two >= 16), "gate_up" and "down" stages
{"BLOCK_N", "num_warps", "num_stages"} and optional stage keys: "maxnreg"; "BLOCK_M" (the
stage's tile height, a divisor of block_m, default block_m: a 128-row gate/up tile holds two
fp32 accumulators plus the per-K-block products and spills, where two 64-row tiles of
128-row-aligned rows do not); "BLOCK_K" (the K step: 32, 64 or 128, the default; a divisor of the
scale block, fewer registers per step for the W8A16 conversion; x quantized in the load always
steps 128); "RESCALE" (with fp8 activations, the accumulator kept divided by the current
K-block's scales so that the MMA accumulates in place, without the per-K-block product's
registers: the same sum, one more fp32 rounding per K-block; see `_fp8_gemm_kernel`); "A_TMA"
(down: h through a TMA descriptor; gate/up, with fp8 math and x's quantize pass: that pass writes
x's rows in the aligned order, padding rows zero, and the GEMM reads them by TMA instead of
gathering them, for T*K instead of T rows quantized); gate/up only "FUSED" (with TMA weights and I
a multiple of BLOCK_N <= 128: the gate and up tiles as one TMA box and one MMA per K step, see
`_fp8_gemm_kernel`; elsewhere ignored); "PERSISTENT" (n >= 1, tiles as tall as block_m: n programs
per SM loop over the used rows' tiles in one flattened, software-pipelined loop; 0: one program
per tile); "GLUON" (sm90 fp8 math, block_m 128: the stage runs the warp-specialized Gluon kernel
of `_gluon_gemm`, 128 columns of h / 256 output columns per tile whatever BLOCK_N says, with up to
"num_stages" stages, x quantized in row order; where Gluon or a capability 9.0 device is missing,
or the shape does not fit its tiles, the Triton kernel runs). Bucket flags: "tma" (sm90: weights through TMA
descriptors, default true), "quant_x" (sm90: x quantized by its own pass before the gate/up
GEMM, default true; false: quantized inside that GEMM's load, once per column tile), "w8a16"
(sm90 variant: this bucket runs
the W8A16 math, 16-bit activations, e.g. at decode where weight bytes bound the time), "decode"
(the token-major kernels of `_fp8_decode` for calls of at most "max_tokens" tokens: {"max_tokens",
"gate_up", "down"}, each stage {"BLOCK_N" (weight rows per program, power of two >= 4),
"BLOCK_K" (16 to 1024, a power of two: a divisor of the scale block or whole scale blocks),
"num_warps", "num_stages", optional "PREFETCH" (bool, default false: each K step's loads issued
one step ahead, so a program keeps two steps' bytes in flight), "LOAD_STAGES" (int 1 to 8,
default 1: the K loop's loads pipelined through shared memory that many steps deep) and on
"down" only "PDL" (bool: on sm90 the down kernel is a programmatic dependent launch of gate/up,
started while gate/up finishes; elsewhere ignored) and "GLUON" (bool: on a capability 9.0 GPU
with Gluon the stage's kernel of `_fp8_decode_gluon` with this BLOCK_N, BLOCK_K (at most 512) and
num_warps, the load-mode keys unused; elsewhere the Triton kernel with all of them)}, and optionally
"fallback" (where a stage says GLUON: what runs instead of this entry on a device where the Gluon
kernels do not (sm89, the interpreter): another decode entry without GLUON or fallback, or null for
the bucket's grouped path)).
With fp8 activations the gate/up tile is 128 columns wide (one quantization group of h per tile,
quantized in its epilogue).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from ._experts_configs import MAX_BLOCK_M, check_stage, derived_cache, shape_key

_DIR = Path(__file__).resolve().parent / "configs"
_lock = threading.Lock()
# (directory setting, variant) -> parsed file; (..., E, H, I, pairs, smem) -> bucket. Emptied by
# `_experts_configs.clear_config_cache` (derived caches).
_files: dict = derived_cache()
_picked: dict = derived_cache()
_MAX_PICKED = 4096

# Interpreter (CPU tests): small tiles, every mask exercised, one stage.
FP8_INTERPRETER_CONFIG = {
    "block_m": 16,
    "gate_up": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 1},
    "down": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 1},
}

_STAGE_KEYS = ("BLOCK_N", "num_warps", "num_stages")
_STAGE_OPTIONAL = {"maxnreg": int, "A_TMA": bool, "BLOCK_M": int, "RESCALE": bool, "BLOCK_K": int, "FUSED": bool,
                   "PERSISTENT": int, "GLUON": bool}
_FLAGS = ("tma", "quant_x", "w8a16")
QUANT_GROUP = 128  # columns per activation scale (= the weights' scale block columns)


def _bad_int(v: object, low: int) -> bool:
    return not isinstance(v, int) or isinstance(v, bool) or v < low


def check_fp8_bucket(bucket: object, where: str, variant: str | None = None) -> None:
    """A bucket of configs/fp8_*.json (pinned `config=` or a file); `variant` adds its constraints:
    the sm90 fp8 math needs gate_up BLOCK_N = 128 (its epilogue quantizes h per 128 columns)."""
    if not isinstance(bucket, dict):
        raise TypeError(f"{where} must be a dict (a bucket of configs/fp8_*.json), got {type(bucket).__name__}")
    allowed = {"block_m", "gate_up", "down", "max_rows_per_expert", "decode", *_FLAGS}
    unknown = sorted(set(bucket) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {sorted(allowed)}")
    for key in ("block_m", "gate_up", "down"):
        if key not in bucket:
            raise ValueError(f"{where}: missing key {key!r}")
    bm = bucket["block_m"]
    if _bad_int(bm, 16) or bm & (bm - 1) or bm > MAX_BLOCK_M:
        raise ValueError(f"{where}['block_m'] must be a power of two >= 16 and <= {MAX_BLOCK_M}, got {bm!r}")
    limit = bucket.get("max_rows_per_expert")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit < 0):
        raise ValueError(f"{where}['max_rows_per_expert'] must be a number >= 0 or null, got {limit!r}")
    for flag in _FLAGS:
        if flag in bucket and not isinstance(bucket[flag], bool):
            raise TypeError(f"{where}[{flag!r}] must be true or false, got {bucket[flag]!r}")
    for stage in ("gate_up", "down"):
        c, at = bucket[stage], f"{where}[{stage!r}]"
        # the 16-bit path's stage checks (dict, keys, powers of two, warps, stages, registers, flags),
        # then the fp8 kernel's own ranges
        check_stage(at, c, _STAGE_KEYS, _STAGE_OPTIONAL)
        if c["BLOCK_N"] > 256:
            raise ValueError(f"{at}['BLOCK_N'] must be a power of two in [16, 256], got {c['BLOCK_N']!r}")
        if c.get("BLOCK_M", bm) > bm:
            raise ValueError(f"{at}['BLOCK_M'] must be a power of two in [16, block_m={bm}], got {c['BLOCK_M']!r}")
        if c.get("PERSISTENT", 0) and c.get("BLOCK_M", bm) != bm:
            raise ValueError(f"{at}['PERSISTENT'] needs the tile as tall as block_m={bm} (every tile below the "
                             f"used rows then starts on a real row), got BLOCK_M={c['BLOCK_M']!r}")
        if c.get("BLOCK_K", 128) not in (32, 64, 128):
            raise ValueError(f"{at}['BLOCK_K'] must be 32, 64 or 128 (a divisor of the scale block), "
                             f"got {c['BLOCK_K']!r}")
    if "decode" in bucket:
        _check_decode(f"{where}['decode']", bucket["decode"])
    if "FUSED" in bucket["down"]:
        raise ValueError(f"{where}['down']: 'FUSED' is a gate_up key (its gate and up tiles as one)")
    for stage in ("gate_up", "down"):
        if bucket[stage].get("GLUON", False) and (bm != 128 or bucket.get("w8a16", False)
                                                 or not bucket.get("quant_x", True)):
            raise ValueError(f"{where}[{stage!r}]['GLUON'] needs block_m 128 and fp8 activations from x's "
                             "quantize pass (not 'w8a16': true or 'quant_x': false)")
    if bucket["gate_up"].get("A_TMA", False) and (bucket.get("w8a16", False) or not bucket.get("quant_x", True)):
        raise ValueError(f"{where}['gate_up']['A_TMA'] needs fp8 activations from x's quantize pass "
                         "(not with 'w8a16': true or 'quant_x': false)")
    if variant == "sm90" and not bucket.get("w8a16", False) and bucket["gate_up"]["BLOCK_N"] != QUANT_GROUP:
        raise ValueError(f"{where}['gate_up']['BLOCK_N'] must be {QUANT_GROUP} on variant 'sm90' with fp8 "
                         f"activations (one quantization group of h per tile), got {bucket['gate_up']['BLOCK_N']!r}; "
                         "'w8a16': true lifts this")


_DECODE_BLOCK_K = (16, 32, 64, 128, 256, 512, 1024)


def decode_says_gluon(decode: dict) -> bool:
    """Whether a (checked) decode entry has a stage that runs its Gluon kernel where it can."""
    return any(decode[s].get("GLUON", False) for s in ("gate_up", "down"))


def _check_decode(where: str, decode: object, fallback: bool = False) -> None:
    """A "decode" entry; `fallback`: one given as another entry's "fallback" (no GLUON, no fallback)."""
    if not isinstance(decode, dict):
        raise TypeError(f"{where} must be a dict, got {type(decode).__name__}")
    keys = {"max_tokens", "gate_up", "down"}
    if set(decode) - {"fallback"} != keys or (fallback and "fallback" in decode):
        raise ValueError(f"{where}: keys must be {sorted(keys)}" + ("" if fallback else " and optionally 'fallback'")
                         + f", got {sorted(decode)}")
    if _bad_int(decode["max_tokens"], 1):
        raise ValueError(f"{where}['max_tokens'] must be an int >= 1, got {decode['max_tokens']!r}")
    for stage in ("gate_up", "down"):
        c, at = decode[stage], f"{where}[{stage!r}]"
        needed = {"BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}
        optional = ("PREFETCH", "LOAD_STAGES", "GLUON") + (("PDL",) if stage == "down" else ())
        if not isinstance(c, dict) or not needed <= set(c) <= needed | set(optional):
            raise ValueError(f"{at} must be a dict of BLOCK_N, BLOCK_K, num_warps, num_stages (and optionally "
                             f"{', '.join(optional)}), got {c!r}")
        for flag in ("PREFETCH", "PDL", "GLUON"):
            if not isinstance(c.get(flag, False), bool):
                raise TypeError(f"{at}[{flag!r}] must be a bool, got {c[flag]!r}")
        if not isinstance(c.get("LOAD_STAGES", 1), int) or isinstance(c.get("LOAD_STAGES"), bool):
            raise TypeError(f"{at}['LOAD_STAGES'] must be an int, got {c['LOAD_STAGES']!r}")
        if not 1 <= c.get("LOAD_STAGES", 1) <= 8:
            raise ValueError(f"{at}['LOAD_STAGES'] must be in [1, 8], got {c['LOAD_STAGES']!r}")
        if _bad_int(c["BLOCK_N"], 4) or c["BLOCK_N"] & (c["BLOCK_N"] - 1) or c["BLOCK_N"] > 256:
            raise ValueError(f"{at}['BLOCK_N'] must be a power of two in [4, 256], got {c['BLOCK_N']!r}")
        if c["BLOCK_K"] not in _DECODE_BLOCK_K or isinstance(c["BLOCK_K"], bool):
            raise ValueError(f"{at}['BLOCK_K'] must be one of {_DECODE_BLOCK_K} (a divisor of the scale block or "
                             f"whole scale blocks), got {c['BLOCK_K']!r}")
        if c.get("GLUON", False) and c["BLOCK_K"] > 512:  # (a row's 16-column runs within one warp)
            raise ValueError(f"{at}['BLOCK_K'] must be at most 512 with GLUON, got {c['BLOCK_K']!r}")
        if c.get("GLUON", False) and fallback:
            raise ValueError(f"{at}['GLUON']: a fallback runs where the Gluon kernels do not, so it cannot say GLUON")
        if c["num_warps"] not in (1, 2, 4, 8, 16) or isinstance(c["num_warps"], bool):
            raise ValueError(f"{at}['num_warps'] must be 1, 2, 4, 8 or 16, got {c['num_warps']!r}")
        if _bad_int(c["num_stages"], 1):
            raise ValueError(f"{at}['num_stages'] must be an int >= 1, got {c['num_stages']!r}")
    if "fallback" in decode:
        if not decode_says_gluon(decode):
            raise ValueError(f"{where}['fallback'] applies where a GLUON stage's Gluon kernel does not run; "
                             "no stage here says GLUON")
        if decode["fallback"] is not None:
            _check_decode(f"{where}['fallback']", decode["fallback"], fallback=True)


def _check_file(cfg: object, path: Path) -> None:
    """The file's frame (the buckets are checked one by one after): an error naming the file, not a
    KeyError or IndexError in the lookup (a file under KERNELHUB_MOE_CONFIG_DIR is untrusted)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(cfg).__name__}")
    if not isinstance(cfg.get("buckets"), list) or not cfg["buckets"]:
        raise ValueError(f"{path}: needs a list 'buckets' of at least one bucket")
    shapes = cfg.get("shapes", {})
    if not isinstance(shapes, dict) or not all(isinstance(b, list) for b in shapes.values()):
        raise ValueError(f"{path}: 'shapes' must map E{{E}}_H{{H}}_I{{I}} keys to lists of buckets")


def _read(variant: str) -> dict:
    env = os.environ.get("KERNELHUB_MOE_CONFIG_DIR")
    key = (env, variant)
    cfg = _files.get(key)
    if cfg is not None:
        return cfg
    directory = Path(env) if env else _DIR
    if not directory.is_dir():
        raise ValueError(f"KERNELHUB_MOE_CONFIG_DIR={str(directory)!r} is not a directory "
                         "(it should hold the fp8_<variant>.json files tune_moe.py --fp8 writes)")
    path = directory / f"fp8_{variant}.json"
    if not path.exists():  # a directory of 16-bit tiles only: the shipped fp8 tiles
        path = _DIR / f"fp8_{variant}.json"
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    _check_file(cfg, path)
    for i, bucket in enumerate(cfg["buckets"]):
        check_fp8_bucket(bucket, f"{path}: buckets[{i}]", variant)
    for name, buckets in cfg.get("shapes", {}).items():
        for i, bucket in enumerate(buckets):
            check_fp8_bucket(bucket, f"{path}: shapes[{name!r}][{i}]", variant)
    with _lock:
        _files[key] = cfg
    return cfg


def pick_fp8_config(variant: str, num_experts: int, hidden: int, intermediate: int, num_pairs: int) -> dict:
    """The bucket of configs/fp8_<variant>.json for this shape and load (shape buckets first)."""
    cfg = _read(variant)
    buckets = cfg.get("shapes", {}).get(shape_key(num_experts, hidden, intermediate)) or cfg["buckets"]
    rows_per_expert = num_pairs / max(num_experts, 1)
    for bucket in buckets:
        limit = bucket.get("max_rows_per_expert")
        if limit is None or rows_per_expert <= limit:
            return bucket
    return buckets[-1]


def fit_fp8_shared_memory(bucket: dict, smem_per_block: int, a_bytes: int, in_load: bool = False) -> dict:
    """A copy of `bucket` whose num_stages fit `smem_per_block` (never below 2): the sm90 tiles
    also run on sm89 (~100 KB per block). Per stage: the A tile (a_bytes per element: 1 with fp8
    activations, 2 for 16-bit) and the fp8 weight tiles (two for gate/up), BLOCK_K deep (in_load:
    gate/up quantizes x in its load, which steps whole 128-column groups whatever BLOCK_K says)."""
    out = dict(bucket)
    for stage, n_b in (("gate_up", 2), ("down", 1)):
        c = dict(bucket[stage])
        depth = QUANT_GROUP if in_load and stage == "gate_up" else c.get("BLOCK_K", 128)
        per_stage = (c.get("BLOCK_M", bucket["block_m"]) * a_bytes + n_b * c["BLOCK_N"]) * depth
        while c["num_stages"] > 2 and c["num_stages"] * per_stage > smem_per_block:
            c["num_stages"] -= 1
        out[stage] = c
    return out


def picked_fp8_config(variant: str, num_experts: int, hidden: int, intermediate: int, num_pairs: int,
                      smem_per_block: int | None, x_bytes: int = 2) -> dict:
    """`pick_fp8_config` (stages fitted to `smem_per_block` bytes when given, for 16-bit A tiles of
    `x_bytes` per element: 4 for float32 x) behind one dict lookup."""
    key = (os.environ.get("KERNELHUB_MOE_CONFIG_DIR"), variant, num_experts, hidden, intermediate, num_pairs,
           smem_per_block, x_bytes)
    cfg = _picked.get(key)
    if cfg is None:
        cfg = pick_fp8_config(variant, num_experts, hidden, intermediate, num_pairs)
        if smem_per_block:
            # (16-bit A tiles: W8A16 math, and x quantized in the gate/up load; down reads fp8 h there)
            fp8_math = variant == "sm90" and not cfg.get("w8a16", False)
            fp8_a = fp8_math and cfg.get("quant_x", True)
            cfg = fit_fp8_shared_memory(cfg, smem_per_block, 1 if fp8_a else x_bytes, in_load=fp8_math and not fp8_a)
        with _lock:
            if len(_picked) >= _MAX_PICKED:
                _picked.clear()
            _picked[key] = cfg
    return cfg
