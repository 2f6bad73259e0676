set -u
O=$OUT
mkdir -p $O/fp8tune
FP8_DECODE_ONLY=1 FP8_BUDGET_S=60 SHAPES=deepseek_v3 TOKENS=1 timeout 120 python3 kernels_repo/moe/benchmarks/tune_moe.py --fp8 --out $O/fp8tune > $O/fp8tune/tune.log 2>&1
echo "tune rc=$?"; grep -E "end to end|check|Error|error" $O/fp8tune/tune.log | cut -c1-300; tail -3 $O/fp8tune/tune.log | cut -c1-300
OUT=$O FP8_SHAPES=qwen3_30b_a3b,deepseek_v3 FP8_TOKENS=1 FP8_COMPILE=default FP8_TIMEOUT=170 bash benchmarks/gpu_run.sh fp8 2>&1 | tail -25   # (the tune step failed: pydantic is on the path only through gpu_run.sh's wheels)
