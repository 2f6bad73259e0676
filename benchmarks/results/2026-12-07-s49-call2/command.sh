# s49-2: Gluon fp8 decode gate/up probe (explicit layouts, no shared memory; fp32 or fp16 run sums)
# against the shipped Triton gate/up kernel, Qwen3-30B-A3B T=1
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
for w in .whl/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" 2>/dev/null; done
export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 benchmarks/results/2026-12-07-s49-call2/probe_gluon_decode.py 2>&1 | grep -v -i warn | tee $OUT/probe.log
