# s52-lean: with 269 s of device time left (about 90 s after a start), the quantize pass A/B alone:
# per-kernel GPU time of the token-major pass (commit 1a8751a's kernels_repo/moe, carried as .new_moe) and
# the shipped one at Qwen3-30B-A3B T=16384 and 4096, no tests
for w in .whl/pydantic*.whl .whl/annotated*.whl .whl/typing_insp*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" 2>/dev/null; done
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
nvidia-smi --query-gpu=name --format=csv,noheader
for which in new old; do
  echo "== $which"
  if [ $which = new ]; then export MOE_DIR=$PWD/.new_moe/kernels_repo/moe; else unset MOE_DIR; fi
  FP8=1 POINTS=qwen3_30b_a3b:16384,qwen3_30b_a3b:4096 MODES=fwd REPS=5 timeout 45 python3 tools/profile_moe.py 2>&1 | grep -E "profile|quantize|GPU kernels|Error"
done
