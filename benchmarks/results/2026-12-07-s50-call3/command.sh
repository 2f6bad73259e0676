# s50-3: fp8 / bf16 at T=1 by CUDA-graph GPU time (tools/decode_graph_ratio.py), shipped configs and
# candidate D (both decode stages Gluon at Qwen3-30B-A3B and DeepSeek-V3), interleaved D shipped D shipped
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
for w in .whl/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" 2>/dev/null; done
export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/candD; cp kernels_repo/moe/torch-ext/moe/configs/*.json $OUT/candD/
python3 - "$OUT/candD/fp8_sm90.json" <<'PY'
import json, sys
cfg = json.load(open(sys.argv[1]))
gate_up = {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8, "num_stages": 2, "GLUON": True}
down = {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 8, "num_stages": 2, "GLUON": True, "PDL": True}
for shape in ("E128_H2048_I768", "E256_H7168_I2048"):
    cfg["shapes"][shape][0]["decode"] = {"gate_up": gate_up, "down": down, "max_tokens": 1}
json.dump(cfg, open(sys.argv[1], "w"), indent=1)
PY
for run in D shipped D2 shipped2; do
  case $run in D*) dir=$OUT/candD;; *) dir=;; esac
  echo "== $run"; env ${dir:+KERNELHUB_MOE_CONFIG_DIR=$dir} timeout 100 python3 tools/decode_graph_ratio.py 2>&1 | grep -v -i warn
done
