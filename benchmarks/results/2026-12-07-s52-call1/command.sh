# NOT RUN in s52: fourteen tries to start a device machine were refused (1 530 s of the 1 800 s of device
# time) until too little was left to start one; kept for the next session (rename the folder to that run).
# s52-1 (written in s51 as s51-3): the quantize pass token-major (commit 1a8751a's kernels_repo/moe, carried
# as .new_moe: mkdir -p .new_moe && git archive 1a8751a kernels_repo/moe | tar -x -C .new_moe): the new tree's
# GPU tests of the pinned sm90 paths; the two trees' whole-call outputs compared bit for bit; per-kernel
# GPU time of the new pass and the shipped one (old, by MOE_DIR) at Qwen3-30B-A3B T=4096, 16384 and
# DeepSeek-V3 T=4096; then bench_fp8 (this tree's: kernelhub compiled too) at Qwen3-30B-A3B T=4096,
# 16384 on the new tree
cp kernels_repo/moe/benchmarks/bench_fp8.py /tmp/bench_fp8.py
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 KERNELHUB_TEST_GPU=1 TRITON_INTERPRET=0
for w in .whl/*.whl; do python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$w" 2>/dev/null; done
export PYTHONPATH=$PYTHONPATH:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
cp -r kernels_repo/moe /tmp/old_moe && cp -r .new_moe/kernels_repo/moe/. kernels_repo/moe/  # (new in place, old kept)
cp /tmp/bench_fp8.py kernels_repo/moe/benchmarks/bench_fp8.py
timeout 80 python3 -m pytest -q -m gpu kernels_repo/moe/tests/test_experts_fp8_configs.py -k "gpu_sm90_pinned" 2>&1 | tail -3
# the two passes store the same rows (one rounding, `_quantize_rows`): the whole call's output must match
# bit for bit at the large-batch points the tests do not reach on a GPU (T=4096: the mapping path)
timeout 90 python3 - <<'PY'
import sys
from pathlib import Path
import torch
sys.path.insert(0, "kernels_repo/moe/benchmarks")
from bench_moe import routing  # noqa: E402
from tune_moe import fp8_weights  # noqa: E402
from kernelhub._loader import load_kernel_from_dir  # noqa: E402
new, old = load_kernel_from_dir(Path("kernels_repo/moe")), load_kernel_from_dir(Path("/tmp/old_moe"))
for E, H, I, K, T in ((128, 2048, 768, 8, 4096), (128, 2048, 768, 8, 16384), (128, 2048, 768, 8, 300)):
    gu, gus = fp8_weights(E, 2 * I, H)
    dn, dns = fp8_weights(E, H, I)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    idx, w = routing(T, E, K)
    outs = [m.fused_experts(x, gu, dn, idx, w, gate_up_proj_scale_inv=gus, down_proj_scale_inv=dns) for m in (new, old)]
    print(f"T={T}: new == old {torch.equal(*outs)}, max |diff| {(outs[0].float() - outs[1].float()).abs().max().item():.3e}")
PY
P=qwen3_30b_a3b:4096,qwen3_30b_a3b:16384,deepseek_v3:4096
for which in new old; do
  echo "== $which"
  if [ $which = old ]; then export MOE_DIR=/tmp/old_moe; else unset MOE_DIR; fi
  FP8=1 POINTS=$P MODES=fwd timeout 150 python3 tools/profile_moe.py 2>&1 | grep -E "profile|quantize|GPU kernels"
done
unset MOE_DIR
OUT=$OUT SHAPES=qwen3_30b_a3b TOKENS=4096,16384 COMPILE=default timeout 150 python3 kernels_repo/moe/benchmarks/bench_fp8.py 2>&1 | grep -E "^fp8|ceiling|skip" | grep -v "skip tf" | tee $OUT/bench_fp8.log
