DECODE_KIND=bf16 DECODE_BUDGET_S=80 FP8_TIMEOUT=50 bash benchmarks/gpu_run.sh decodeab   # at 4bb7bcd (bench runs failed as in call0)
