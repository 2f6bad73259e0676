"""Tile buckets of fused_experts: the decode key, shared-memory fitting, pinned configs and config files.

CPU: the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set by the root conftest).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from _experts_helpers import (
    DECODE,
    TRITON_VARIANTS,
    assert_close_rel,
    cfgs,
    config_dir,
    loop_reference,
    make_inputs,
    moe,
    pipeline,
    with_decode,
)


def _kernel_names(calls) -> list[str]:
    return [getattr(c.launcher.kernel, "__name__", None) or c.launcher.kernel.fn.__name__ for c in calls]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", TRITON_VARIANTS)
@pytest.mark.parametrize("T", [1, 3])
def test_decode_path_matches_the_float64_loop(T, variant, dtype):
    """The token-major "decode" path: two launches (no alignment, no combine); ids -1 and >= E
    dropped; strided x, ids and weights; H and I not multiples of the tiles."""
    from kernelhub.device import CachedLaunch

    E, H, I, K = 6, 40, 24, 3
    x, gu, dn, idx, w = make_inputs(T, H, I, E, K, dtype=dtype, seed=T)
    idx[0, 1] = -1
    idx[T - 1, 2] = E  # the EP sentinel: dropped like -1 (check_indices=False)
    x_strided = torch.zeros(T, 2 * H, dtype=dtype)[:, ::2]
    x_strided.copy_(x)
    idx_t = idx.t().contiguous().t()  # strides (1, T)
    w32 = w.float()
    with CachedLaunch.recording() as calls:
        out = moe.fused_experts(x_strided, gu, dn, idx_t, w32, variant=variant, config=with_decode(),
                                check_indices=False)
    assert _kernel_names(calls) == ["_decode_gate_up_kernel", "_decode_down_kernel"]
    keep = idx.masked_fill(idx >= E, -1)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert_close_rel(out, loop_reference(x, gu, dn, keep, w32), tol, "decode output")
    grouped = moe.fused_experts(x, gu, dn, keep, w32, variant=variant, config=cfgs.INTERPRETER_CONFIG)
    assert_close_rel(out, grouped, tol, "decode vs grouped path")


@pytest.mark.parametrize("variant", TRITON_VARIANTS)
def test_decode_load_stages_matches_the_float64_loop(variant):
    """LOAD_STAGES (the K loops' loads pipelined through shared memory on a GPU): the same sums;
    several K steps in both kernels, the last partial."""
    E, H, I, K = 6, 72, 40, 3
    x, gu, dn, idx, w = make_inputs(2, H, I, E, K, dtype=torch.bfloat16, seed=5)
    idx[1, 0] = -1
    staged = {**DECODE, **{s: {**DECODE[s], "LOAD_STAGES": 3} for s in ("gate_up", "down")}}
    out = moe.fused_experts(x, gu, dn, idx, w, variant=variant, config=with_decode(staged))
    assert_close_rel(out, loop_reference(x, gu, dn, idx, w), 1e-2, "staged decode output")
    assert torch.equal(out, moe.fused_experts(x, gu, dn, idx, w, variant=variant, config=with_decode()))


def test_decode_key_applies_up_to_max_tokens_and_only_to_inference():
    from kernelhub.device import CachedLaunch

    E, H, I, K = 5, 32, 16, 2
    cfg = with_decode({**DECODE, "max_tokens": 2})
    for T, grad, decode in ((2, False, True), (3, False, False), (1, True, False)):
        x, gu, dn, idx, w = make_inputs(T, H, I, E, K)
        x.requires_grad_(grad)
        with CachedLaunch.recording() as calls:
            out = moe.fused_experts(x, gu, dn, idx, w, variant="sm80", config=cfg)
        names = _kernel_names(calls)
        assert ("_decode_down_kernel" in names) is decode, (T, grad, names)
        assert ("_grouped_gemm_kernel" in names) is not decode, (T, grad, names)
        assert_close_rel(out.detach(), loop_reference(x.detach(), gu, dn, idx, w), 1e-6, f"T={T} grad={grad}")
        if grad:
            out.sum().backward()
            assert x.grad is not None


def test_decode_stages_fit_the_shared_memory():
    bucket = with_decode({**DECODE, "gate_up": {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4}})
    per_stage = (2 * 16 + 1) * 256 * 2
    fitted = cfgs.fit_shared_memory(bucket, 3 * per_stage, 2)["decode"]
    assert fitted["gate_up"]["num_stages"] == 3 and fitted["down"]["num_stages"] == 2
    assert bucket["decode"]["gate_up"]["num_stages"] == 4  # the cached bucket is not edited


def test_paired_tiles_count_twice_block_m_when_stages_are_fitted():
    bucket = copy.deepcopy(cfgs.pick_config(90, 128, 2048, 768, 8 * 4096))
    bucket["block_m"] = 64
    bucket.pop("pair_m", None)  # the shipped Qwen3-30B-A3B entry pairs this bucket already
    tile = {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}
    bucket["down"] = dict(tile)
    smem = 4 * (128 + 128) * 64 * 2  # four stages of a 128-row tile (one byte short below)
    single = cfgs.fit_shared_memory(bucket, smem - 1, 2)["down"]["num_stages"]  # 64-row tiles fit 4
    bucket["pair_m"] = True
    paired = cfgs.fit_shared_memory(bucket, smem - 1, 2)["down"]["num_stages"]  # 128-row tiles: 3
    assert (single, paired) == (4, 3)


def test_stages_fit_the_shared_memory_of_each_device_index(fake_gpus):
    fake_gpus.specs[0]["smem"] = 100 * 1024  # an sm86-like card next to the sm90 one
    cfgs.clear_config_cache()
    try:
        small = pipeline.bucket("sm80", 8, 4096, 14336, 1024, None, torch.device("cuda", 0))
        big = pipeline.bucket("sm80", 8, 4096, 14336, 1024, None, torch.device("cuda", 1))
    finally:
        cfgs.clear_config_cache()
    assert small["block_m"] == big["block_m"]
    for stage in ("gate_up", "down", "dgrad"):
        c = small[stage]
        per_stage = (small["block_m"] + (2 if stage == "gate_up" else 1) * c["BLOCK_N"]) * c["BLOCK_K"] * 2
        assert c["num_stages"] == 2 or c["num_stages"] * per_stage <= 100 * 1024 - 1024
    assert small["gate_up"]["num_stages"] < big["gate_up"]["num_stages"]
    pinned = copy.deepcopy(cfgs.INTERPRETER_CONFIG)
    assert pipeline.bucket("sm80", 8, 4096, 14336, 1024, pinned, torch.device("cuda", 0)) is pinned


@pytest.mark.parametrize("edit,error,words", [
    (lambda c: c.pop("wgrad"), ValueError, "missing key 'wgrad'"),
    (lambda c: c.update(colour=1), ValueError, "unknown keys ['colour']"),
    (lambda c: c.update(block_m=24), ValueError, "['block_m'] must be a power of two"),
    (lambda c: c.update(block_m=1 << 20), ValueError, "['block_m'] must be a power of two >= 16 and <= 256"),
    (lambda c: c["gate_up"].update(BLOCK_K=8), ValueError, "['gate_up']['BLOCK_K'] must be a power of two >= 16"),
    (lambda c: c["down"].update(num_warps=3), ValueError, "['down']['num_warps'] must be 1, 2, 4, 8 or 16"),
    (lambda c: c["dgrad"].pop("GROUP_M"), ValueError, "['dgrad']: missing key 'GROUP_M'"),
    (lambda c: c["wgrad"].update(ROWS="yes"), TypeError, "['wgrad']['ROWS'] must be true or false"),
    (lambda c: c["wgrad"].update(ROWS_PARTS=0), ValueError, "['wgrad']['ROWS_PARTS'] must be an int >= 1"),
    (lambda c: c["wgrad"].update(TMA_LOAD=True), ValueError, "['wgrad']: unknown keys ['TMA_LOAD']"),
    (lambda c: c.update(tma=1), TypeError, "['tma'] must be true or false"),
    (lambda c: c.update(pair_m="on"), TypeError, "['pair_m'] must be true or false"),
    (lambda c: c["dgrad"].update(maxnreg=300), ValueError, "['dgrad']['maxnreg'] must be an int in [24, 255]"),
    (lambda c: c["wgrad"].update(maxnreg=True), ValueError, "['wgrad']['maxnreg'] must be an int in [24, 255]"),
    (lambda c: c["wgrad"].update(PERSISTENT=-1), ValueError, "['wgrad']['PERSISTENT'] must be an int >= 0"),
    (lambda c: c["wgrad"].update(FLAT_STEPS=4), ValueError, "set 'PERSISTENT' (programs per SM) >= 1 too"),
    (lambda c: c["wgrad"].update(PERSISTENT=1, FLAT_STEPS=-2), ValueError, "['FLAT_STEPS'] must be an int >= 0"),
    (lambda c: c["down"].update(PERSISTENT=-1), ValueError, "['down']['PERSISTENT'] must be an int >= 0"),
    (lambda c: c["gate_up"].update(A_TMA=1), TypeError, "['gate_up']['A_TMA'] must be true or false"),
    (lambda c: c["down"].update(ROWS=True), ValueError, "['down']: 'ROWS' is a gate_up key"),
    (lambda c: c["dgrad"].update(EPI_HALVES=True), ValueError, "['dgrad']: 'EPI_HALVES' is a gate_up key"),
    (lambda c: c["down"].update(GLUON=1), TypeError, "['down']['GLUON'] must be true or false"),
    (lambda c: c["down"].update(GLUON=True), ValueError,
     "['down']['GLUON'] needs a gate_up or down stage and block_m 128"),
    (lambda c: c.update(block_m=128) or c["dgrad"].update(GLUON=True), ValueError,
     "['dgrad']['GLUON'] needs a gate_up or down stage and block_m 128"),
    (lambda c: c.update(decode=[1]), TypeError, "['decode'] must be a dict"),
    (lambda c: c.update(decode={"gate_up": DECODE["gate_up"], "down": DECODE["down"]}), ValueError,
     "['decode']: missing key 'max_tokens'"),
    (lambda c: c.update(decode={**DECODE, "max_tokens": 0}), ValueError,
     "['decode']['max_tokens'] must be an int >= 1"),
    (lambda c: c.update(decode={**DECODE, "rows": 1}), ValueError, "['decode']: unknown keys ['rows']"),
    (lambda c: c.update(decode={"max_tokens": 1, "gate_up": DECODE["gate_up"]}), ValueError,
     "['decode']: missing key 'down'"),
    (lambda c: c.update(decode={**DECODE, "down": {**DECODE["down"], "BLOCK_N": 2}}), ValueError,
     "['decode']['down']['BLOCK_N'] must be a power of two >= 4"),
    (lambda c: c.update(decode={**DECODE, "down": {**DECODE["down"], "BLOCK_K": 24}}), ValueError,
     "['decode']['down']['BLOCK_K'] must be a power of two >= 16"),
    (lambda c: c.update(decode={**DECODE, "gate_up": {"BLOCK_N": 8}}), ValueError,
     "['decode']['gate_up']: missing key 'BLOCK_K'"),
    (lambda c: c.update(decode={**DECODE, "down": {**DECODE["down"], "LOAD_STAGES": 9}}), ValueError,
     "['decode']['down']['LOAD_STAGES'] must be in [1, 8]"),
    (lambda c: c.update(decode={**DECODE, "gate_up": {**DECODE["gate_up"], "LOAD_STAGES": 0}}), ValueError,
     "['decode']['gate_up']['LOAD_STAGES'] must be an int >= 1"),
    (lambda c: c.update(decode={**DECODE, "gate_up": {**DECODE["gate_up"], "LOAD_STAGES": 2.0}}), ValueError,
     "['decode']['gate_up']['LOAD_STAGES'] must be an int >= 1"),
])
def test_a_bad_pinned_config_is_a_clear_error(edit, error, words):
    cfg = copy.deepcopy(cfgs.INTERPRETER_CONFIG)
    edit(cfg)
    x, gu, dn, idx, w = make_inputs(3, 32, 16, 4, 2)
    with pytest.raises(error) as info:
        moe.fused_experts(x, gu, dn, idx, w, variant="sm80", config=cfg)
    assert "fused_experts: `config`" in str(info.value) and words in str(info.value), str(info.value)


def test_a_bad_config_file_names_the_file_and_the_bucket(tmp_path, monkeypatch):
    data = json.loads((Path(cfgs._DIR) / "sm80.json").read_text())
    data["buckets"][1]["wgrad"]["BLOCK_M"] = 100
    (tmp_path / "sm80.json").write_text(json.dumps(data))
    with config_dir(monkeypatch, tmp_path) as configs:
        with pytest.raises(ValueError, match=r"sm80.json: buckets\[1\]\['wgrad'\]\['BLOCK_M'\] must be a power of two"):
            configs.pick_config(80, 8, 64, 64, 16)


def test_a_config_dir_that_does_not_exist_is_named(tmp_path, monkeypatch):
    with config_dir(monkeypatch, tmp_path / "tunde") as configs:  # a typo
        with pytest.raises(ValueError, match=r"KERNELHUB_MOE_CONFIG_DIR=.*tunde' is not a directory"):
            configs.pick_config(80, 8, 64, 64, 16)


def test_the_shipped_configs_are_valid():
    for name in ("sm80.json", "sm90.json"):
        data = json.loads((Path(cfgs._DIR) / name).read_text())
        for i, bucket in enumerate(data["buckets"]):
            cfgs.check_bucket(bucket, f"{name}: buckets[{i}]")


def test_tile_configs_have_every_stage():
    for cap in (80, 90):
        for pairs in (8, 256, 4096, 131072):
            bucket = cfgs.pick_config(cap, 128, 2048, 768, pairs)
            assert {"block_m", "gate_up", "down", "dgrad", "wgrad"} <= bucket.keys()
    assert cfgs.pick_config(90, 128, 2048, 768, 8)["block_m"] <= cfgs.pick_config(90, 128, 2048, 768, 131072)[
        "block_m"]


def test_config_directory_override_is_read(tmp_path, monkeypatch):
    data = json.loads((Path(cfgs.__file__).parent / "configs" / "sm90.json").read_text())
    tuned = dict(data["buckets"][-1], block_m=64, max_rows_per_expert=None)
    data["shapes"] = {cfgs.shape_key(8, 64, 32): [tuned]}
    (tmp_path / "sm90.json").write_text(json.dumps(data))
    monkeypatch.setenv("KERNELHUB_MOE_CONFIG_DIR", str(tmp_path))
    try:
        assert cfgs.pick_config(90, 8, 64, 32, 16)["block_m"] == 64
        assert cfgs.pick_config(90, 128, 2048, 768, 8) == data["buckets"][0]
    finally:
        monkeypatch.delenv("KERNELHUB_MOE_CONFIG_DIR")
        cfgs.clear_config_cache()




@pytest.mark.parametrize("variant", [None, "reference", *TRITON_VARIANTS])
@pytest.mark.parametrize("grad", [False, True])
def test_a_bad_pinned_config_is_refused_by_every_variant(variant, grad):
    """The CPU default (the reference) checks a pinned config as sm80/sm90 do, though it does not use
    it: the same call must not pass on the CPU and fail on the GPU."""
    x, gu, dn, idx, w = make_inputs(3, 32, 16, 4, 2)
    x.requires_grad_(grad)
    with pytest.raises(ValueError, match=r"fused_experts: `config`\['block_m'\] must be a power of two >= 16"):
        moe.fused_experts(x, gu, dn, idx, w, variant=variant, config={**cfgs.INTERPRETER_CONFIG, "block_m": 3})
    with pytest.raises(TypeError, match=r"fused_experts: `config` must be a dict"):
        moe.fused_experts(x, gu, dn, idx, w, variant=variant, config=[("block_m", 16)])


@pytest.mark.parametrize("edit, words", [
    (lambda d: d["buckets"][0].update(max_rows_per_expert="64"), r"buckets\[0\]\['max_rows_per_expert'\] must be"),
    (lambda d: d["buckets"][0].update(max_rows_per_expert=True), r"buckets\[0\]\['max_rows_per_expert'\] must be"),
    (lambda d: d["buckets"][0].update(max_rows_per_expert=float("nan")),
     r"buckets\[0\]\['max_rows_per_expert'\] must be"),
    (lambda d: d.update(buckets=[]), r"`buckets` must be a non-empty list"),
    (lambda d: d.update(shapes={cfgs.shape_key(8, 64, 64): {}}), r"`shapes\['E8_H64_I64'\]` must be a list"),
    (lambda d: d.update(shapes=[]), r"`shapes` must be an object"),
])
def test_a_config_file_with_bad_bucket_selection_is_a_clear_error(edit, words, tmp_path, monkeypatch):
    """The keys that choose a bucket (a tuned file under KERNELHUB_MOE_CONFIG_DIR is user input): a
    ValueError naming the file, not a TypeError comparing a load with a string or an IndexError."""
    data = json.loads((Path(cfgs._DIR) / "sm80.json").read_text())
    edit(data)
    (tmp_path / "sm80.json").write_text(json.dumps(data))
    with config_dir(monkeypatch, tmp_path) as configs:
        with pytest.raises(ValueError, match=r"sm80.json: " + words):
            configs.pick_config(80, 8, 64, 64, 16)


def test_gluon_stages_fall_back_to_the_triton_kernels_where_they_cannot_run():
    """A "GLUON" bucket off a capability 9.0 GPU (here: the interpreter) runs the Triton kernels:
    the same bits as the bucket without the key."""
    plain = {**copy.deepcopy(cfgs.INTERPRETER_CONFIG), "block_m": 128}
    gluon = copy.deepcopy(plain)
    gluon["gate_up"]["GLUON"] = gluon["down"]["GLUON"] = True
    x, gu, dn, idx, w = make_inputs(5, 32, 16, 4, 2, seed=3)
    a, b = (moe.fused_experts(x, gu, dn, idx, w, variant="sm90", config=c) for c in (plain, gluon))
    assert torch.equal(a, b)
    assert_close_rel(b, loop_reference(x, gu, dn, idx, w), 1e-2, "output")
