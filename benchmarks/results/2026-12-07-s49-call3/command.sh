# s49-3: fp8 decode Gluon kernels (stage key GLUON) against the shipped Triton ones (GPU tests first; each
# kernel alone, then whole calls incl. the best of each stage paired, Qwen3-30B-A3B T=1); the best
# whole call written as the Qwen3-30B-A3B T=1 decode key, then bench_fp8.py T=1 A B B A
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KERNELHUB_TEST_GPU=1 TRITON_INTERPRET=0
for w in .whl/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" 2>/dev/null; done
export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python3 -m pytest -q -x kernels_repo/moe/tests/test_experts_fp8_configs.py -k "gluon_decode or pdl_down" 2>&1 | tail -3
GLUON_ONLY=1 REPS=10 timeout 200 python3 tools/diag_fp8_decode.py 2>&1 | grep -v -i warn | tee $OUT/diag_fp8_decode.log
cand=$OUT/cand; mkdir -p $cand; cp kernels_repo/moe/torch-ext/moe/configs/*.json $cand/
python3 - "$OUT/diag_fp8_decode.log" "$cand/fp8_sm90.json" <<'PY'
import json, re, sys
best = min(((float(m.group(3)), json.loads(m.group(1)), json.loads(m.group(2))) for m in
            (re.match(r"call gate_up (\{.*?\}) down (\{.*?\}): ([\d.]+) us", l) for l in open(sys.argv[1])) if m),
           key=lambda r: r[0])
print("best call", best)
cfg = json.load(open(sys.argv[2]))
cfg["shapes"]["E128_H2048_I768"][0]["decode"] = {"max_tokens": 1, "gate_up": best[1], "down": best[2]}
json.dump(cfg, open(sys.argv[2], "w"), indent=1)
PY
for run in shipped cand cand2 shipped2; do
  case $run in cand*) dir=$cand;; *) dir=;; esac
  mkdir -p $OUT/$run
  env ${dir:+KERNELHUB_MOE_CONFIG_DIR=$dir} OUT=$OUT/$run PEERS=0 SHAPES=qwen3_30b_a3b TOKENS=1 COMPILE=none timeout 60 python3 kernels_repo/moe/benchmarks/bench_fp8.py > $OUT/$run/bench.log 2>&1
  echo "== $run"; grep -E "kernelhub" $OUT/$run/bench.log | head -8
done
