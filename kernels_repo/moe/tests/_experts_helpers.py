"""Shared inputs, oracles and fixtures of the fused_experts tests (the test_experts_*.py files)."""

from __future__ import annotations

import contextlib
import copy
import importlib
import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernelhub.hub import get_local_kernel

moe = get_local_kernel(Path(__file__).resolve().parents[1])


TRITON_VARIANTS = ["sm80", "sm90"]


NAMES = ("x", "gate_up_proj", "down_proj", "topk_weights")

# The package's private modules, for tests that look inside (patch a launcher, read a bucket).
checks = importlib.import_module(moe.__name__ + "._experts_validate")
cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
kern = importlib.import_module(moe.__name__ + "._experts_kernels")
launch = importlib.import_module(moe.__name__ + "._experts_launch")
pipeline = importlib.import_module(moe.__name__ + "._experts_pipeline")


def loop_reference(x, gate_up_proj, down_proj, topk_idx, topk_weights):
    """Per-(token, k) loop in float64: the plainest statement of the math."""
    T, K = topk_idx.shape
    inter = gate_up_proj.shape[1] // 2
    rows = []
    for t in range(T):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for k in range(K):
            e = int(topk_idx[t, k])
            if e < 0:
                continue
            gu = gate_up_proj[e].double() @ x[t].double()
            h = F.silu(gu[:inter]) * gu[inter:]
            acc = acc + topk_weights[t, k].double() * (down_proj[e].double() @ h)
        rows.append(acc)
    return torch.stack(rows)


def make_inputs(T, H, I, E, K, dtype=torch.float32, seed=0, drop=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * H**-0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=g) * I**-0.5).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    for j in range(drop):
        idx[j % T, j % K] = -1
    w = torch.rand(T, K, generator=g).to(dtype)
    return x, gate_up, down, idx, w


def run_with_grads(fn, x, gate_up, down, idx, w, dy, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, gate_up, down, w)]
    out = fn(leaves[0], leaves[1], leaves[2], idx, leaves[3])
    out.backward(dy.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def assert_close_rel(actual, expected, tol, what):
    actual, expected = actual.double(), expected.double()
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual - expected).norm() / expected.norm().clamp_min(1e-30)
    assert err < tol, f"{what}: relative error {err:.3g} >= {tol}"


def with_wgrad_tma(cfg: dict, on: bool, rows: bool = False, store: bool = False) -> dict:
    pinned = copy.deepcopy(cfg)
    pinned["wgrad"].update(TMA=on, ROWS=rows, TMA_STORE=store)
    pinned["wgrad"].pop("PERSISTENT", None)
    pinned["wgrad"].pop("FLAT_STEPS", None)
    return pinned


def count_row_descriptors(monkeypatch) -> list:
    """Calls of the sm90 2-D descriptor factory (the real one runs): proof the TMA branch ran."""
    sm90 = importlib.import_module(moe.__name__ + "._experts_sm90")
    calls = []
    real = sm90.rows_descriptor

    def spy(t, block_rows, block_cols):
        calls.append(tuple(t.shape))
        return real(t, block_rows, block_cols)

    monkeypatch.setattr(sm90, "rows_descriptor", spy)
    return calls


DECODE = {"max_tokens": 3, "gate_up": {"BLOCK_N": 8, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2},
          "down": {"BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2}}


def with_decode(decode: dict | None = None) -> dict:
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    return {**copy.deepcopy(cfgs.INTERPRETER_CONFIG), "decode": copy.deepcopy(decode or DECODE)}


MODELS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeExperts",
                  dict(hidden_size=32, moe_intermediate_size=24, num_experts=5, num_experts_per_tok=2)),
    "mixtral": ("MixtralConfig", "MixtralExperts",
                dict(hidden_size=32, intermediate_size=24, num_local_experts=5, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeExperts",
                  dict(hidden_size=32, moe_intermediate_size=24, num_experts=5, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3Experts",
                    dict(hidden_size=32, moe_intermediate_size=24, n_routed_experts=5,
                         num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "OlmoeExperts",
              dict(hidden_size=32, intermediate_size=24, num_experts=5, num_experts_per_tok=2)),
}


def build_experts(model: str, seed: int = 0):
    transformers = pytest.importorskip("transformers")
    cfg_name, cls_name, kwargs = MODELS[model]
    cfg = getattr(transformers, cfg_name)(**kwargs)
    cfg._experts_implementation = "eager"
    cls = getattr(importlib.import_module(f"transformers.models.{model}.modeling_{model}"), cls_name)
    torch.manual_seed(seed)
    module = cls(cfg)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
    return module


@contextlib.contextmanager
def config_dir(monkeypatch, path: Path):
    """The configs module reading KERNELHUB_MOE_CONFIG_DIR=path, its caches emptied around."""
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    monkeypatch.setenv("KERNELHUB_MOE_CONFIG_DIR", str(path))
    cfgs.clear_config_cache()
    try:
        yield cfgs
    finally:
        cfgs.clear_config_cache()


def restore_kernelhub(interface, previous) -> None:
    """Put back what `import kernelhub` registered (other tests rely on it)."""
    if previous is None:
        interface._global_mapping.pop("kernelhub", None)
    else:
        interface.register("kernelhub", previous)


class GraphRecorder:
    """A torch.compile backend that keeps the FX graphs it is given and runs them as aot_eager."""

    def __init__(self):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.ops: list[str] = []

        def keep(gm, example_inputs):
            self.ops += [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            return make_boxed_func(gm.forward)

        self.backend = aot_autograd(fw_compiler=keep, bw_compiler=keep)


def run_compile_checks(script, tmp_path, groups: list[list[str]]) -> list[str]:
    """The stdout of `script` (a benchmarks/compile_check*.py) run once per group of capability
    arguments, the processes side by side (ptxas and LLVM keep one core each busy), each with its
    own Triton cache under tmp_path and TRITON_INTERPRET unset; fails on any non-zero exit."""
    import subprocess
    import sys

    procs = []
    for i, caps in enumerate(groups):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {
            "TRITON_CACHE_DIR": str(tmp_path / f"cache{i}")}
        procs.append(subprocess.Popen([sys.executable, str(script), *caps], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env))
    outs = []
    for caps, proc in zip(groups, procs, strict=True):
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, (caps, out[-3000:], err[-3000:])
        outs.append(out)
    return outs


def assert_only_staged_decode_tiles_pipelined(lines: list[str], staged_marker: str) -> None:
    """Compile-check report lines of decode kernels: every tile with LOAD_STAGES > 1 (the two the
    scripts add, marked by `staged_marker`, and any a shipped bucket has) has its K loop's loads as
    cp.async, every other tile none."""
    def staged(line: str) -> bool:
        found = re.search(r"""['"]LOAD_STAGES['"]: (\d+)""", line)
        return found is not None and int(found.group(1)) > 1

    assert sum(staged_marker in line for line in lines) == 2, lines
    assert all((" cp_async=0" not in line) == staged(line) for line in lines), lines
    assert all(line.endswith(" cp_async=0") for line in lines if not staged(line)), lines


def needs_sm90_gluon():
    """The `_gluon_gemm` module, or a skip: its kernels need a capability 9.0 GPU and triton's Gluon."""
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("needs a CUDA GPU and TRITON_INTERPRET=0")
    gl = importlib.import_module(moe.__name__ + "._gluon_gemm")
    if torch.cuda.get_device_capability() != (9, 0) or not gl.available():
        pytest.skip("the Gluon GEMMs need an sm90 GPU and triton's Gluon")
    return gl
