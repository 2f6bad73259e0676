# s50-5: the shipped Gluon decode tiles up to T=4 (max_tokens 4) against the shipped configs (grouped
# path above T=1), fp8 / bf16 by CUDA-graph GPU time (tools/decode_graph_ratio.py), T=2 and T=4
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
for w in .whl/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" 2>/dev/null; done
export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/cand4; cp kernels_repo/moe/torch-ext/moe/configs/*.json $OUT/cand4/
python3 - "$OUT/cand4/fp8_sm90.json" <<'PY'
import json, sys
cfg = json.load(open(sys.argv[1]))
for shape in ("E128_H2048_I768", "E256_H7168_I2048"):
    cfg["shapes"][shape][0]["decode"]["max_tokens"] = 4
json.dump(cfg, open(sys.argv[1], "w"), indent=1)
PY
for T in 2 4; do for run in cand4 shipped; do
  case $run in cand*) dir=$OUT/cand4;; *) dir=;; esac
  echo "== $run T=$T"; env ${dir:+KERNELHUB_MOE_CONFIG_DIR=$dir} T=$T timeout 60 python3 tools/decode_graph_ratio.py 2>&1 | grep -v -i warn
done; done
