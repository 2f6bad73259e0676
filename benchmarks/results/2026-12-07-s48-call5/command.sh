# s48-5: Nsight Compute full set (stall reasons, memory tables, source counters) of the fp8 and the
# bf16 decode gate/up kernels at Qwen3-30B-A3B T=1 (tools/ncu_decode.py)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KERNELHUB_TEST_GPU=1 TRITON_INTERPRET=0
for w in .whl/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" 2>/dev/null; done
export PYTHONPATH=$PYTHONPATH:/tmp/site
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout 200 "$NCU" -k "regex:gate_up" -c 2 --set full python3 tools/ncu_decode.py > $OUT/ncu_full.log 2>&1
grep -E "gate_up_kernel|Duration|DRAM Throughput|Stall|stall|Sectors|Sector|L2 Hit|L1/TEX Hit|Mem Busy|Max Bandwidth|Warp Cycles|Eligible|Active Warps|Issued Warp|No Eligible" $OUT/ncu_full.log | head -90
