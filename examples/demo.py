"""kernelize a small Llama and a small Qwen3-MoE built from transformers configs.

Prints kernelize's report (which kernel each module got, on which device and capability) and
checks the kernelized logits against the eager ones. Runs on whatever is there: each visible GPU
gets some of the layers (so GPUs of different generations each get their own kernels), or the CPU.

    python examples/demo.py [--dtype bf16|fp16|fp32] [--tokens N] [--triton-on-cpu]

Without a GPU the CPU gets the torch reference layers; `--triton-on-cpu` runs the sm80 Triton
kernels through the Triton interpreter instead (slow, but the same kernel code as on a GPU).
"""

from __future__ import annotations

import argparse
import os
import sys

if "--triton-on-cpu" in sys.argv:  # must precede the definition of any Triton kernel
    os.environ["TRITON_INTERPRET"] = "1"

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

import kernelhub

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Relative L2 error of the logits allowed per dtype (kernels compute in fp32 and round once;
# eager rounds after every op, so the two differ by a few ulps of the dtype).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def small_llama() -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg)


def small_qwen3_moe() -> Qwen3MoeForCausalLM:
    cfg = Qwen3MoeConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=16,
        num_experts_per_tok=4, max_position_embeddings=256, mlp_only_layers=[0],
    )
    return Qwen3MoeForCausalLM(cfg)


def place(model: torch.nn.Module, dtype: torch.dtype) -> torch.device:
    """Spread the decoder layers over every visible GPU (as device_map would); else use the CPU."""
    n = torch.cuda.device_count()
    if n == 0:
        model.to(dtype=dtype)
        return torch.device("cpu")
    first = torch.device("cuda", 0)
    model.to(first, dtype)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layer.to(torch.device("cuda", i * n // len(layers)))
    return first


def run(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def check(name: str, model: torch.nn.Module, dtype: torch.dtype, tokens: int) -> bool:
    torch.manual_seed(0)
    device = place(model.eval(), dtype)
    if torch.cuda.device_count() > 1:
        _add_device_hops(model)
    ids = torch.randint(0, model.config.vocab_size, (2, tokens), device=device)
    eager = run(model, ids)
    model = kernelhub.kernelize(model, mode=kernelhub.Mode.INFERENCE, config={})
    print(f"\n== {name} ({dtype}) ==")
    report = kernelhub.kernelize_report(model)
    print(report)
    kernelized = run(model, ids)
    err = ((kernelized - eager).norm() / eager.norm()).item()
    ok = err <= TOLERANCE[dtype] and bool(torch.isfinite(kernelized).all())
    print(f"logits vs eager: relative L2 error {err:.2e} (tolerance {TOLERANCE[dtype]:.0e}) -> "
          f"{'OK' if ok else 'MISMATCH'}")
    if report.fallbacks:  # every SwiGLU MLP and experts module of these models has a kernel
        print(f"{len(report.fallbacks)} module(s) kept their eager forward: the check above compared eager with eager")
        ok = False
    return ok


def _add_device_hops(model: torch.nn.Module) -> None:
    """Move activations to each layer's device, as accelerate's hooks do for a device_map."""
    def to_layer_device(module, args, kwargs):
        dev = next(module.parameters()).device
        args = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: (v.to(dev) if isinstance(v, torch.Tensor) else
                      tuple(t.to(dev) for t in v) if isinstance(v, tuple) else v) for k, v in kwargs.items()}
        return args, kwargs

    for layer in model.model.layers:
        layer.register_forward_pre_hook(to_layer_device, with_kwargs=True)
    model.model.norm.register_forward_pre_hook(to_layer_device, with_kwargs=True)
    model.lm_head.register_forward_pre_hook(to_layer_device, with_kwargs=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="default: bf16 on a GPU, fp32 on the CPU")
    parser.add_argument("--tokens", type=int, default=16, help="sequence length (default 16)")
    parser.add_argument("--triton-on-cpu", action="store_true",
                        help="on the CPU, run the sm80 Triton kernels in the Triton interpreter")
    args = parser.parse_args()
    if args.triton_on_cpu:
        root = kernelhub.default_mapping.bundled_kernels_dir()
        kernelhub.register_kernel_mapping({
            "SwiGLUMLP": {"cpu": kernelhub.LocalLayerRepository(root / "swiglu", layer_name="SwiGLUMLPSm80")},
            "MoEExperts": {"cpu": kernelhub.LocalLayerRepository(root / "moe", layer_name="MoEExpertsSm80")},
        })
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    gpus = [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    print("devices:", ", ".join(gpus) if gpus else "CPU only (kernels: torch reference layers)")
    ok = check("Llama (dense SwiGLU MLPs)", small_llama(), dtype, args.tokens)
    ok &= check("Qwen3-MoE (experts + dense MLP layer)", small_qwen3_moe(), dtype, args.tokens)
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
