# s50-1 (s49's unrun call 4, reordered): GPU tests of the Gluon decode kernels; bench_fp8.py
# Qwen3-30B-A3B T=1, shipped against A (gate/up Gluon (16, 512, 8 warps), the s49-2 probe's best, down
# the shipped Triton tile with PDL) in the order shipped A A shipped; fp8diag's shipped and Gluon tiles
# (each kernel alone, then whole calls; the fastest written to best.json); then D (that call) D shipped
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KERNELHUB_TEST_GPU=1 TRITON_INTERPRET=0
for w in .whl/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" 2>/dev/null; done
export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__,triton.__version__)"
timeout 70 python3 -m pytest -q -x kernels_repo/moe/tests/test_experts_fp8_configs.py -k "gluon_decode or pdl_down" 2>&1 | tail -3
candidate() {  # $1: A (gate/up Gluon) or D (the decode key in best.json)
  mkdir -p $OUT/cand$1; cp kernels_repo/moe/torch-ext/moe/configs/*.json $OUT/cand$1/
  python3 - "$OUT/cand$1/fp8_sm90.json" $1 $OUT/best.json <<'PY'
import json, sys
cfg = json.load(open(sys.argv[1]))
d = cfg["shapes"]["E128_H2048_I768"][0]["decode"]
if sys.argv[2] == "A":
    d["gate_up"] = {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8, "num_stages": 2, "GLUON": True}
else:
    d.update(json.load(open(sys.argv[3])))
print(sys.argv[2], d)
json.dump(cfg, open(sys.argv[1], "w"), indent=1)
PY
}
bench() {  # runs named shipped*, A* or D*
  for run in "$@"; do
    case $run in A*) dir=$OUT/candA;; D*) dir=$OUT/candD;; *) dir=;; esac
    mkdir -p $OUT/$run
    env ${dir:+KERNELHUB_MOE_CONFIG_DIR=$dir} OUT=$OUT/$run PEERS=0 SHAPES=qwen3_30b_a3b TOKENS=1 COMPILE=none timeout 40 python3 kernels_repo/moe/benchmarks/bench_fp8.py > $OUT/$run/bench.log 2>&1
    echo "== $run"; grep -E "kernelhub_fp8:|kernelhub_bf16:" $OUT/$run/bench.log | head -3
  done
}
candidate A
bench shipped A A2 shipped2
BEST_OUT=$OUT/best.json GLUON_ONLY=1 REPS=10 timeout 120 python3 tools/diag_fp8_decode.py 2>&1 | grep -v -i warn | tee $OUT/diag_fp8_decode.log
candidate D
bench D D2 shipped3
