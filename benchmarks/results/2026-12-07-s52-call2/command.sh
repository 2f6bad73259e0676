# NOT RUN in s52: fourteen tries to start a device machine were refused (1 530 s of the 1 800 s of device
# time) until too little was left to start one; kept for the next session (rename the folder to that run).
# s52-2 (after s52-1, same machine): bench_fp8 with the token-major quantize pass (1a8751a's kernels_repo/moe,
# carried as .new_moe, with this tree's bench_fp8.py, which also times kernelhub's fp8 call compiled): T=1
# both shapes, kernelhub and the peer compiled (default and reduce-overhead), then DeepSeek-V3 T=4096, 16384
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 KERNELHUB_TEST_GPU=1 TRITON_INTERPRET=0  # (/tmp/site: s52-1's wheels)
[ -d /tmp/site/pydantic ] || for w in .whl/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" 2>/dev/null; done
nvidia-smi --query-gpu=name --format=csv,noheader
cp kernels_repo/moe/benchmarks/bench_fp8.py /tmp/bench_fp8.py
cp -r .new_moe/kernels_repo/moe/. kernels_repo/moe/
cp /tmp/bench_fp8.py kernels_repo/moe/benchmarks/bench_fp8.py
OUT=$OUT SHAPES=qwen3_30b_a3b,deepseek_v3 TOKENS=1 COMPILE=default,reduce-overhead timeout 150 python3 kernels_repo/moe/benchmarks/bench_fp8.py 2>&1 | grep -E "^fp8|ceiling|skip" | grep -v "skip tf" | tee $OUT/bench_fp8_t1.log
OUT=$OUT SHAPES=deepseek_v3 TOKENS=4096,16384 COMPILE=default timeout 300 python3 kernels_repo/moe/benchmarks/bench_fp8.py 2>&1 | grep -E "^fp8|ceiling|skip" | grep -v "skip tf" | tee $OUT/bench_fp8.log
