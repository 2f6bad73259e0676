# one GPU call (not committed): Mixtral T=16384 kernelhub eager vs compiled in both orders; DeepSeek-V3 bf16 gate/up in Gluon against the shipped tiles
set -u
O=${OUT:?}
for run in eager-first compiled-first eager-first-again; do
  env ORDER=${run%-again} OUT=$O/$run SHAPES=mixtral_8x7b TOKENS=16384 IMPLS=kernelhub COMPILE=default MODES=fwd STAGES=0 MOE_TIMEOUT=120 bash benchmarks/gpu_run.sh moe > /dev/null 2>&1
  grep -h '"moe_fwd"' $O/$run/bench_moe.jsonl | python3 -c "import sys,json; [print('$run', r['impl'], round(r['ms'],3)) for r in map(json.loads, sys.stdin)]"
done
python3 tools/gluon_sm90_config.py /tmp/gluon_gu.json --stages gate_up
CFG_A=/tmp/gluon_gu.json SHAPES=deepseek_v3 TOKENS=4096,16384 MODES=fwd STAGES=0 MOE_TIMEOUT=170 bash benchmarks/gpu_run.sh cfgab 2>&1 | grep -E "moe_fwd|error|Error" | cut -c1-200
