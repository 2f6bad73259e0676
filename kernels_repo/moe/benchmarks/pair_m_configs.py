"""Write a config directory in which the shipped buckets with 128-row tiles run paired tiles, for an
A/B of fused_experts end to end:

    python kernels_repo/moe/benchmarks/pair_m_configs.py /tmp/pair_m            # block_m=64 + "pair_m"
    python kernels_repo/moe/benchmarks/pair_m_configs.py --split /tmp/split     # 128 + "pair_split_n"
    KERNELHUB_MOE_CONFIG_DIR=/tmp/pair_m python kernels_repo/moe/benchmarks/bench_moe.py

Default: rows padded to 64, two 64-row blocks of an expert as one 128-row tile. --split: rows stay
padded to 128 and two blocks of an expert run as one 256-row tile in two half-width passes, so
that an expert's weights are read once where it has two blocks. Every other key of every bucket
stays as shipped, so the two runs differ only in that.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "build" / "torch-universal" / "moe" / "configs"


def paired(bucket: dict, split: bool = False) -> dict:
    if bucket["block_m"] != 128 or bucket.get("pair_m"):
        return bucket
    out = copy.deepcopy(bucket)
    if split:
        out.update(pair_m=True, pair_split_n=True)
    else:
        out.update(block_m=64, pair_m=True)
    return out


def main() -> None:
    args = sys.argv[1:]
    split = "--split" in args
    args = [a for a in args if a != "--split"]
    if len(args) != 1:
        raise SystemExit("usage: pair_m_configs.py [--split] OUTDIR")
    out_dir = Path(args[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(CONFIGS.glob("sm*.json")):
        data = json.loads(path.read_text())
        data["buckets"] = [paired(b, split) for b in data["buckets"]]
        data["shapes"] = {k: [paired(b, split) for b in v] for k, v in data.get("shapes", {}).items()}
        how = "pair_m + pair_split_n" if split else "block_m=64 + pair_m"
        data["note"] = f"{path.name} with 128-row buckets as {how} (pair_m_configs.py)"
        (out_dir / path.name).write_text(json.dumps(data, indent=1) + "\n")
        changed = sum(b.get("pair_m", False) for b in data["buckets"])
        print(f"wrote {out_dir / path.name}: {changed} bucket(s) paired")


if __name__ == "__main__":
    main()
