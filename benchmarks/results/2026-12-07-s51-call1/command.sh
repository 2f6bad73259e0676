# s51-1 (written in s50, not yet run): the shipped Gluon fp8 decode on an H100 (s50 had only an
# H200): GPU tests of the fp8 decode paths at HEAD (fallback key included), fp8 / bf16 by CUDA-graph
# GPU time at T=1, 2, 4 (tools/decode_graph_ratio.py), then bench_fp8.py at T=1 with peers
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KERNELHUB_TEST_GPU=1 TRITON_INTERPRET=0
for w in .whl/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" 2>/dev/null; done
export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader; python3 -c "import torch,triton;print(torch.__version__,triton.__version__)"
timeout 150 python3 -m pytest -q -m gpu kernels_repo/moe/tests/test_experts_fp8_configs.py -k "decode or pinned" 2>&1 | tail -3
for T in 1 2 4; do T=$T timeout 60 python3 tools/decode_graph_ratio.py 2>&1 | grep -v -i warn; done | tee $OUT/decode_graph_ratio.log
OUT=$OUT SHAPES=qwen3_30b_a3b,deepseek_v3 TOKENS=1 COMPILE=default timeout 220 python3 kernels_repo/moe/benchmarks/bench_fp8.py 2>&1 | grep -E "^fp8|ceiling|skip" | tee $OUT/bench_fp8.log
