set -u
O=$OUT
mkdir -p $O/bf16 $O/fp8
OUT=$O/bf16 DECODE_KIND=bf16 DECODE_SHAPES=qwen3_30b_a3b,deepseek_v3 DECODE_BUDGET_S=100 FP8_TIMEOUT=60 bash benchmarks/gpu_run.sh decodeab 2>&1 | grep -v "^[<>-]\|^[0-9]" | tail -30
python3 -c "
import json,sys
d=json.load(open('$O/bf16/decode_cfg/sm90.json'))
for k,v in d.get('shapes',{}).items():
    print(k, json.dumps(v[0].get('decode')))
"
cp $O/bf16/decode_cfg/sm90.json $O/sm90_merged.json
grep -E "end to end|check" $O/bf16/decode_tune.log
FP8_DECODE_ONLY=1 FP8_BUDGET_S=70 SHAPES=deepseek_v3 TOKENS=1 timeout 110 python3 kernels_repo/moe/benchmarks/tune_moe.py --fp8 --out $O/fp8/tuned > $O/fp8/tune.log 2>&1
grep -E "end to end|check|best fp8" $O/fp8/tune.log | cut -c1-400
