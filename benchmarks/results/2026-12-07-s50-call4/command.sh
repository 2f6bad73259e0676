# s50-4 (at the commit that ships both decode stages in Gluon for Qwen3-30B-A3B and DeepSeek-V3 in
# fp8_sm90.json): the fp8 GPU tests; bench_fp8.py at T=1 with peers (eager and compiled), both shapes
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KERNELHUB_TEST_GPU=1 TRITON_INTERPRET=0
for w in .whl/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" 2>/dev/null; done
export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 -m pytest -q -m gpu kernels_repo/moe/tests/test_experts_fp8.py kernels_repo/moe/tests/test_experts_fp8_configs.py 2>&1 | tail -4
OUT=$OUT SHAPES=qwen3_30b_a3b,deepseek_v3 TOKENS=1 COMPILE=default timeout 220 python3 kernels_repo/moe/benchmarks/bench_fp8.py 2>&1 | grep -E "^fp8|ceiling|skip" | tee $OUT/bench_fp8.log
