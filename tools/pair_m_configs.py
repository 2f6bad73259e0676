"""Write a config directory in which the shipped buckets with 128-row tiles pad rows to 64 and pair
them ("pair_m"), for an A/B of fused_experts end to end:

    python tools/pair_m_configs.py /tmp/pair_m
    KERNELHUB_MOE_CONFIG_DIR=/tmp/pair_m python kernels_repo/moe/benchmarks/bench_moe.py

Every other key of every bucket stays as shipped, so the two runs differ only in the padding.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "kernels_repo" / "moe" / "torch-ext" / "moe" / "configs"


def paired(bucket: dict) -> dict:
    if bucket["block_m"] != 128 or bucket.get("pair_m"):
        return bucket
    out = copy.deepcopy(bucket)
    out.update(block_m=64, pair_m=True)
    return out


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: pair_m_configs.py OUTDIR")
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(CONFIGS.glob("sm*.json")):
        data = json.loads(path.read_text())
        data["buckets"] = [paired(b) for b in data["buckets"]]
        data["shapes"] = {k: [paired(b) for b in v] for k, v in data.get("shapes", {}).items()}
        data["note"] = f"{path.name} with 128-row buckets as block_m=64 + pair_m (pair_m_configs.py)"
        (out_dir / path.name).write_text(json.dumps(data, indent=1) + "\n")
        changed = sum(b.get("pair_m", False) for b in data["buckets"])
        print(f"wrote {out_dir / path.name}: {changed} bucket(s) paired")


if __name__ == "__main__":
    main()
