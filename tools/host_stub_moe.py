"""Host (Python) time of fused_experts forward+backward and forward, launches stubbed, on a CPU.

Why: the eager T=1 training call is host-bound, and the GPU machine's host speed varies between
calls by up to ~1.5x; this compares kernel repositories (e.g. the current one against an older
commit's copy) on one host, interleaved. The Triton launches are replaced by no-ops and the CPU
tensors take the sm90 variant's path with the interpreter's tile config (not the sm90 buckets), so
it measures the Python around the launches, not a GPU's time. Shapes are Qwen3-30B-A3B's E and K
with small H and I (allocation cost is not the question).

    python tools/host_stub_moe.py [KERNEL_REPO_DIR ...]   # default: kernels_repo/moe
"""

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors take the Triton path, whose launches are stubbed
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from _stub_timing import interleaved_medians  # noqa: E402  (this script's folder)

import kernelhub.triton_launch as triton_launch  # noqa: E402
from kernelhub._loader import load_kernel_from_dir  # noqa: E402

triton_launch.CachedLaunch.split = lambda self, *a, **k: None
triton_launch.CachedLaunch.__call__ = lambda self, *a, **k: None

E, H, I, K, T = 128, 256, 128, 8, 1


def steps(moe) -> dict:
    torch.manual_seed(0)
    x = torch.randn(T, H, dtype=torch.bfloat16, requires_grad=True)
    gate_up = torch.randn(E, 2 * I, H, dtype=torch.bfloat16, requires_grad=True)
    down = torch.randn(E, H, I, dtype=torch.bfloat16, requires_grad=True)
    weights, idx = torch.topk(torch.softmax(torch.randn(T, E), -1), K)
    weights.requires_grad_()
    dy = torch.randn(T, H, dtype=torch.bfloat16)

    def call():
        return moe.fused_experts(x, gate_up, down, idx, weights, variant="sm90", check_indices=False)

    def fwdbwd():
        torch.autograd.grad(call(), (x, gate_up, down, weights), dy)

    def fwd():
        with torch.no_grad():
            call()

    return {"fwdbwd": fwdbwd, "fwd": fwd}


if __name__ == "__main__":
    dirs = sys.argv[1:] or [str(ROOT / "kernels_repo" / "moe")]
    cases = {(d, name): fn for d in dirs for name, fn in steps(load_kernel_from_dir(Path(d))).items()}
    for (d, name), us in interleaved_medians(cases, n=300, warmup=30).items():
        print(f"{d}: {name} {us:.1f} us per call (median of 5 rounds)")
