# s51-2: per-kernel GPU time of fp8 forwards at T=4096/16384 on an H100 (before the quantize-pass change)
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0  # (/tmp/site: s51-1's wheels)
FP8=1 POINTS=qwen3_30b_a3b:4096,qwen3_30b_a3b:16384,deepseek_v3:4096 MODES=fwd timeout 300 python3 tools/profile_moe.py 2>&1 | grep -v -i warn | tee $OUT/stdout.log
