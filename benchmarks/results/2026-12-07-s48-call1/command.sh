# s48-1: PDL + PREFETCH down (weights before the wait) whole calls; decode fixed-cost fit; DeepSeek-V3 sm80-variant decode A/B
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KERNELHUB_TEST_GPU=1 TRITON_INTERPRET=0
for w in .whl/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" 2>/dev/null; done
export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt; python3 -c "import torch,triton;print(torch.__version__,triton.__version__)" >> $OUT/gpu.txt; cat $OUT/gpu.txt
PAIRS_ONLY=1 timeout 120 python3 tools/diag_fp8_decode.py 2>&1 | grep -v -i warn | tee $OUT/diag_fp8_decode.log
timeout 100 python3 tools/diag_decode_scaling.py 2>&1 | grep -v -i warn | tee $OUT/decode_scaling.log
cand=$OUT/cand; mkdir -p $cand; cp kernels_repo/moe/torch-ext/moe/configs/*.json $cand/; cp benchmarks/candidates/fp8_sm80.json $cand/
for run in shipped cand cand2 shipped2; do
  case $run in cand*) dir=$cand;; *) dir=;; esac
  mkdir -p $OUT/$run
  env ${dir:+KERNELHUB_MOE_CONFIG_DIR=$dir} OUT=$OUT/$run PEERS=0 SHAPES=deepseek_v3 TOKENS=1 COMPILE=none timeout 75 python3 kernels_repo/moe/benchmarks/bench_fp8.py > $OUT/$run/bench.log 2>&1
  echo "== $run"; grep -E "T=1|kernelhub" $OUT/$run/bench.log | head -8
done
