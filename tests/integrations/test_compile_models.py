"""torch.compile(fullgraph=True) of every model class kernelhub kernelizes, static and dynamic shapes.

Each supported transformers class is built tiny, kernelized for `Mode.INFERENCE | Mode.TORCH_COMPILE`
or `Mode.TRAINING | Mode.TORCH_COMPILE` (the sm80 Triton layers, run by the Triton interpreter on
the CPU), then compiled. The backend is aot_eager: Dynamo and AOT autograd trace the model, so a
graph break or an op that cannot be traced fails, without Inductor's compile time; one case runs
Inductor to show it lowers the kernels' custom ops. GPT-OSS and Llama4 experts are refused by
design (their layouts differ): there their own forward must still compile.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from functorch.compile import make_boxed_func
from test_transformers import TINY, _triton_on_cpu_mapping
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters

import kernelhub

INFERENCE = kernelhub.Mode.INFERENCE | kernelhub.Mode.TORCH_COMPILE
TRAINING = kernelhub.Mode.TRAINING | kernelhub.Mode.TORCH_COMPILE
# the kernelized eager model and its compiled twin run the same ops: only the order of a few fp32
# reductions outside the kernels may differ
RTOL, ATOL = 1e-5, 1e-6


# one decoder layer (the MoE one where a model has both): tracing time grows with the layers, and
# every layer of a model runs the same code
ONE = {**TINY, "num_hidden_layers": 1}
# 8 experts: a training batch of 3 tokens routes fewer (token, k) pairs than there are experts, one
# of 7 more (a compiled training op once guarded on that: see the dynamic training test)
_MOE = dict(intermediate_size=48, num_experts_per_tok=2, **ONE)


def _model(kind: str) -> torch.nn.Module:
    """A one-layer model of each class the integration tests kernelize, and of the two refused ones."""
    t = transformers
    if kind == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(intermediate_size=48, **ONE))
    if kind == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(intermediate_size=48, **ONE))
    if kind == "mistral":
        return t.MistralForCausalLM(t.MistralConfig(intermediate_size=48, **ONE))
    if kind == "mixtral":
        return t.MixtralForCausalLM(t.MixtralConfig(**{**_MOE, "intermediate_size": 24}, num_local_experts=8))
    if kind == "qwen2_moe":
        return t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                                      num_experts=8, **_MOE))
    if kind == "qwen3_moe":
        return t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(moe_intermediate_size=24, num_experts=8, **_MOE))
    if kind == "olmoe":
        return t.OlmoeForCausalLM(t.OlmoeConfig(**{**_MOE, "intermediate_size": 24}, num_experts=8))
    if kind == "deepseek_v3":
        return t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
            moe_intermediate_size=24, n_routed_experts=8, n_shared_experts=1, n_group=1, topk_group=1,
            first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, **{**_MOE, "num_key_value_heads": 2}))
    if kind == "gpt_oss":
        return t.GptOssForCausalLM(t.GptOssConfig(**{**_MOE, "intermediate_size": 32}, num_local_experts=4,
                                                  head_dim=16))
    if kind == "llama4":
        return t.Llama4ForCausalLM(t.Llama4TextConfig(
            intermediate_size_mlp=40, head_dim=16, num_local_experts=4, moe_layers=[0], no_rope_layers=[1],
            attention_chunk_size=64, **{**_MOE, "num_experts_per_tok": 1}))
    raise ValueError(kind)


# kind: (MoEExperts bound, SwiGLUMLP bound (dense or shared-expert MLPs), experts refused by design)
BOUND = {
    "llama": (0, 1, 0),
    "qwen2": (0, 1, 0),
    "mistral": (0, 1, 0),
    "mixtral": (1, 0, 0),
    "qwen2_moe": (1, 1, 0),
    "qwen3_moe": (1, 0, 0),
    "deepseek_v3": (1, 1, 0),
    "olmoe": (1, 0, 0),
    "llama4": (0, 1, 1),
    "gpt_oss": (0, 0, 1),
}
# the op each bound layer puts in the forward graph, inference and training
OPS = {"MoEExperts": ("fused_experts.default", "fused_experts_train.default"),
       "SwiGLUMLP": ("swiglu_infer.default", "swiglu.default")}


def _kernelized(kind: str, mode: kernelhub.Mode) -> torch.nn.Module:
    """The tiny model kernelized for `mode`; fails unless every supported module got its kernel."""
    torch.manual_seed(0)
    model = _model(kind).train(kernelhub.Mode.TRAINING in mode)
    with kernelhub.use_kernel_mapping(_triton_on_cpu_mapping()):
        report = kernelhub.kernelize_report(kernelhub.kernelize(model, mode=mode, config={}))
    experts, mlps, refused = BOUND[kind]
    bound = [(e.layer_name, e.layer) for e in report.kernelized]
    assert sorted(bound) == sorted([("MoEExperts", "MoEExpertsSm80")] * experts
                                   + [("SwiGLUMLP", "SwiGLUMLPSm80")] * mlps), str(report)
    assert len(report.fallbacks) == refused, str(report)
    for e in report.fallbacks:  # refused by design: a layout or signature MoEExperts does not take
        assert e.layer_name == "MoEExperts" and ("transposed" in e.fallback_reason
                                                 or "takes no routing" in e.fallback_reason), str(report)
    return model


class _Recorder:
    """An aot_eager backend that keeps the call_function targets of every forward graph it is given."""

    def __init__(self):
        self.forward_graphs: list[list[str]] = []

        def forward(gm, example_inputs):
            self.forward_graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
            return make_boxed_func(gm.forward)

        self.backend = aot_autograd(fw_compiler=forward, bw_compiler=lambda gm, _: make_boxed_func(gm.forward))

    def assert_ops(self, kind: str, training: bool) -> None:
        """Each forward graph holds one kernel op per bound layer (the kernels run inside the graph)."""
        experts, mlps, _ = BOUND[kind]
        for ops in self.forward_graphs:
            for layer, n in (("MoEExperts", experts), ("SwiGLUMLP", mlps)):
                suffix = OPS[layer][training]
                found = sum(op.endswith(suffix) and "kernelhub" in op for op in ops)
                assert found == n, (layer, suffix, found, ops)


def _compile_counts() -> tuple[int, int]:
    """(graphs Dynamo compiled, graph breaks) since the last reset."""
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


@pytest.fixture(autouse=True)
def _reset_dynamo_after():
    """Leave no compiled model (nor its counters) behind for the tests that run next."""
    yield
    _fresh_dynamo()


def _check_inference(kind: str, dynamic: bool, lengths: tuple[int, ...]) -> _Recorder:
    """Compile the kernelized model, run each sequence length, compare with the eager logits; under
    dynamic=True any recompile after the first length raises."""
    model = _kernelized(kind, INFERENCE)
    _fresh_dynamo()
    rec = _Recorder()
    compiled = torch.compile(model, backend=rec.backend, fullgraph=True, dynamic=dynamic)
    with torch.no_grad():
        for i, length in enumerate(lengths):
            ids = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(length))
            with torch._dynamo.config.patch(error_on_recompile=dynamic and i > 0):
                got = compiled(input_ids=ids).logits
            torch.testing.assert_close(got, model(input_ids=ids).logits, rtol=RTOL, atol=ATOL)
    rec.assert_ops(kind, training=False)
    return rec


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("kind", sorted(BOUND))
def test_inference_compiles_fullgraph_and_gives_the_eager_logits(kind, dynamic):
    """dynamic=True: two sequence lengths, one graph (no recompile)."""
    rec = _check_inference(kind, dynamic, (5, 7) if dynamic else (5,))
    # one graph and no break: this fails on a break even were fullgraph dropped
    assert _compile_counts() == (1, 0)
    assert len(rec.forward_graphs) == 1


def test_static_shapes_compile_once_per_sequence_length():
    """dynamic=False specializes on the sequence length: a new length compiles a second graph (as for
    any model; expected), the same length again none."""
    rec = _check_inference("qwen2_moe", False, (5, 7, 5))
    assert _compile_counts() == (2, 0)
    assert len(rec.forward_graphs) == 2


def _loss_and_grads(model: torch.nn.Module, run, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    loss = run(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("kind", sorted(BOUND))
def test_training_compiles_fullgraph_and_gives_the_eager_gradients(kind, dynamic):
    """Forward + backward: the loss and every parameter's gradient (router weights, expert weights,
    MLP weights and everything upstream of them, which gets the kernels' input gradient) equal the
    kernelized eager model's. dynamic=True: a second length reuses the graph, also where the first
    routes fewer (token, k) pairs than there are experts (6 < 8) and the second more (14)."""
    model = _kernelized(kind, TRAINING)
    _fresh_dynamo()
    rec = _Recorder()
    compiled = torch.compile(model, backend=rec.backend, fullgraph=True, dynamic=dynamic)
    lengths = (3, 7) if dynamic else (3,)
    for i, length in enumerate(lengths):
        ids = torch.randint(0, 64, (1, length), generator=torch.Generator().manual_seed(length))
        want_loss, want = _loss_and_grads(model, model, ids)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            loss, grads = _loss_and_grads(model, compiled, ids)
        torch.testing.assert_close(loss, want_loss, rtol=RTOL, atol=ATOL)
        assert grads.keys() == want.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, want[name], rtol=RTOL, atol=ATOL, msg=name)
    experts, mlps, _ = BOUND[kind]
    names = list(grads)
    if experts:  # the gradients through fused_experts' backward op: experts, router, upstream
        assert any(n.endswith("experts.gate_up_proj") for n in names) and any(n.endswith(".gate.weight")
                                                                               for n in names), names
    if mlps:
        assert any(n.endswith("gate_proj.weight") for n in names), names
    assert _compile_counts() == (1, 0)
    assert len(rec.forward_graphs) == 1
    rec.assert_ops(kind, training=True)


def _cxx() -> str | None:
    return next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)


def test_inductor_lowers_the_kernel_custom_ops():
    """Inductor (CPU code, needs a C++ compiler) on a model with both layers: the generated code calls
    the kernels' custom ops (extern kernels, not decomposed away) and gives the eager logits."""
    from torch._inductor.utils import run_and_get_code

    if _cxx() is None:
        print("no C++ compiler (g++, c++, clang++) on PATH: CPU Inductor cannot build its kernels")
        pytest.skip("no C++ compiler for CPU Inductor")
    model = _kernelized("qwen2_moe", INFERENCE)
    _fresh_dynamo()
    compiled = torch.compile(model, backend="inductor", fullgraph=True, dynamic=False)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, code = run_and_get_code(lambda: compiled(input_ids=ids).logits)
        want = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    source = "\n".join(code)
    assert source.count(".fused_experts.default(") == 1, source  # the experts
    assert source.count(".swiglu_infer.default(") == 1, source  # the shared expert's MLP
    assert _compile_counts() == (1, 0)
