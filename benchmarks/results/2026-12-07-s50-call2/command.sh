# s50-2: DeepSeek-V3 T=1 with the Gluon decode kernels (its sm90 entry has no decode key: the grouped
# path runs); bench_fp8.py shipped against C (both stages Gluon: s50-1's fastest call, gate/up (16, 512,
# 8 warps), down (4, 256, 8 warps) with PDL) in the order shipped C C shipped; Qwen3-30B-A3B T=1 with
# s50-1's candidate D (the same tiles) against shipped again; then the GPU kernels of one fp8 forward at T=4096 (tools/profile_moe.py FP8=1)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KERNELHUB_TEST_GPU=1 TRITON_INTERPRET=0
for w in .whl/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" 2>/dev/null; done
export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/candC; cp kernels_repo/moe/torch-ext/moe/configs/*.json $OUT/candC/
python3 - "$OUT/candC/fp8_sm90.json" <<'PY'
import json, sys
cfg = json.load(open(sys.argv[1]))
b = cfg["shapes"]["E256_H7168_I2048"][0]
b["decode"] = {
    "gate_up": {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8, "num_stages": 2, "GLUON": True},
    "down": {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 8, "num_stages": 2, "PDL": True, "GLUON": True},
    "max_tokens": 1,
}
print("C", b["decode"])
json.dump(cfg, open(sys.argv[1], "w"), indent=1)
PY
for run in shipped C C2 shipped2; do
  case $run in C*) dir=$OUT/candC;; *) dir=;; esac
  mkdir -p $OUT/$run
  env ${dir:+KERNELHUB_MOE_CONFIG_DIR=$dir} OUT=$OUT/$run PEERS=0 SHAPES=deepseek_v3 TOKENS=1 COMPILE=none timeout 75 python3 kernels_repo/moe/benchmarks/bench_fp8.py > $OUT/$run/bench.log 2>&1
  echo "== $run"; grep -E "kernelhub_fp8:|kernelhub_bf16:" $OUT/$run/bench.log | head -3
done
mkdir -p $OUT/candD; cp kernels_repo/moe/torch-ext/moe/configs/*.json $OUT/candD/
python3 - "$OUT/candD/fp8_sm90.json" <<'PY'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg["shapes"]["E128_H2048_I768"][0]["decode"].update(
    gate_up={"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8, "num_stages": 2, "GLUON": True},
    down={"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 8, "num_stages": 2, "GLUON": True, "PDL": True})
json.dump(cfg, open(sys.argv[1], "w"), indent=1)
PY
for run in qD qshipped qD2 qshipped2; do
  case $run in qD*) dir=$OUT/candD;; *) dir=;; esac
  mkdir -p $OUT/$run
  env ${dir:+KERNELHUB_MOE_CONFIG_DIR=$dir} OUT=$OUT/$run PEERS=0 SHAPES=qwen3_30b_a3b TOKENS=1 COMPILE=none timeout 40 python3 kernels_repo/moe/benchmarks/bench_fp8.py > $OUT/$run/bench.log 2>&1
  echo "== $run"; grep -E "kernelhub_fp8:|kernelhub_bf16:" $OUT/$run/bench.log | head -3
done
FP8=1 POINTS=qwen3_30b_a3b:4096,deepseek_v3:4096 MODES=fwd REPS=10 timeout 150 python3 tools/profile_moe.py 2>&1 | grep -v -i warn | tee $OUT/profile_fp8.log
