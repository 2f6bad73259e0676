"""fused_experts on a GPU (`-m gpu`): real shapes in bf16, CUDA-graph capture, replays, compile.
"""

from __future__ import annotations

import copy
import gc
import importlib
import json
import weakref
from pathlib import Path

import pytest
import torch
from _experts_helpers import (
    NAMES,
    TRITON_VARIANTS,
    assert_close_rel,
    cfgs,
    config_dir,
    count_row_descriptors,
    kern,
    moe,
    needs_sm90_gluon,
    pipeline,
    run_with_grads,
    with_wgrad_tma,
)

from kernelhub.device import device_properties

SHAPES = {
    "qwen3_30b_a3b": dict(E=128, H=2048, I=768, K=8),
    "mixtral_8x7b": dict(E=8, H=4096, I=14336, K=2),
}


def gpu_inputs(E, H, I, K, T, dtype=torch.bfloat16):
    dev = torch.device("cuda")
    x = torch.randn(T, H, device=dev, dtype=dtype)
    gu = torch.randn(E, 2 * I, H, device=dev, dtype=dtype) * H**-0.5
    dn = torch.randn(E, H, I, device=dev, dtype=dtype) * I**-0.5
    logits = torch.randn(T, E, device=dev)
    w, idx = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    return x, gu, dn, idx, w


@pytest.mark.gpu
@pytest.mark.parametrize("variant", TRITON_VARIANTS)
@pytest.mark.parametrize("T", [1, 37, 1024])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_bf16_matches_reference(shape, T, variant):
    s = SHAPES[shape]
    if variant == "sm90" and moe.select_variant(torch.device("cuda")) != "sm90":
        pytest.skip("sm90 path needs a capability 9.x GPU")
    x, gu, dn, idx, w = gpu_inputs(s["E"], s["H"], s["I"], s["K"], T)
    dy = torch.randn_like(x)
    out, grads = run_with_grads(lambda *a: moe.fused_experts(*a, variant=variant), x, gu, dn, idx, w, dy,
                                torch.bfloat16)
    ref, ref_grads = run_with_grads(moe.fused_experts_reference, x, gu, dn, idx, w, dy, torch.float32)
    assert_close_rel(out, ref, 1e-2, "output")
    for name, got, want in zip(NAMES[:3], grads[:3], ref_grads[:3], strict=True):
        assert_close_rel(got, want, 1e-2, name)
    _assert_topk_weight_grad_close(grads[3], ref_grads[3], x, gu, dn, idx, dy)


def _assert_topk_weight_grad_close(got, want, x, gu, dn, idx, dy):
    """d topk_weights[t, k] = dy[t] . y[t, k] (expert k's output for token t): a dot over H of
    bf16-rounded terms. With T * K of them (2 at Mixtral T=1) one dot that cancels to near zero
    swings the relative norm error, so the bound is 1% of the result plus 2e-4 of the dots' natural
    size, |dy[t]| |y[t, k]| (bf16's 2**-8 over sqrt(H) terms is ~6e-5 of it at H = 4096)."""
    T, K = idx.shape
    ys = []
    for k in range(K):  # y[:, k]: the reference with weight 1 on slot k only
        unit = torch.zeros(T, K, device=x.device, dtype=torch.float32)
        unit[:, k] = 1
        ys.append(moe.fused_experts_reference(x.float(), gu.float(), dn.float(), idx, unit))
    scale = torch.stack([dy.float().norm(dim=-1) * y.norm(dim=-1) for y in ys], -1)
    err = (got.double() - want.double()).norm()
    bound = 1e-2 * want.double().norm() + 2e-4 * scale.double().norm()
    assert err < bound, f"topk_weights: error {err:.3g} >= {bound:.3g} (|want| {want.norm():.3g})"


@pytest.mark.gpu
@pytest.mark.parametrize("T", [64, 1024])  # one-program alignment, torch-ops alignment
def test_gpu_inference_is_cuda_graph_capturable(T):
    s = SHAPES["qwen3_30b_a3b"]
    x, gu, dn, idx, w = gpu_inputs(s["E"], s["H"], s["I"], s["K"], T)
    with torch.no_grad():
        expected = moe.fused_experts(x, gu, dn, idx, w)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            moe.fused_experts(x, gu, dn, idx, w)  # warm-up compiles outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe.fused_experts(x, gu, dn, idx, w)
        x2, _, _, idx2, w2 = gpu_inputs(s["E"], s["H"], s["I"], s["K"], T)
        x.copy_(x2)
        idx.copy_(idx2)
        w.copy_(w2)
        graph.replay()
        torch.cuda.synchronize()
        fresh = moe.fused_experts(x, gu, dn, idx, w)
    assert not torch.equal(fresh, expected)
    torch.testing.assert_close(out, fresh, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 1024])  # replayed decode; one-program alignment; mapping kernels
def test_gpu_inference_never_synchronizes_with_the_host(T):
    """DESIGN.md: no host synchronisation on the inference path. torch raises on any synchronizing
    CUDA call under sync debug mode "error"; the first calls of a key (seen, recorded) and the
    replayed ones all run under it, as does the MoEExperts layer."""
    s = SHAPES["qwen3_30b_a3b"]
    x, gu, dn, idx, w = gpu_inputs(s["E"], s["H"], s["I"], s["K"], T)
    with torch.no_grad():
        expected = moe.fused_experts(x, gu, dn, idx, w)  # compiles (may sync) before the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = [moe.fused_experts(x, gu, dn, idx, w) for _ in range(4)]
            with pytest.raises(RuntimeError):  # the control: the asked-for id check does sync
                moe.fused_experts(x, gu, dn, idx, w, check_indices=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for out in outs:
        assert torch.equal(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 32, 1024])  # one-program alignment; mapping kernels and TMA weights
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_inference_replays_give_the_ordinary_paths_bits(shape, T):
    """Inference: the second call of a key records its launches, later calls replay them with
    their own addresses (and new descriptors where the bucket loads by TMA). A replay must give the
    bits of the ordinary path on the same inputs, on another current stream too, still check the
    ids, and must not keep the model's tensors alive."""
    _check_replay(SHAPES[shape], T)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,T", [("mixtral_8x7b", 1024), ("qwen3_30b_a3b", 8192), ("qwen3_30b_a3b", 4096)])
def test_gpu_replays_rebuild_descriptors_over_internal_buffers(shape, T, tmp_path, monkeypatch):
    """As above with buckets (KERNELHUB_MOE_CONFIG_DIR) whose down tile reads h by TMA from
    persistent programs (Qwen3 T=4096: paired, with the tile-list launch): the replay rebuilds
    those descriptors over its workspace every call."""
    data = json.loads((Path(cfgs.__file__).parent / "configs" / "sm90.json").read_text())
    for bucket in data["buckets"] + [b for shape_buckets in data["shapes"].values() for b in shape_buckets]:
        if bucket["block_m"] >= 64:
            bucket["down"].update(A_TMA=True, PERSISTENT=1)
        bucket["gate_up"].pop("GLUON", None)  # (a Gluon launch is never recorded: the Triton path's replays here)
    (tmp_path / "sm90.json").write_text(json.dumps(data))
    monkeypatch.setenv("KERNELHUB_MOE_CONFIG_DIR", str(tmp_path))
    plan = _check_replay(SHAPES[shape], T)
    if moe.select_variant(torch.device("cuda")) == "sm90":  # the A descriptor was recorded as a view
        assert any(d is not None and type(d[1]) is tuple for launch in plan.launches for d in launch[4])


GPU_DECODE = {"max_tokens": 4, "gate_up": {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 2},
              "down": {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4, "num_stages": 2}}


@pytest.mark.gpu
@pytest.mark.parametrize("load_stages", [1, 3])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_decode_path_matches_the_reference_replays_and_captures(shape, T, load_stages, tmp_path, monkeypatch):
    """Buckets with a "decode" key (KERNELHUB_MOE_CONFIG_DIR): the token-major path at real shapes
    in bf16 against the reference, its replay (two launches) with the ordinary path's bits, and a
    CUDA graph of it; LOAD_STAGES 3: the K loops' loads pipelined through shared memory."""
    s = SHAPES[shape]
    cap = 90 if moe.select_variant(torch.device("cuda")) == "sm90" else 80
    data = json.loads((Path(cfgs.__file__).parent / "configs" / f"sm{cap}.json").read_text())
    for bucket in data["buckets"] + [b for shape_buckets in data["shapes"].values() for b in shape_buckets]:
        bucket["decode"] = copy.deepcopy(GPU_DECODE)
        for stage in ("gate_up", "down"):
            bucket["decode"][stage]["LOAD_STAGES"] = load_stages
        if load_stages > 1:  # 3 staged [8, 8, 128] weight and h tiles: 96 KB, within an A100's shared memory
            bucket["decode"]["down"]["BLOCK_K"] = 128
    (tmp_path / f"sm{cap}.json").write_text(json.dumps(data))
    with config_dir(monkeypatch, tmp_path):
        plan = _check_replay(s, T)
        assert len(plan.launches) == 2, "not the decode path's two launches"
        x, gu, dn, idx, w = gpu_inputs(s["E"], s["H"], s["I"], s["K"], T)
        with torch.no_grad():
            moe.fused_experts(x, gu, dn, idx, w)  # compiles outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = moe.fused_experts(x, gu, dn, idx, w)
            x.copy_(torch.randn_like(x))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, moe.fused_experts(x, gu, dn, idx, w))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("T", [1, 256])
def test_gpu_torch_compile_gives_the_eager_bits(T, mode):
    """torch.compile (inductor; "reduce-overhead": CUDA graphs) of fused_experts at a real shape:
    the custom ops launch the eager path's kernels, forward and backward."""
    s = SHAPES["qwen3_30b_a3b"]
    x, gu, dn, idx, w = gpu_inputs(s["E"], s["H"], s["I"], s["K"], T)

    def f(x, gu, dn, idx, w):
        return moe.fused_experts(x, gu, dn, idx, w)

    compiled = torch.compile(f, mode=mode, fullgraph=True)
    with torch.no_grad():
        want = f(x, gu, dn, idx, w)
        for _ in range(3):  # warm-up, recording, replay
            got = compiled(x, gu, dn, idx, w).clone()
    assert torch.equal(got, want)
    dy = torch.randn_like(x)
    for _ in range(3):
        got, got_grads = run_with_grads(compiled, x, gu, dn, idx, w, dy, torch.bfloat16)
    want, want_grads = run_with_grads(f, x, gu, dn, idx, w, dy, torch.bfloat16)
    assert torch.equal(got, want)
    for name, a, b in zip(NAMES[:3], got_grads[:3], want_grads[:3], strict=True):
        assert torch.equal(a, b), name
    # d topk_weights is summed over the I tiles by fp32 atomics: order, hence last bits, may differ
    assert_close_rel(got_grads[3], want_grads[3], 1e-3, "topk_weights")


def _check_replay(s: dict, T: int):
    rp = importlib.import_module(moe.__name__ + "._experts_replay")
    first = gpu_inputs(s["E"], s["H"], s["I"], s["K"], T)
    second = gpu_inputs(s["E"], s["H"], s["I"], s["K"], T)
    second = (second[0], first[1], first[2], second[3], second[4])  # same weights, new tokens and routing
    with torch.no_grad():
        rp._REPLAYS.clear()
        moe.fused_experts(*first)  # the key is seen
        key = rp.replay_key(*second, None)
        assert key is not None and rp._REPLAYS.get(key) is rp._SEEN
        moe.fused_experts(*first)  # recorded
        plan = rp._REPLAYS.get(key)
        assert isinstance(plan, rp._Replay), "the inference call was not recorded"
        assert rp.replay(plan, second) is not None
        replayed = moe.fused_experts(*second)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            on_stream = moe.fused_experts(*second)
        torch.cuda.current_stream().wait_stream(stream)
        bad = second[3].clone()
        bad[0, 0] = s["E"]  # same key, an id out of range: the replay path checks the ids when asked
        with pytest.raises(ValueError, match=r"`topk_idx` entries must be in \[-1, "):
            moe.fused_experts(second[0], second[1], second[2], bad, second[4], check_indices=True)
        # by default an inference call does not sync to check: the id is dropped like -1
        dropped = moe.fused_experts(second[0], second[1], second[2], bad, second[4])
        minus_one = bad.masked_fill(bad == s["E"], -1)
        assert torch.equal(dropped, moe.fused_experts(second[0], second[1], second[2], minus_one, second[4]))
        rp._REPLAYS.clear()
        ordinary = moe.fused_experts(*second)  # the ordinary path (the key is only seen)
    assert torch.equal(replayed, ordinary) and torch.equal(on_stream, ordinary)
    assert_close_rel(ordinary, moe.fused_experts_reference(*second), 1e-2, "output")
    ref = weakref.ref(first[1])
    del first, second
    gc.collect()
    assert ref() is None, "a kept replay holds the weights"
    return plan


@pytest.mark.gpu
@pytest.mark.parametrize("shape,T", [("mixtral_8x7b", 2048), ("qwen3_30b_a3b", 4096)])
def test_gpu_wgrad_tma_matches_the_pointer_path(shape, T, monkeypatch):
    """At real sizes, in bf16: weight gradients with TMA operands (gathered or from row-ordered copies,
    "ROWS"; dW by TMA store from persistent programs, also flattened: "FLAT_STEPS") equal the pointer
    path's bits."""
    if moe.select_variant(torch.device("cuda")) != "sm90":
        pytest.skip("TMA needs a capability 9.x GPU")
    s = SHAPES[shape]
    x, gu, dn, idx, w = gpu_inputs(s["E"], s["H"], s["I"], s["K"], T)
    dy = torch.randn_like(x)
    cfg = pipeline.bucket("sm90", s["E"], s["H"], s["I"], T * s["K"], None, x.device)
    calls = count_row_descriptors(monkeypatch)
    results = []
    # the shipped buckets may set TMA_STORE: each run below pins all three keys, the first none
    loop = {"PERSISTENT": 1, "num_stages": 2}  # persistent programs looping over tiles
    flat = {"PERSISTENT": 1, "num_stages": 3, "FLAT_STEPS": 64}  # ... in one flattened loop
    for on, rows, store, extra in ((False, False, False, {}), (True, False, False, {}), (True, True, False, {}),
                                   (True, True, True, {}), (True, True, True, loop), (True, True, True, flat)):
        pinned = with_wgrad_tma(cfg, on, rows, store)
        pinned["wgrad"].update(extra)
        _, grads = run_with_grads(lambda *a, pinned=pinned: moe.fused_experts(*a, variant="sm90", config=pinned),
                                  x, gu, dn, idx, w, dy, torch.bfloat16)
        results.append(grads)
    # The TMA branch ran: one operand of each GEMM, then (ROWS) both operands of every chunk's launch.
    assert len(calls) > 2 + 4 and len(calls) % 2 == 0
    base = results[0]
    for got_all in results[1:]:
        for name, want, got in zip(NAMES, base, got_all, strict=True):
            if name == "topk_weights":
                # fp32 atomics over the dgrad's column blocks per (token, slot) in a varying order;
                # with dots that cancel, runs differ (up to ~1e-4 relative with ~100 column blocks)
                assert_close_rel(got, want, 5e-4, name)
            else:
                assert torch.equal(want, got), name


@pytest.mark.gpu
@pytest.mark.parametrize("shape,T,pair", [("qwen3_30b_a3b", 4096, True), ("qwen3_30b_a3b", 4096, False),
                                          ("deepseek_v3", 4096, False), ("mixtral_8x7b", 1024, False)])
def test_gpu_persistent_and_tma_a_gemms_give_the_one_tile_bits(shape, T, pair, monkeypatch):
    """At real sizes, in bf16, with the shipped tiles (paired as shipped, or unpaired):
    "PERSISTENT" programs (1 per SM, and 2 for the register-capped dgrad), "A_TMA" and gate_up's
    "ROWS" and "EPI_HALVES" give the one-program-per-tile pointer path's output and gradients bit
    for bit (topk_weights: fp32 atomics in varying order)."""
    if moe.select_variant(torch.device("cuda")) != "sm90":
        pytest.skip("TMA needs a capability 9.x GPU")
    s = {**SHAPES, "deepseek_v3": dict(E=256, H=7168, I=2048, K=8)}[shape]
    x, gu, dn, idx, w = gpu_inputs(s["E"], s["H"], s["I"], s["K"], T)
    dy = torch.randn_like(x)
    shipped = pipeline.bucket("sm90", s["E"], s["H"], s["I"], T * s["K"], None, x.device)
    calls = count_row_descriptors(monkeypatch)
    base, descriptors = None, []
    both = {"PERSISTENT": 1, "A_TMA": True}
    for extra, dgrad_per_sm in (({}, 0), (both, 1), ({"PERSISTENT": 1}, 2), ({**both, "ROWS": True}, 1),
                                ({"EPI_HALVES": True}, 0)):
        calls.clear()
        cfg = copy.deepcopy(shipped)
        assert cfg.get("pair_m", False) == (shape == "qwen3_30b_a3b")  # as shipped at these points
        if not pair and cfg.pop("pair_m", False):
            cfg["block_m"] *= 2
        for stage in ("gate_up", "down", "dgrad"):
            cfg[stage].pop("PERSISTENT", None)
            cfg[stage].pop("A_TMA", None)
            cfg[stage].pop("ROWS", None)
            cfg[stage].pop("EPI_HALVES", None)
            cfg[stage].update({k: v for k, v in extra.items() if k not in ("ROWS", "EPI_HALVES") or stage == "gate_up"})
        if dgrad_per_sm:
            cfg["dgrad"]["PERSISTENT"] = dgrad_per_sm
        out, grads = run_with_grads(lambda *a, c=cfg: moe.fused_experts(*a, variant="sm90", config=c), x, gu, dn,
                                    idx, w, dy, torch.bfloat16)
        descriptors.append(len(calls))
        if base is None:  # compared as they come: DeepSeek-V3's weight gradients are 22.5 GB a run
            base = out, grads
            continue
        assert torch.equal(base[0], out)
        for name, a, b in zip(NAMES, base[1], grads, strict=True):
            if name == "topk_weights":
                assert_close_rel(b, a, 5e-4, name)
            else:
                assert torch.equal(a, b), name
        del out, grads
    # A by TMA: two more row descriptors (down and dL/dx), three with gate_up's row copy (paired: two
    # each) than the weight gradients build anyway
    per = 2 if pair else 1
    assert descriptors[1:] == [descriptors[0] + 2 * per, descriptors[0], descriptors[0] + 3 * per,
                               descriptors[0]], descriptors


@pytest.mark.gpu
@pytest.mark.parametrize("variant", TRITON_VARIANTS)
def test_gpu_paired_row_blocks_match_the_reference(variant):
    """Bucket key "pair_m" at Qwen3-30B-A3B T=4096 (256 rows per expert: pairs and lone blocks),
    rows padded to 64 and 128-row tiles, forward and every gradient in bf16 against fp32."""
    if variant == "sm90" and moe.select_variant(torch.device("cuda")) != "sm90":
        pytest.skip("sm90 path needs a capability 9.x GPU")
    s = SHAPES["qwen3_30b_a3b"]
    x, gu, dn, idx, w = gpu_inputs(s["E"], s["H"], s["I"], s["K"], 4096)
    dy = torch.randn_like(x)
    cfg = copy.deepcopy(pipeline.bucket(variant, s["E"], s["H"], s["I"], 4096 * s["K"], None, x.device))
    cfg.update(block_m=64, pair_m=True)  # sm90 ships 128 here, sm80 64: either way 128-row tiles now
    cfg = cfgs.fit_shared_memory(cfg, device_properties(x.device).shared_memory_per_block, 2)
    out, grads = run_with_grads(lambda *a: moe.fused_experts(*a, variant=variant, config=cfg), x, gu, dn, idx, w,
                                dy, torch.bfloat16)
    ref, ref_grads = run_with_grads(moe.fused_experts_reference, x, gu, dn, idx, w, dy, torch.float32)
    assert_close_rel(out, ref, 1e-2, "output")
    for name, got, want in zip(NAMES[:3], grads[:3], ref_grads[:3], strict=True):
        assert_close_rel(got, want, 1e-2, name)
    _assert_topk_weight_grad_close(grads[3], ref_grads[3], x, gu, dn, idx, dy)


def _compiled_register_caps(kernel) -> list[tuple[int, int]]:
    """(maxnreg, registers used) of every compiled variant of a JIT kernel that has run."""
    found = []
    for cache in getattr(kernel, "device_caches", {}).values():
        for compiled in cache[0].values():
            cap = getattr(compiled.metadata, "maxnreg", None)
            if cap is not None:
                found.append((cap, compiled.n_regs))
    return found


@pytest.mark.gpu
@pytest.mark.parametrize("variant", TRITON_VARIANTS)
def test_gpu_register_capped_stages_give_the_same_bits(variant):
    """Stage key "maxnreg" at Qwen3-30B-A3B T=4096 in bf16: a cap on every GEMM stage changes the
    registers ptxas may use (checked on the compiled kernels), never the result (topk_weights: fp32
    atomics in varying order)."""
    if variant == "sm90" and moe.select_variant(torch.device("cuda")) != "sm90":
        pytest.skip("sm90 path needs a capability 9.x GPU")
    s = SHAPES["qwen3_30b_a3b"]
    x, gu, dn, idx, w = gpu_inputs(s["E"], s["H"], s["I"], s["K"], 4096)
    dy = torch.randn_like(x)
    results = []
    for cap in (None, 128):
        cfg = copy.deepcopy(pipeline.bucket(variant, s["E"], s["H"], s["I"], 4096 * s["K"], None, x.device))
        # the shipped 128x256 wgrad tile holds 128 fp32 accumulators per thread: no 128-register cap
        # can compile it (ptxas asks for 154), so both runs use the 128x128 tile
        cfg["wgrad"].update(BLOCK_M=128, BLOCK_N=128)
        for stage in ("dgrad", "wgrad"):
            cfg[stage].pop("maxnreg", None)
            if cap is not None:
                cfg[stage]["maxnreg"] = cap
        results.append(run_with_grads(lambda *a, c=cfg: moe.fused_experts(*a, variant=variant, config=c), x, gu,
                                      dn, idx, w, dy, torch.bfloat16))
    (out0, grads0), (out1, grads1) = results
    assert torch.equal(out0, out1)
    for name, a, b in zip(NAMES, grads0, grads1, strict=True):
        if name == "topk_weights":
            assert_close_rel(b, a, 1e-4, name)
        else:
            assert torch.equal(a, b), name
    for kernel in (kern._grouped_gemm_kernel, kern._grouped_wgrad_kernel):
        caps = [(c, n) for c, n in _compiled_register_caps(kernel) if c == 128]
        assert caps and all(n <= 128 for _, n in caps), (kernel.__name__, caps)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["sm90", "sm80"])
def test_weight_gradients_of_experts_past_2_to_the_31_elements(variant):
    """DeepSeek-V3 sizes: expert e's gradient starts at e * 4096 * 7168 elements, past int32 for e > 73."""
    E, H, I, T, K = 256, 7168, 2048, 4, 8
    dev = torch.device("cuda", torch.cuda.current_device())
    need = 4 * 3 * E * H * I * 2  # both weights and their gradients (bf16), with as much again to spare
    if torch.cuda.get_device_properties(dev).total_memory < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of GPU memory (DeepSeek-V3's experts and their gradients)")
    g = torch.Generator(device=dev).manual_seed(0)
    gu = (torch.randn(E, 2 * I, H, device=dev, generator=g, dtype=torch.bfloat16) * 0.02).requires_grad_()
    dn = (torch.randn(E, H, I, device=dev, generator=g, dtype=torch.bfloat16) * 0.02).requires_grad_()
    x = torch.randn(T, H, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_()
    idx = torch.randperm(E, device=dev, generator=g)[: T * K].view(T, K)
    idx[0, 0] = E - 1  # the last expert: the largest offset
    w = torch.rand(T, K, device=dev, generator=g)
    moe.fused_experts(x, gu, dn, idx, w, variant=variant).float().square().sum().backward()
    torch.cuda.synchronize(dev)
    touched = torch.unique(idx)
    untouched = torch.ones(E, dtype=torch.bool, device=dev)
    untouched[touched] = False
    assert gu.grad[untouched].abs().max().item() == 0 and dn.grad[untouched].abs().max().item() == 0
    # The touched experts against the reference on just those experts (ids renumbered).
    remap = torch.full((E,), -1, dtype=torch.long, device=dev)
    remap[touched] = torch.arange(touched.numel(), device=dev)
    gu_s = gu.detach()[touched].float().requires_grad_()
    dn_s = dn.detach()[touched].float().requires_grad_()
    x_s = x.detach().float().requires_grad_()
    moe.fused_experts_reference(x_s, gu_s, dn_s, remap[idx], w).square().sum().backward()
    assert_close_rel(gu.grad[touched].float(), gu_s.grad, 2e-2, "dW_gate_up")
    assert_close_rel(dn.grad[touched].float(), dn_s.grad, 2e-2, "dW_down")
    assert_close_rel(x.grad.float(), x_s.grad, 2e-2, "dx")



def _gluon_bf16_bucket(group_m: int = 8) -> dict:
    """The shipped sm90 large-load bucket with both forward GEMMs in the Gluon kernel."""
    data = json.loads((Path(cfgs.__file__).parent / "configs" / "sm90.json").read_text())
    bucket = copy.deepcopy(data["buckets"][-1])
    for stage in ("gate_up", "down"):
        bucket[stage].update(GLUON=True, GROUP_M=group_m)
    bucket.pop("max_rows_per_expert", None)
    return bucket


@pytest.mark.gpu
@pytest.mark.parametrize("E,H,I,K,T,group_m,dtype", [
    (16, 2048, 768, 8, 600, 8, torch.bfloat16),    # several experts per group of row blocks
    (8, 1024, 1536, 2, 3000, 3, torch.bfloat16),   # groups of 3 row blocks, the last one short
    (8, 1280, 384, 2, 1, 1, torch.float16),        # one token; K steps: 20 and 6
])
def test_gpu_gluon_16bit_gemms_match_the_reference(E, H, I, K, T, group_m, dtype):
    """Inference with "GLUON" stages: both forward GEMMs in the Gluon kernel, against the fp32
    reference and within rounding of the Triton bucket; training runs the Triton kernels."""
    gl = needs_sm90_gluon()
    x, gu, dn, idx, w = gpu_inputs(E, H, I, K, T, dtype)
    cfg = _gluon_bf16_bucket(group_m)
    triton_cfg = copy.deepcopy(cfg)
    for stage in ("gate_up", "down"):
        triton_cfg[stage].pop("GLUON")
    ref = moe.fused_experts_reference(x.float(), gu.float(), dn.float(), idx, w)
    with torch.no_grad():
        before = gl.launches[0]
        out = moe.fused_experts(x, gu, dn, idx, w, variant="sm90", config=cfg)
        assert gl.launches[0] == before + 2, "the Gluon kernels did not run"
        tri = moe.fused_experts(x, gu, dn, idx, w, variant="sm90", config=triton_cfg)
    assert_close_rel(out, ref, 1e-2, "output")
    assert_close_rel(out, tri, 5e-3, "output against the Triton kernels")
    before = gl.launches[0]
    xg = x.clone().requires_grad_()
    moe.fused_experts(xg, gu, dn, idx, w, variant="sm90", config=cfg).sum().backward()
    assert gl.launches[0] == before and xg.grad is not None


@pytest.mark.gpu
def test_gpu_gluon_16bit_is_capturable_and_never_replayed(tmp_path, monkeypatch):
    """The Gluon GEMMs capture in a CUDA graph (no host sync), and an unpinned call that launched
    them (a config directory whose buckets say GLUON) is not recorded for replay."""
    gl = needs_sm90_gluon()
    rp = importlib.import_module(moe.__name__ + "._experts_replay")
    x, gu, dn, idx, w = gpu_inputs(16, 2048, 768, 8, 1024)
    cfg = _gluon_bf16_bucket()
    with torch.no_grad():
        want = moe.fused_experts(x, gu, dn, idx, w, variant="sm90", config=cfg)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = moe.fused_experts(x, gu, dn, idx, w, variant="sm90", config=cfg)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
        data = json.loads((Path(cfgs.__file__).parent / "configs" / "sm90.json").read_text())
        data["buckets"], data["shapes"] = [{**cfg, "max_rows_per_expert": None}], {}
        (tmp_path / "sm90.json").write_text(json.dumps(data))
        with config_dir(monkeypatch, tmp_path):
            key = rp.replay_key(x, gu, dn, idx, w, "sm90")
            rp._REPLAYS.clear()
            before = gl.launches[0]
            for _ in range(3):
                out = moe.fused_experts(x, gu, dn, idx, w, variant="sm90")
            state = rp._REPLAYS.get(key, "missing")
        assert gl.launches[0] == before + 6 and state is None
        assert torch.equal(out, want)
