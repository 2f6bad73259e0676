"""A whole-model row: a real-width slice of Qwen3-30B-A3B and of DeepSeek-V3, eager and compiled,
kernelized or not, forward, on one GPU in one run.

Each slice is the transformers base model (embedding, 2 decoder layers, final norm; no LM head) built
from its config at the real widths with random bf16 weights on the GPU, SDPA attention:
  qwen3_30b_a3b  Qwen3MoeConfig: hidden 2048, 32 heads / 4 KV heads of 128, 128 experts of 768, top-8;
                 both layers MoE (as every layer of the real model).
  deepseek_v3    DeepseekV3Config: hidden 7168, MLA (q_lora 1536, kv_lora 512, 128 heads), dense MLP
                 18432, 256 routed experts of 2048 + 1 shared, top-8 of 8 groups (4 chosen).
                 Default: layer 0 dense, layer 1 MoE with all 256 experts (the real model's first
                 layers are dense: first_k_dense_replace=1 here, 3 there), ~24 GB of weights. Two MoE
                 layers of 256 experts would take 45 GB next to compile's buffers: DSV3_DENSE=0 makes
                 both layers MoE, then with DSV3_EXPERTS experts (e.g. 64 of 256, still top-8 of 8
                 groups); the `slice_model` row states what was built.
Input: batch 1 x T tokens (random ids of a small vocabulary), `use_cache=False`. T=1 is the decode
step as a plain forward of one token without a KV cache (the MoE and MLP work of a decode step; the
attention over a cache is not included: in transformers 5.24 StaticCache advances its own write
position on every call, whatever `cache_position` says, and `past_key_values` is deprecated for
`cache`, so one decode step timed repeatedly at one position is not portable across 5.17 / 5.24).
Configurations (forward, no_grad):
  hf_eager                      transformers, experts_implementation "eager"
  hf_grouped_mm[, compiled, reduce-overhead]   experts "grouped_mm"; torch.compile(model, fullgraph=True)
  hf_batched_mm[, compiled, reduce-overhead]   experts "batched_mm" (T <= 32: it gathers weights per token)
  kernelhub                     kernelize(model, mode=Mode.INFERENCE), eager
  kernelhub[compiled, reduce-overhead]         kernelize(model, mode=Mode.INFERENCE | Mode.TORCH_COMPILE)
                                              then torch.compile(model, fullgraph=True)
Compiled configurations: static shapes, compiled once per (configuration, model, T) after
`torch.compiler.reset()`; the first calls (compile, CUDA-graph recording) are timed apart
(`compile_s`) and excluded; under reduce-overhead each call first marks a CUDA-graph step. `relerr`
is against hf_grouped_mm eager at the same T (two layers of bf16 and random routing: ~1e-2).
The closing table gives kernelhub's best configuration over the best other one. Each row also
counts, over 10 more forwards, the fused_experts bodies run per forward and how many of them
replayed recorded launches (`moe_bodies_per_forward`, `moe_replays_per_forward`): a compiled
(default) forward whose bodies do not replay pays the ordinary path's Python on every MoE layer.

Usage (repo root): PYTHONPATH=src python benchmarks/bench_model_slice.py
  env: MODELS=qwen3_30b_a3b,deepseek_v3  TOKENS=1,32,512,4096  IMPLS=kernelhub,hf_grouped_mm,... (a base
       name or a full name such as kernelhub[reduce-overhead])  COMPILE=default,reduce-overhead (none:
       eager only)  DSV3_DENSE=1  DSV3_EXPERTS=256  VOCAB=1024  OUT=/tmp (appends
       $OUT/bench_model_slice.jsonl)  DEVICE=cpu: smoke test without a GPU, same code path with
       tiny widths (default TOKENS=1,8; wall-clock timing; no CUDA graphs)
Works with transformers 5.17 and 5.24 (API differences are guarded where they are used).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch._dynamo

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from kernelhub._bench_compile import compile_configs, compiled, raise_recompile_limit  # noqa: E402

DEV = torch.device(os.environ.get("DEVICE", "cuda"))
CUDA = DEV.type == "cuda"
OUT = os.environ.get("OUT", "/tmp")
ROWS: list[dict] = []
# transformers' experts dispatch calls lru_cache'd version checks, which dynamo warns about on every compile
warnings.filterwarnings("ignore", message=".*functools.lru_cache.*", category=UserWarning)


def emit(**row) -> None:
    ROWS.append(row)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "bench_model_slice.jsonl"), "a") as log:
        log.write(json.dumps(row) + "\n")
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


def env_list(name: str, default: str) -> list[str]:
    return [s for s in os.environ.get(name, default).split(",") if s]


def bench(fn: Callable[[], object]) -> float:
    """Median ms: do_bench on a GPU; on the CPU (smoke test) a few wall-clock calls."""
    if CUDA:
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def qwen3_config(tiny: bool):
    from transformers import Qwen3MoeConfig

    width = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                 num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128)
    if tiny:
        width = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                     num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return Qwen3MoeConfig(num_hidden_layers=2, vocab_size=int(os.environ.get("VOCAB", 1024)), norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, **width)


def deepseek_v3_config(tiny: bool):
    from transformers import DeepseekV3Config

    width = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                 n_routed_experts=int(os.environ.get("DSV3_EXPERTS", 256)), n_shared_experts=1, num_experts_per_tok=8,
                 n_group=8, topk_group=4, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                 kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    if tiny:
        width = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=16,
                     n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, num_attention_heads=4,
                     num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                     v_head_dim=16)
    return DeepseekV3Config(num_hidden_layers=2, vocab_size=int(os.environ.get("VOCAB", 1024)),
                            first_k_dense_replace=int(os.environ.get("DSV3_DENSE", 1)), routed_scaling_factor=2.5,
                            norm_topk_prob=True, **width)


def model_class(name: str):
    if name == "qwen3_30b_a3b":
        from transformers import Qwen3MoeModel

        return Qwen3MoeModel, qwen3_config
    from transformers import DeepseekV3Model

    return DeepseekV3Model, deepseek_v3_config


def build(name: str) -> torch.nn.Module:
    """The slice with random bf16 weights, allocated on the device (no host copy of the weights)."""
    cls, config_for = model_class(name)
    config = config_for(tiny=not CUDA)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEV):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval().requires_grad_(False)
    set_attention(model, "sdpa")
    return model


def set_attention(model, impl: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:
        model.config._attn_implementation = impl


def set_experts(model, impl: str) -> None:
    """Every experts module's implementation (transformers v5 `experts_implementation`)."""
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(impl)
        return
    for module in model.modules():  # (no setter: the attribute every `*Experts` forward reads)
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = impl


def describe(name: str, model) -> dict:
    cfg = model.config
    layers = [type(layer.mlp).__name__ for layer in model.layers]
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None)
    return dict(kind="slice_model", model=name, layers=layers, experts=experts, top_k=cfg.num_experts_per_tok,
                hidden=cfg.hidden_size, moe_intermediate=cfg.moe_intermediate_size,
                params_GB=sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9,
                attention=getattr(cfg, "_attn_implementation", None), decode="T=1 plain forward, no KV cache",
                dtype="bfloat16")


def unique_graphs() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001
        return 0


def configurations(T: int, configs: list[str]) -> tuple[list, list]:
    """(core, extra) lists of (name, base, config) in run order. Core: hf_grouped_mm eager first (the
    reference), then kernelhub next to its closest peer in each mode, then hf_eager; extra (T <= 32):
    hf_batched_mm. Every T runs its core before any T runs its extras, so that a run cut short by its
    timeout still has the main comparison at every T."""
    core = [("hf_grouped_mm", "hf_grouped_mm", "eager"), ("kernelhub", "kernelhub", "eager")]
    for c in configs:
        core += [(f"hf_grouped_mm[{c}]", "hf_grouped_mm", c), (f"kernelhub[{c}]", "kernelhub", c)]
    core.append(("hf_eager", "hf_eager", "eager"))
    extra = []
    if T <= 32:  # (batched_mm gathers the weights of every (token, expert) pair)
        extra = [("hf_batched_mm", "hf_batched_mm", "eager")]
        extra += [(f"hf_batched_mm[{c}]", "hf_batched_mm", c) for c in configs]
    return core, extra


def prepare(model, base: str, config: str) -> None:
    """Put the model in the state a configuration runs: experts implementation or kernelized."""
    from kernelhub import Mode, kernelize, kernelize_report, unkernelize

    unkernelize(model)
    if base != "kernelhub":
        set_experts(model, base[len("hf_"):])
        return
    set_experts(model, "grouped_mm")  # (what a module kernelize leaves alone would run)
    mode = Mode.INFERENCE if config == "eager" else Mode.INFERENCE | Mode.TORCH_COMPILE
    kernelize(model, mode=mode)
    bound = [e for e in kernelize_report(model).entries if e.fallback_reason is None]
    if not any("Experts" in e.module_class for e in bound):
        raise RuntimeError(f"kernelize({mode}) bound no experts module: {kernelize_report(model)}")


def measure(model, name: str, base: str, config: str, ids, ref, model_name: str, T: int) -> torch.Tensor:
    prepare(model, base, config)
    fn = model if config == "eager" else compiled(model, config)
    if config != "eager":
        torch.compiler.reset()

    def call():
        return fn(input_ids=ids, use_cache=False).last_hidden_state

    with torch.no_grad():
        t0 = time.perf_counter()
        for _ in range(1 if config == "eager" else 3):  # compile; CUDA-graph warm-up, record, replay
            out = call()
        out = out.float()  # (a copy: the next replay may overwrite the graph's output)
        if CUDA:
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        graphs = unique_graphs()
        ms = bench(call)
        bodies, replays = moe_bodies(call)
    relerr = None if ref is None else ((out - ref).norm() / ref.norm()).item()
    emit(kind="slice_fwd", model=model_name, T=T, impl=name, base=base, config=config, ms=ms, compile_s=compile_s,
         recompiles=unique_graphs() - graphs, relerr=relerr, tokens_per_s=T / (ms * 1e-3),
         moe_bodies_per_forward=bodies, moe_replays_per_forward=replays)
    return out


def moe_bodies(call, n: int = 10) -> tuple[float, float]:
    """(fused_experts bodies run, of those replayed from recorded launches) per forward over n calls:
    an eager or compiled (default) forward runs one body per MoE layer, reduce-overhead none (the
    CUDA graph replays the kernels); a body that does not replay takes the ordinary path and its
    Python. Counted by wrapping the bundled moe kernel's `_experts_eager.run` and
    `_experts_replay.replay`; 0, 0 where kernelhub's moe kernel is not loaded."""
    eagers = [m for k, m in list(sys.modules.items()) if k.endswith("._experts_eager") and hasattr(m, "run")]
    replays = [m for k, m in list(sys.modules.items()) if k.endswith("._experts_replay") and hasattr(m, "replay")]
    counts = [0, 0]
    saved = [(m, "run", m.run) for m in eagers] + [(m, "replay", m.replay) for m in replays]

    def counted(fn, i: int, hit_only: bool):
        def wrapper(*args, **kwargs):
            result = fn(*args, **kwargs)
            counts[i] += not hit_only or result is not None
            return result
        return wrapper

    try:
        for m in eagers:
            m.run = counted(m.run, 0, False)
        for m in replays:
            m.replay = counted(m.replay, 1, True)
        for _ in range(n):
            call()
    finally:
        for m, attr, fn in saved:
            setattr(m, attr, fn)
    return counts[0] / n, counts[1] / n


def main() -> None:
    import transformers

    print("torch", torch.__version__, "transformers", transformers.__version__,
          torch.cuda.get_device_name(DEV) if CUDA else "cpu", flush=True)
    raise_recompile_limit()
    tokens = [int(t) for t in env_list("TOKENS", "1,32,512,4096" if CUDA else "1,8")]
    wanted = env_list("IMPLS", "")
    configs = compile_configs("bench_model_slice.py")
    for model_name in env_list("MODELS", "qwen3_30b_a3b,deepseek_v3"):
        if model_name not in ("qwen3_30b_a3b", "deepseek_v3"):
            raise SystemExit(f"bench_model_slice.py: MODELS takes qwen3_30b_a3b, deepseek_v3, got {model_name!r}")
        t_model = time.time()
        model = build(model_name)
        emit(**describe(model_name, model))
        vocab = model.config.vocab_size
        ids = {T: torch.randint(0, vocab, (1, T), device=DEV) for T in tokens}
        refs: dict[int, torch.Tensor] = {}  # hf_grouped_mm eager's output per T
        for phase in (0, 1):  # every T's core configurations, then the extras
            for T in tokens:
                t0 = time.time()
                for name, base, config in configurations(T, configs)[phase]:
                    if wanted and name not in wanted and base not in wanted:
                        continue
                    try:
                        out = measure(model, name, base, config, ids[T], refs.get(T), model_name, T)
                        if name == "hf_grouped_mm":
                            refs[T] = out
                    except Exception as e:  # noqa: BLE001
                        emit(kind="slice_error", model=model_name, T=T, impl=name,
                             error=f"{type(e).__name__}: {str(e)[:400]}")
                    if config != "eager":
                        torch.compiler.reset()  # (frees this configuration's CUDA-graph pool)
                    gc.collect()
                    if CUDA:
                        torch.cuda.empty_cache()
                print(f"-- {model_name} T={T} {('core', 'extra')[phase]} took {time.time() - t0:.1f}s", flush=True)
        from kernelhub import unkernelize

        unkernelize(model)
        del model
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
        print(f"-- {model_name} took {time.time() - t_model:.1f}s", flush=True)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import summarize

    print()
    summarize.model_slice(ROWS)


if __name__ == "__main__":
    main()
