TESTS_TIMEOUT=250 GPU_TESTS="kernels_repo/moe/tests/test_experts_gpu.py kernels_repo/moe/tests/test_experts_fp8.py kernels_repo/moe/tests/test_experts_replay.py" bash benchmarks/gpu_run.sh tests
