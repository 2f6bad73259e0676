"""An sm90.json whose block_m-128 buckets run the forward GEMMs in the Gluon kernel (stage key
"GLUON", `_gluon_gemm`), for an A/B against the shipped tiles:

    python tools/gluon_sm90_config.py /tmp/gluon/sm90.json [--stages gate_up,down] [--group-m 8]
    CFG_A=/tmp/gluon/sm90.json MODES=fwd bash benchmarks/gpu_run.sh cfgab

Only inference reads the key (training keeps the Triton tiles of the same stages).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "kernels_repo" / "moe" / "torch-ext" / "moe" / "configs"


def with_gluon(data: dict, stages: list[str], group_m: int | None) -> dict:
    out = json.loads(json.dumps(data))
    for bucket in out["buckets"] + [b for bs in out.get("shapes", {}).values() for b in bs]:
        if bucket["block_m"] != 128:
            continue
        for stage in stages:
            bucket[stage]["GLUON"] = True
            if group_m is not None:
                bucket[stage]["GROUP_M"] = group_m
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--stages", default="gate_up,down")
    ap.add_argument("--group-m", type=int, default=None, help="the Gluon tile order's row blocks per group")
    args = ap.parse_args()
    data = with_gluon(json.loads((CONFIGS / "sm90.json").read_text()), args.stages.split(","), args.group_m)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
