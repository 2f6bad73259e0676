"""Cross-device correctness on two GPUs (issue: two-GPU run). Needs >= 2 CUDA GPUs.

Run: KERNELHUB_TEST_GPU=1 TRITON_INTERPRET=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
     python3 -m pytest -q -m multigpu tests/multi_gpu
"""

from pathlib import Path

import pytest
import torch

import kernelhub
from kernelhub.device import device_capability, device_properties
from kernelhub.hub import get_local_kernel

pytestmark = [
    pytest.mark.multigpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

ROOT = Path(__file__).resolve().parents[2]
swiglu_k = get_local_kernel(ROOT / "kernels_repo" / "swiglu")
moe_k = get_local_kernel(ROOT / "kernels_repo" / "moe")
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _swiglu_call(fn_name, dtype, device, strided, impl):
    g = torch.Generator(device="cpu").manual_seed(0)
    if fn_name == "swiglu":
        base = torch.randn(64, 2 * 300, generator=g).to(device, dtype)
        gate, up = (base[:, ::2], base[:, 1::2]) if strided else base.chunk(2, -1)
        gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
        out = swiglu_k.swiglu(gate, up, impl=impl)
        dy = torch.randn(out.shape, generator=g).to(device, dtype)
        out.backward(dy)
        return out, gate.grad, up.grad
    x = torch.randn(64, 2 * 300, generator=g).to(device, dtype)
    if strided:
        x = torch.randn(64, 4 * 300, generator=g).to(device, dtype)[:, ::2]
    x = x.detach().requires_grad_()
    out = swiglu_k.swiglu_packed(x, impl=impl)
    dy = torch.randn(out.shape, generator=g).to(device, dtype)
    out.backward(dy)
    return out, x.grad


@pytest.mark.parametrize("impl", ["sm90", "sm80", None])
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn_name", ["swiglu", "swiglu_packed"])
@pytest.mark.parametrize("current,target", [(0, 1), (1, 0)])
def test_swiglu_runs_on_its_inputs_device_not_the_current_one(fn_name, dtype, strided, impl, current, target):
    torch.cuda.set_device(target)
    expected = _swiglu_call(fn_name, dtype, torch.device("cuda", target), strided, impl)
    torch.cuda.synchronize(target)
    torch.cuda.set_device(current)
    stream = torch.cuda.Stream(device=target)
    with torch.cuda.stream(stream):  # a non-default stream on the *target* device
        got = _swiglu_call(fn_name, dtype, torch.device("cuda", target), strided, impl)
    stream.synchronize()
    assert torch.cuda.current_device() == current
    for g, e in zip(got, expected, strict=True):
        assert g.device == torch.device("cuda", target)
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def _moe_inputs(device, dtype, T=96, E=8, H=128, I=96, K=2):
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(T, H, generator=g).to(device, dtype).requires_grad_()
    w1 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(device, dtype).requires_grad_()
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).to(device, dtype).requires_grad_()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(device)
    w = torch.rand(T, K, generator=g).to(device, torch.float32).requires_grad_()
    return x, w1, w2, idx, w


def _moe_call(device, dtype, variant):
    x, w1, w2, idx, w = _moe_inputs(device, dtype)
    out = moe_k.fused_experts(x, w1, w2, idx, w, variant=variant)
    out.float().square().sum().backward()
    mapping = moe_k.get_fused_mapping(idx, 8, 0, 16)
    expanded = moe_k.expand_to_fused(x.detach(), mapping[3], mapping[0])
    reduced = moe_k.reduce_fused(expanded, w.detach(), mapping[3])
    return [out, x.grad, w1.grad, w2.grad, w.grad, *mapping[:7], expanded, reduced]


@pytest.mark.parametrize("variant", ["sm90", "sm80"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("current,target", [(0, 1), (1, 0)])
def test_moe_kernels_run_on_their_inputs_device(variant, dtype, current, target):
    torch.cuda.set_device(target)
    expected = _moe_call(torch.device("cuda", target), dtype, variant)
    torch.cuda.synchronize(target)
    torch.cuda.set_device(current)
    stream = torch.cuda.Stream(device=target)
    with torch.cuda.stream(stream):  # forward *and backward* on a non-default stream of the target
        got = _moe_call(torch.device("cuda", target), dtype, variant)
    stream.synchronize()
    assert torch.cuda.current_device() == current
    for g, e in zip(got, expected, strict=True):
        assert g.device == torch.device("cuda", target)
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("variant", ["sm90", "sm80"])
@pytest.mark.parametrize("current,target", [(0, 1), (1, 0)])
def test_moe_inference_replay_runs_on_its_inputs_device_and_stream(variant, current, target):
    # inference calls of one key are recorded on the second call and replayed from the third
    # (_experts_replay): the replayed launches must follow the input's device and its current stream
    dev = torch.device("cuda", target)
    x, w1, w2, idx, w = (t.detach() for t in _moe_inputs(dev, torch.bfloat16))
    torch.cuda.set_device(target)
    with torch.no_grad():
        expected = moe_k.fused_experts(x, w1, w2, idx, w, variant=variant, check_indices=False)
    torch.cuda.synchronize(target)
    torch.cuda.set_device(current)
    stream = torch.cuda.Stream(device=target)
    with torch.no_grad(), torch.cuda.stream(stream):
        outs = [moe_k.fused_experts(x, w1, w2, idx, w, variant=variant, check_indices=False) for _ in range(4)]
    stream.synchronize()
    assert torch.cuda.current_device() == current
    replay = moe_k._experts_replay
    assert replay.recorded(replay.replay_key(x, w1, w2, idx, w, variant)) is not None  # it did replay
    for out in outs:
        assert out.device == dev
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def _small_moe_model():
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).eval().to(torch.bfloat16)


def _split(model):
    model.to("cuda:0")
    for i, layer in enumerate(model.model.layers):
        layer.to(torch.device("cuda", i * 2 // len(model.model.layers)))

    def hop(module, args, kwargs):
        dev = next(module.parameters()).device
        move = lambda v: v.to(dev) if isinstance(v, torch.Tensor) else v  # noqa: E731
        return tuple(move(a) for a in args), {
            k: tuple(move(t) for t in v) if isinstance(v, tuple) else move(v) for k, v in kwargs.items()}

    for m in [*model.model.layers, model.model.norm, model.lm_head]:
        m.register_forward_pre_hook(hop, with_kwargs=True)


def test_kernelize_model_split_over_two_gpus_binds_each_module_to_its_device():
    ids = torch.randint(0, 256, (2, 32), device="cuda:0")
    single = _small_moe_model().to("cuda:0")
    with torch.no_grad():
        ref = single(input_ids=ids).logits.float()
    kernelhub.kernelize(single)
    with torch.no_grad():
        ref_k = single(input_ids=ids).logits.float()

    model = _small_moe_model()
    _split(model)
    report = kernelhub.kernelize_report(kernelhub.kernelize(model))
    for e in report.entries:
        assert e.fallback_reason is None, e
        layer_idx = int(e.module_name.split(".")[2])
        assert e.device == torch.device("cuda", layer_idx * 2 // 4)
        assert e.capability == device_capability(e.device)
    with torch.no_grad():
        out = model(input_ids=ids).logits.float()
    torch.testing.assert_close(out, ref_k, rtol=2e-2, atol=2e-2)
    assert ((out - ref).norm() / ref.norm()) < 3e-2
    # Move everything to the other GPU after kernelize: forwards re-resolve for cuda:1.
    model.to("cuda:1")
    with torch.no_grad():
        moved = model(input_ids=ids.to("cuda:1")).logits.float()
    torch.testing.assert_close(moved.to("cuda:0"), ref_k, rtol=2e-2, atol=2e-2)


def test_device_property_caches_are_per_index():
    from kernelhub import device as dev

    dev.clear_device_caches()
    for i in range(2):
        device_capability(torch.device("cuda", i))
        device_properties(torch.device("cuda", i))
    assert set(dev._capability_cache) >= {("cuda", 0), ("cuda", 1)}
    assert set(dev._properties_cache) >= {("cuda", 0), ("cuda", 1)}
    for i in range(2):
        p = torch.cuda.get_device_properties(i)
        assert device_properties(torch.device("cuda", i)).sm_count == p.multi_processor_count
