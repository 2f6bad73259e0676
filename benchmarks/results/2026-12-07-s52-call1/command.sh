# s52-1 (written in s51 as s51-3, not run then; trimmed to what the session's last ~180 s of device
# time could hold): the quantize pass token-major (commit 1a8751a's kernels_repo/moe, carried as .new_moe:
# mkdir -p .new_moe && git archive 1a8751a kernels_repo/moe | tar -x -C .new_moe): first the new tree's
# GPU tests of the pinned sm90 paths, then per-kernel GPU time of the shipped pass (old) and the new one
# (the old one by MOE_DIR) at Qwen3-30B-A3B T=4096 and 16384
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KERNELHUB_TEST_GPU=1 TRITON_INTERPRET=0
for w in .whl/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" 2>/dev/null; done
export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
cp -r kernels_repo/moe /tmp/old_moe && cp -r .new_moe/kernels_repo/moe/. kernels_repo/moe/  # (new in place, old kept)
timeout 80 python3 -m pytest -q -m gpu kernels_repo/moe/tests/test_experts_fp8_configs.py -k "gpu_sm90_pinned" 2>&1 | tail -3
P=qwen3_30b_a3b:4096,qwen3_30b_a3b:16384
for which in new old; do
  echo "== $which"
  if [ $which = old ]; then export MOE_DIR=/tmp/old_moe; else unset MOE_DIR; fi
  FP8=1 POINTS=$P MODES=fwd timeout 60 python3 tools/profile_moe.py 2>&1 | grep -E "profile|quantize|GPU kernels"
done
