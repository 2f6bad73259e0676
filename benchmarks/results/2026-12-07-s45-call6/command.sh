DECODE_KIND=fp8 DECODE_SHAPES=deepseek_v3 DECODE_BUDGET_S=70 FP8_TIMEOUT=60 bash benchmarks/gpu_run.sh decodeab
