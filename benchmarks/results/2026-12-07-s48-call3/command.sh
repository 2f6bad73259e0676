# s48-3: tensor-core (MMA) fp8 decode gate/up tiles against the shipped tile: each kernel alone, then whole calls
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KERNELHUB_TEST_GPU=1 TRITON_INTERPRET=0
for w in .whl/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" 2>/dev/null; done
export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 280 python3 tools/diag_fp8_decode.py 2>&1 | grep -v -i warn | tee $OUT/diag_fp8_decode.log
