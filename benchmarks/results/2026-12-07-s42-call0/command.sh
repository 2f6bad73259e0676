# one GPU call (not committed): fp8 decode GPU tests, the decode-only sweep at Qwen3-30B-A3B, then bench_fp8 shipped vs merged
set -u
O=${OUT:?}
GPU_TESTS="kernels_repo/moe/tests/test_experts_fp8.py kernels_repo/moe/tests/test_experts_fp8_configs.py" GPU_K="decode or pinned_paths" TESTS_TIMEOUT=150 bash benchmarks/gpu_run.sh tests
tail -3 $O/gpu_tests.log
if grep -qE "^(FAILED|ERROR)" $O/gpu_tests.log; then echo "tests failed: stop"; exit 1; fi
FP8_DECODE_ONLY=1 SHAPES=qwen3_30b_a3b TOKENS=1,4 FP8_BUDGET_S=150 TUNE_TIMEOUT=190 TUNE_ARGS="--fp8 --out $O/fp8" bash benchmarks/gpu_run.sh tune
grep -E "end to end|check:|wrote" $O/tune_moe.log
mkdir -p $O/cfg && cp kernels_repo/moe/torch-ext/moe/configs/*.json $O/cfg/ && python3 tools/merge_fp8_decode.py $O/fp8/fp8_sm90.json $O/cfg
for r in shipped merged shipped2 merged2; do
  case $r in merged*) d=$O/cfg;; *) d=;; esac
  peers=0; [ $r = merged2 ] && peers=1
  env ${d:+KERNELHUB_MOE_CONFIG_DIR=$d} PEERS=$peers OUT=$O/$r FP8_SHAPES=qwen3_30b_a3b FP8_TOKENS=1,32 FP8_COMPILE=none FP8_TIMEOUT=90 bash benchmarks/gpu_run.sh fp8 | grep -E "kernelhub|torch" | sed "s/^/$r /"
done
