"""Merge the "decode" keys of a decode-only sweep (`tune_moe.py --fp8` with FP8_DECODE_ONLY=1, or
the 16-bit `tune_moe.py` with DECODE_ONLY=1) into the shipped config of the same file name
(`fp8_sm90.json`, `sm90.json`, ...), so that the other buckets of each shape stay as shipped.

The sweep writes each shape's entry as just the buckets it tuned; this takes, per shape, the decode
key of the tuned bucket with the largest `max_tokens` and sets it on the shipped shape's first
bucket (or removes it where the sweep kept none: the grouped path won); a shipped entry's
"fallback" (what runs where the Gluon kernels do not) stays beside a new entry with GLUON stages. A
shape the shipped file has no entry for gets one: a copy of the default buckets, with the key on the first.

Usage: python tools/merge_fp8_decode.py TUNED.json OUT_DIR_OR_FILE [--variant sm90]
(TUNED.json named like a shipped file merges into that file; else into fp8_<variant>.json)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SHIPPED = Path(__file__).resolve().parents[1] / "kernels_repo" / "moe" / "torch-ext" / "moe" / "configs"


def merge(tuned: dict, shipped: dict) -> dict:
    out = json.loads(json.dumps(shipped))
    for key, buckets in tuned.get("shapes", {}).items():
        decodes = [b["decode"] for b in buckets if isinstance(b, dict) and "decode" in b]
        if key not in out.get("shapes", {}):
            if not decodes:
                print(f"{key}: not a shipped shape and no decode key, skipped")
                continue
            out.setdefault("shapes", {})[key] = json.loads(json.dumps(out["buckets"]))
        first = out["shapes"][key][0]
        if decodes:
            d, was = max(decodes, key=lambda d: d["max_tokens"]), first.get("decode") or {}
            if "fallback" in was and any(d[s].get("GLUON", False) for s in ("gate_up", "down")):
                d = {**d, "fallback": was["fallback"]}  # (what sm89 runs: the sweep times sm90 only)
            first["decode"] = d
            print(f"{key}: decode {json.dumps(first['decode'], sort_keys=True)}")
        else:
            first.pop("decode", None)
            print(f"{key}: no decode key (the grouped path won)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tuned")
    ap.add_argument("out")
    ap.add_argument("--variant", default="sm90")
    args = ap.parse_args()
    name = Path(args.tuned).name
    if not (SHIPPED / name).is_file():
        name = f"fp8_{args.variant}.json"
    merged = merge(json.loads(Path(args.tuned).read_text()), json.loads((SHIPPED / name).read_text()))
    out = Path(args.out)
    if out.suffix != ".json":
        out.mkdir(parents=True, exist_ok=True)
        out = out / name
    out.write_text(json.dumps(merged, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
