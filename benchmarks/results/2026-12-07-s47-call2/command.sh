# at f846c05, H100 80GB (same machine, right after call 1)
DECODE_KIND=bf16 DECODE_BUDGET_S=80 FP8_TIMEOUT=35 bash benchmarks/gpu_run.sh decodeab
