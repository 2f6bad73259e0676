DECODE_KIND=bf16 DECODE_SHAPES=qwen3_30b_a3b,deepseek_v3 DECODE_BUDGET_S=110 FP8_TIMEOUT=70 bash benchmarks/gpu_run.sh decodeab   # at 820f7b3, H100 80GB
