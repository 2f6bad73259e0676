# the token-major pass is not in the shipped tree (reverted until it runs on a GPU): it is commit 1a8751a's.
# needs .new_moe (git-ignored, carried): mkdir -p .new_moe && git archive 1a8751a kernels_repo/moe | tar -x -C .new_moe
# s52-1 (written in s51 as s51-3, not run then): the quantize pass token-major (each token read once, stored to its K rows; padding rows zeroed
# by per-expert programs; rows past the used ones skipped): per-kernel GPU time old
# (shipped) / new (MOE_DIR=.new_moe), then GPU tests of the pinned sm90 paths, then bench_fp8 at Qwen3-30B-A3B
# T=4096 and 16384 (lean: the session's device time left one short call)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KERNELHUB_TEST_GPU=1 TRITON_INTERPRET=0
for w in .whl/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" 2>/dev/null; done
export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
P=qwen3_30b_a3b:4096,qwen3_30b_a3b:16384
for which in old new; do
  echo "== $which"
  if [ $which = new ]; then export MOE_DIR=$PWD/.new_moe/kernels_repo/moe; else unset MOE_DIR; fi
  FP8=1 POINTS=$P MODES=fwd timeout 90 python3 tools/profile_moe.py 2>&1 | grep -E "profile|quantize|GPU kernels"
done
unset MOE_DIR
cp -r .new_moe/kernels_repo/moe/. kernels_repo/moe/  # (the tests and bench_fp8 below: the new pass)
timeout 80 python3 -m pytest -q -m gpu kernels_repo/moe/tests/test_experts_fp8_configs.py -k "gpu_sm90_pinned" 2>&1 | tail -3
for st in qwen3_30b_a3b:4096,16384; do
  OUT=$OUT SHAPES=${st%%:*} TOKENS=${st#*:} COMPILE=default timeout 100 python3 kernels_repo/moe/benchmarks/bench_fp8.py 2>&1 | grep -E "^fp8|ceiling|skip" | grep -v "skip tf"
done | tee $OUT/bench_fp8.log
