"""fp8 experts' tiles as data (configs/fp8_<variant>.json, pinned `config=`), x's quantize pass and
the sm90 TMA loads.

CPU: the Triton variants run in the interpreter (TRITON_INTERPRET=1), which executes TMA tensor
descriptors (out-of-box reads as zero, as on the GPU) and emulates the fp8 rounding as
test_experts_fp8.py describes. Bitwise equalities below hold because the paths compared round the
same values the same way (the quantize pass and the in-load quantization share `_quantize_rows`).
"""

from __future__ import annotations

import copy
import importlib
import json

import pytest
import torch
from _experts_helpers import moe
from test_experts_fp8 import emulation, make_fp8, oracle, rel

fp8x = importlib.import_module(moe.__name__ + "._fp8_experts")
fp8c = importlib.import_module(moe.__name__ + "._fp8_configs")
cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
ref8 = importlib.import_module(moe.__name__ + ".reference_fp8")

# H and I multiples of 16 (TMA-compatible strides) but not of 128 (edge blocks); -1 ids
TMA_SHAPE = dict(T=9, H=272, I=144, E=5, K=2)
BASE = {"block_m": 16, "gate_up": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 1},
        "down": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 1}}


def _inputs(seed=21, **kw):
    s = {**TMA_SHAPE, **kw}
    return make_fp8(s["T"], s["H"], s["I"], s["E"], s["K"], seed=seed, drop=2)


def _run(args, config, variant="sm90"):
    x, guq, dq, idx, w, scales = args
    return moe.fused_experts(x, guq, dq, idx, w, variant=variant, config=config, **scales)


def _agree(q, want_q) -> None:
    """fp8 values equal but for rare ties: the kernels compute 448 / amax by a division, torch by a
    reciprocal, so a product on an exact e4m3 midpoint may round to either neighbour."""
    a, b = q.float(), want_q.float()
    differ = a != b
    assert differ.float().mean() < 2e-3
    assert ((a - b).abs() <= b.abs() / 8 + 1e-3)[differ].all()  # one e4m3 step


def test_quantize_pass_matches_the_reference_rounding():
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(37, 200, generator=g) * 3).to(torch.bfloat16)
    x[3] = 0  # an all-zero token: finite scales, zeros stay zeros
    q, s = fp8x.quantize_x(x)
    want_q, want_s = ref8.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (37, 2)
    assert torch.equal(s, want_s) and not q[3].float().any()
    _agree(q, want_q)
    # a column-strided x is quantized the same
    q2, s2 = fp8x.quantize_x(x.t().contiguous().t())
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)


@pytest.mark.parametrize("tma", [True, False])
def test_sm90_quantize_pass_and_in_load_quantization_give_the_same_output(tma):
    args = _inputs()
    assert fp8x.sm90.tma_ok(args[1]) and fp8x.sm90.tma_ok(args[2])  # the TMA path does run
    outs = {q: _run(args, {**BASE, "tma": tma, "quant_x": q}) for q in (True, False)}
    assert torch.equal(outs[True], outs[False])
    ref, emu = oracle(*args), emulation(*args)
    err_emu = rel(emu, ref)
    assert rel(outs[True], ref) <= 1.25 * err_emu and rel(outs[True], emu) < 0.4 * err_emu


@pytest.mark.parametrize("T, block_m", [(9, 16), (9, 64), (300, 16)])  # (300 x 2 pairs: the large-batch routing)
def test_quantize_pass_in_row_order_is_the_token_pass_gathered(T, block_m):
    """ROWS: buffer row p holds token rows[p] // K's quantized values and scales; padding rows (an
    expert's rows past its count, within its last row block) are zero with a finite scale; -1 ids
    get no row. (Rows past the last expert's are not checked: no GEMM reads them.)"""
    args = _inputs(seed=30, T=T)
    x, idx, K = args[0], args[3], args[3].shape[1]
    routing = fp8x.align_rows(idx, args[1].shape[0], block_m)
    assert (T * K > importlib.import_module(moe.__name__ + "._experts_routing").SMALL_PAIRS) == (T == 300)
    q, s = fp8x.quantize_x(x)
    qr, sr = fp8x.quantize_x(x, routing, K)
    assert qr.shape == (routing.num_rows, x.shape[1]) and sr.shape == (routing.num_rows, s.shape[1])
    flat = routing.rows.long()
    real = flat >= 0
    used = int(routing.expert_start[-1] + -(-routing.expert_count[-1] // block_m) * block_m)
    padding = ~real & (torch.arange(routing.num_rows) < used)
    assert real.any() and padding.any() and (idx < 0).any()  # padding rows and -1 ids are there
    tok = flat[real] // K
    assert torch.equal(qr[real].view(torch.uint8), q[tok].view(torch.uint8)) and torch.equal(sr[real], s[tok])
    assert not qr[padding].float().any() and torch.isfinite(sr[padding]).all() and (sr[padding] > 0).all()


@pytest.mark.parametrize("tma", [True, False])
def test_sm90_gate_up_reading_x_in_row_order_gives_the_gathering_paths_bits(tma):
    """gate/up "A_TMA": x quantized into the aligned row order and read by TMA instead of gathered;
    the same products, so the same output ("tma": false: the key is moot, x is gathered)."""
    from kernelhub.device import CachedLaunch

    args = _inputs(seed=31)
    gathered = _run(args, {**BASE, "tma": tma})
    with CachedLaunch.recording() as calls:
        in_rows = _run(args, {**BASE, "tma": tma, "gate_up": {**BASE["gate_up"], "A_TMA": True}})
    assert torch.equal(in_rows, gathered)
    gemms = [c.constexprs for c in calls if hasattr(c.constexprs, "B_TMA")]
    quant = [c.constexprs for c in calls if hasattr(c.constexprs, "ROWS")]
    assert [q.ROWS for q in quant] == [tma] and [(g.GATHER_A, g.A_TMA) for g in gemms][0] == (not tma, tma)


@pytest.mark.parametrize("a_tma", [True, False])
def test_sm90_tma_loads_equal_pointer_loads(a_tma):
    """Weights (and down's h with "A_TMA") through descriptors: edge blocks read zero like masks;
    the gate tile's columns past I, which read up rows through the descriptor, are never stored."""
    from kernelhub.device import CachedLaunch

    args = _inputs(seed=22)
    down = {**BASE["down"], "A_TMA": a_tma}
    with CachedLaunch.recording() as calls:
        with_tma = _run(args, {**BASE, "down": down, "tma": True})
    without = _run(args, {**BASE, "down": down, "tma": False})
    assert torch.equal(with_tma, without)
    # (the descriptors were used: else the two runs take the same path and agree trivially)
    gemms = [c.constexprs for c in calls if hasattr(c.constexprs, "B_TMA")]
    assert [(g.B_TMA, g.A_TMA) for g in gemms] == [(True, False), (True, a_tma)]


@pytest.mark.parametrize("tma", [True, False])
def test_sm90_rescaled_accumulator_gives_the_same_sum(tma):
    """"RESCALE": the MMA accumulates in place into acc / c_k; the result is the per-K-block scaled
    sum up to fp32 rounding (edge blocks: masked rows' and columns' zero scales taken as 1; the gate
    tile's columns past I read up rows through TMA)."""
    args = _inputs(seed=25, H=400)  # 4 K-blocks in gate/up, 2 in down
    plain = _run(args, {**BASE, "tma": tma})
    stages = {s: {**BASE[s], "RESCALE": True} for s in ("gate_up", "down")}
    rescaled = _run(args, {**BASE, **stages, "tma": tma})
    ref, emu = oracle(*args), emulation(*args)
    err_emu = rel(emu, ref)
    assert rel(rescaled, ref) <= 1.25 * err_emu and rel(rescaled, emu) < 0.4 * err_emu
    assert rel(rescaled, plain) < 0.05 * err_emu  # h's fp8 rounding may flip single elements
    # W8A16 math ignores it
    w8 = {**BASE, "w8a16": True}
    assert torch.equal(_run(args, {**w8, **stages}), _run(args, w8))


@pytest.mark.parametrize(("variant", "stages"), [
    ("sm90", {}), ("sm90", {"tma": False}), ("sm90", {"RESCALE": True}), ("sm80", {})])
def test_one_scale_per_k_step_gives_the_per_column_paths_bits(monkeypatch, variant, stages):
    """Where a tile's columns lie in one weight scale block ("ONE_SCALE": I a multiple of the tile for
    gate/up, whose up rows then start on a tile boundary; any down tile of at most 128 columns, the
    last one partial here) the kernel loads one scale per K step and scales by a per-row factor: the
    same products as the per-column scales, so the same bits. Tiles of 64 (two per scale block), 128
    and 256 (two blocks: per column) wide."""
    from kernelhub.device import CachedLaunch

    args = _inputs(seed=29, I=256)  # H = 272: down's last tile is partial
    flags = {k: v for k, v in stages.items() if k == "tma"}
    rescale = {k: v for k, v in stages.items() if k == "RESCALE"}
    cfg = {**BASE, **flags, "gate_up": {**BASE["gate_up"], "BLOCK_N": 64, **rescale},
           "down": {**BASE["down"], "BLOCK_N": 256, **rescale}}
    if variant == "sm90":  # (fp8 math: gate/up tiles are one 128-column group of h)
        cfg["gate_up"]["BLOCK_N"] = 128
    for down_n in (64, 128, 256):
        cfg["down"]["BLOCK_N"] = down_n
        with CachedLaunch.recording() as calls:
            one = _run(args, cfg, variant)
        used = [c.constexprs.ONE_SCALE for c in calls if hasattr(c.constexprs, "ONE_SCALE")]
        assert used == [True, down_n <= 128], used
        monkeypatch.setattr(fp8x, "one_scale", lambda *a: False)
        per_column = _run(args, cfg, variant)
        monkeypatch.undo()
        assert torch.equal(one, per_column), down_n
    ref = oracle(*args)
    assert rel(one, ref) < (1.25 * rel(emulation(*args), ref) if variant == "sm90" else 1e-2)


@pytest.mark.parametrize("stages", [{}, {"RESCALE": True}, {"w8a16": True}])
def test_fused_gate_up_tile_gives_the_two_tile_output(stages):
    """gate/up "FUSED": gate and up rows as one TMA box and one MMA per K step, the accumulator split
    for the epilogue; the same products and scales as two tiles (sums within fp32 rounding of each
    other), for fp8 math (plain and RESCALE) and W8A16. Ignored where I is not a multiple of the tile
    (the up rows would not start on a tile boundary) or without TMA."""
    from kernelhub.device import CachedLaunch

    args = _inputs(seed=33, I=256)
    flags = {k: v for k, v in stages.items() if k == "w8a16"}
    gate_up = {**BASE["gate_up"], **{k: v for k, v in stages.items() if k == "RESCALE"}}
    two = _run(args, {**BASE, **flags, "gate_up": gate_up})
    with CachedLaunch.recording() as calls:
        fused = _run(args, {**BASE, **flags, "gate_up": {**gate_up, "FUSED": True}})
    assert [c.constexprs.FUSED for c in calls if hasattr(c.constexprs, "FUSED")] == [True, False]
    ref, emu = oracle(*args), emulation(*args)
    tol = 1e-2 if flags else rel(emu, ref)
    assert rel(fused, ref) < (tol if flags else 1.25 * tol) and rel(fused, two) < 0.05 * tol
    if not flags:  # with x in row order by TMA too (fp8 math): both descriptors reach the kernel
        with CachedLaunch.recording() as calls:
            both = _run(args, {**BASE, "gate_up": {**gate_up, "FUSED": True, "A_TMA": True}})
        gemm = [c.constexprs for c in calls if hasattr(c.constexprs, "FUSED")][0]
        assert (gemm.FUSED, gemm.A_TMA, gemm.GATHER_A) == (True, True, False), gemm
        assert torch.equal(both, fused)
    for moot, cfg in (("ragged I", _inputs(seed=34)), ("no TMA", args)):
        extra = {"tma": False} if moot == "no TMA" else {}
        with CachedLaunch.recording() as calls:
            out = _run(cfg, {**BASE, **flags, **extra, "gate_up": {**gate_up, "FUSED": True}})
        assert not any(c.constexprs.FUSED for c in calls if hasattr(c.constexprs, "FUSED")), moot
        assert torch.equal(out, _run(cfg, {**BASE, **flags, **extra, "gate_up": gate_up})), moot


@pytest.mark.parametrize(("variant", "extra"), [
    ("sm90", {}), ("sm90", {"tma": False}), ("sm90", {"FUSED": True}), ("sm80", {})])
def test_persistent_programs_give_the_one_program_per_tile_bits(variant, extra):
    """"PERSISTENT": a few programs (3 on the interpreter) loop over the used rows' tiles, whose count
    they read on the device; the same tiles, so the same bits. Experts without tokens, -1 ids,
    several row blocks per expert (block_m 16, 9 tokens x 2 of 5 experts)."""
    from kernelhub.device import CachedLaunch

    args = _inputs(seed=35, I=256, E=5)
    flags = {k: v for k, v in extra.items() if k == "tma"}
    fused = {k: v for k, v in extra.items() if k == "FUSED"}
    cfg = {**BASE, **flags, "gate_up": {**BASE["gate_up"], **fused}}
    plain = _run(args, cfg, variant)
    for per_sm in (1, 2):
        stages = {s: {**cfg[s], "PERSISTENT": per_sm} for s in ("gate_up", "down")}
        with CachedLaunch.recording() as calls:
            out = _run(args, {**cfg, **stages}, variant)
        gemms = [c for c in calls if hasattr(c.constexprs, "PERSISTENT")]
        assert [g.constexprs.PERSISTENT for g in gemms] == [True, True]
        assert all(len(g.grid) == 1 and g.grid[0] == 3 * per_sm for g in gemms), [g.grid for g in gemms]
        assert torch.equal(out, plain), per_sm


def test_persistent_needs_the_tile_as_tall_as_the_alignment():
    cfg = {**BASE, "block_m": 32, "gate_up": {**BASE["gate_up"], "BLOCK_M": 16, "PERSISTENT": 1}}
    with pytest.raises(ValueError, match=r"\['gate_up'\]\['PERSISTENT'\] needs the tile as tall as block_m=32"):
        _run(_inputs(), cfg)


@pytest.mark.parametrize("block_k", [32, 64])
@pytest.mark.parametrize("variant", ["sm90", "sm80"])
def test_k_steps_shorter_than_the_scale_block(variant, block_k):
    """"BLOCK_K" 32 / 64: several K steps per 128-column scale block, each reading that block's
    scales (weights; sm90 also x's and h's); H and I not multiples of 128; TMA boxes that deep."""
    args = _inputs(seed=27)
    stages = {s: {**BASE[s], "BLOCK_K": block_k} for s in ("gate_up", "down")}
    out = _run(args, {**BASE, **stages}, variant)
    ref = oracle(*args)
    if variant == "sm80":
        assert rel(out, ref) < 1e-2
        return
    emu = emulation(*args)
    err_emu = rel(emu, ref)
    assert rel(out, ref) <= 1.25 * err_emu and rel(out, emu) < 0.4 * err_emu
    # x quantized in the load steps whole groups whatever BLOCK_K says (its amax spans the group)
    assert torch.equal(_run(args, {**BASE, **stages, "quant_x": False}), _run(args, {**BASE, "quant_x": False}))


def test_w8a16_bucket_on_sm90_does_not_quantize_activations():
    args = _inputs(seed=23)
    ref = oracle(*args)
    out = _run(args, {**BASE, "w8a16": True, "gate_up": {**BASE["gate_up"], "BLOCK_N": 32}})
    assert rel(out, ref) < 0.25 * rel(emulation(*args), ref)
    # the same config on the sm80 variant: the same W8A16 math
    assert torch.equal(out, _run(args, {**BASE, "gate_up": {**BASE["gate_up"], "BLOCK_N": 32}}, "sm80"))


def test_pinned_config_tiles_are_used():
    """Another block_m and column tile give the same rows (each output element is one K loop)."""
    args = _inputs(seed=24)
    a = _run(args, BASE)
    b = _run(args, {**BASE, "block_m": 32, "down": {**BASE["down"], "BLOCK_N": 32}})
    assert torch.equal(a, b)
    # a stage's own tile height under the alignment (32-row blocks, 16-row gate/up tiles)
    c = _run(args, {**BASE, "block_m": 32, "gate_up": {**BASE["gate_up"], "BLOCK_M": 16}})
    assert torch.equal(a, c)


@pytest.mark.parametrize(("patch", "err", "match"), [
    ({"block_m": 24}, ValueError, r"`config`\['block_m'\] must be a power of two"),
    ({"block_m": 1 << 20}, ValueError, r"`config`\['block_m'\] must be a power of two >= 16 and <= 256"),
    ({"quant_x": 1}, TypeError, r"`config`\['quant_x'\] must be true or false"),
    ({"gate_up": {**BASE["gate_up"], "BLOCK_K": 256}}, ValueError, r"\['gate_up'\]\['BLOCK_K'\] must be 32, 64 or 128"),
    ({"down": {**BASE["down"], "RESCALE": 1}}, TypeError, r"`config`\['down'\]\['RESCALE'\] must be true or false"),
    ({"wgrad": {}}, ValueError, r"`config`: unknown keys \['wgrad'\]"),
    ({"down": {"BLOCK_N": 512, "num_warps": 4, "num_stages": 1}}, ValueError, r"\['down'\]\['BLOCK_N'\]"),
    ({"down": {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 1}}, ValueError,
     r"\['down'\]\['BLOCK_M'\] must be a power of two in \[16, block_m=16\]"),
    ({"quant_x": False, "gate_up": {**BASE["gate_up"], "A_TMA": True}}, ValueError,
     r"\['gate_up'\]\['A_TMA'\] needs fp8 activations from x's quantize pass"),
    ({"w8a16": True, "gate_up": {**BASE["gate_up"], "A_TMA": True}}, ValueError, r"\['gate_up'\]\['A_TMA'\] needs"),
    ({"down": {**BASE["down"], "FUSED": True}}, ValueError, r"\['down'\]: 'FUSED' is a gate_up key"),
    ({"down": {**BASE["down"], "GLUON": 1}}, TypeError, r"\['down'\]\['GLUON'\] must be true or false"),
    ({"down": {**BASE["down"], "GLUON": True}}, ValueError, r"\['down'\]\['GLUON'\] needs block_m 128"),
    ({"block_m": 128, "quant_x": False, "gate_up": {**BASE["gate_up"], "GLUON": True}}, ValueError,
     r"\['gate_up'\]\['GLUON'\] needs block_m 128 and fp8 activations"),
])
@pytest.mark.parametrize("variant", ["sm90", "reference"])
def test_bad_fp8_config_raises_naming_the_key(patch, err, match, variant):
    with pytest.raises(err, match=match):
        _run(_inputs(), {**BASE, **patch}, variant)


def test_gluon_stages_fall_back_to_the_triton_kernels_where_they_cannot_run():
    """A "GLUON" bucket off a capability 9.0 GPU (here: the interpreter) runs the Triton kernels:
    the same bits as the bucket without the key."""
    args = _inputs(seed=25)
    plain = {**BASE, "block_m": 128}
    gluon = {**plain, "gate_up": {**plain["gate_up"], "GLUON": True}, "down": {**plain["down"], "GLUON": True}}
    assert torch.equal(_run(args, gluon), _run(args, plain))


def test_sm90_fp8_gate_up_tile_is_one_quantization_group_wide():
    """h is quantized per 128 columns in the gate/up epilogue: sm90's fp8 math refuses another
    width; the reference, sm80 and a "w8a16" bucket take it."""
    args = _inputs()
    cfg = {**BASE, "gate_up": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 1}}
    with pytest.raises(ValueError, match=r"fused_experts: `config`\['gate_up'\]\['BLOCK_N'\] must be 128 on "
                                         r"variant 'sm90'"):
        _run(args, cfg, "sm90")
    want = _run(args, cfg, "sm80")
    assert torch.equal(_run(args, {**cfg, "w8a16": True}, "sm90"), want)
    assert rel(_run(args, cfg, "reference"), want) < 1e-2


def test_a_16_bit_bucket_is_refused_on_the_fp8_path():
    bucket = copy.deepcopy(cfgs.pick_config(90, 128, 2048, 768, 8))
    with pytest.raises(ValueError, match=r"fused_experts: `config`: unknown keys"):
        _run(_inputs(), bucket)


@pytest.mark.parametrize("variant", ["sm90", "sm80"])
def test_shipped_fp8_configs_are_valid_and_bucketed_by_rows_per_expert(variant):
    data = json.loads((fp8c._DIR / f"fp8_{variant}.json").read_text())
    for i, b in enumerate(data["buckets"]):
        fp8c.check_fp8_bucket(b, f"buckets[{i}]", variant)
    assert data["buckets"][-1].get("max_rows_per_expert") is None
    # a shape with no entry of its own (DeepSeek-V3's experts at another width): decode (T=1: 8/256
    # rows per expert) and prefill (T=16384: 512) take the first and the last default bucket
    small = fp8c.pick_fp8_config(variant, 256, 7168, 1536, 8)
    large = fp8c.pick_fp8_config(variant, 256, 7168, 1536, 16384 * 8)
    assert small is data["buckets"][0] or small == data["buckets"][0]
    assert large == data["buckets"][-1] and small != large
    for key, entries in data.get("shapes", {}).items():  # a swept shape: its own buckets, the last unbounded
        E, H, inter = (int(v[1:]) for v in key.split("_"))
        for i, b in enumerate(entries):
            fp8c.check_fp8_bucket(b, f"shapes[{key}][{i}]", variant)
        assert entries[-1].get("max_rows_per_expert") is None
        assert fp8c.pick_fp8_config(variant, E, H, inter, 16384 * 8) == entries[-1]
        assert fp8c.pick_fp8_config(variant, E, H, inter, 8) == entries[0]


def test_config_dir_fp8_file_and_shape_buckets(tmp_path, monkeypatch):
    mine = {**BASE, "max_rows_per_expert": None, "block_m": 32}
    shaped = {**BASE, "max_rows_per_expert": None, "block_m": 64}
    (tmp_path / "fp8_sm90.json").write_text(json.dumps({"buckets": [mine], "shapes": {"E5_H272_I144": [shaped]}}))
    monkeypatch.setenv("KERNELHUB_MOE_CONFIG_DIR", str(tmp_path))
    cfgs.clear_config_cache()
    try:
        assert fp8c.pick_fp8_config("sm90", 5, 272, 144, 18) == shaped
        assert fp8c.pick_fp8_config("sm90", 8, 272, 144, 18) == mine
        # no fp8_sm80.json there: the shipped one
        shipped = json.loads((fp8c._DIR / "fp8_sm80.json").read_text())["buckets"]
        assert fp8c.pick_fp8_config("sm80", 8, 272, 144, 18) == shipped[0]  # 2.25 rows per expert
        (tmp_path / "fp8_sm90.json").write_text(json.dumps({"buckets": [{**mine, "block_m": 20}]}))
        cfgs.clear_config_cache()
        with pytest.raises(ValueError, match=r"fp8_sm90.json: buckets\[0\]\['block_m'\]"):
            fp8c.pick_fp8_config("sm90", 8, 272, 144, 18)
    finally:
        cfgs.clear_config_cache()



@pytest.mark.parametrize(("text", "match"), [
    ('{"shapes": {}}', r"fp8_sm90.json: needs a list 'buckets'"),
    ('{"buckets": []}', r"fp8_sm90.json: needs a list 'buckets'"),
    ('[1, 2]', r"fp8_sm90.json: must hold a JSON object"),
    ('{"buckets": [BUCKET], "shapes": [BUCKET]}', r"fp8_sm90.json: 'shapes' must map"),
    ('{"buckets": [BUCKET], "shapes": {"E5_H272_I144": {}}}', r"fp8_sm90.json: 'shapes' must map"),
    ('{"buckets": [', r"fp8_sm90.json: not valid JSON"),
])
def test_malformed_fp8_config_file_raises_naming_it(tmp_path, monkeypatch, text, match):
    """A file under KERNELHUB_MOE_CONFIG_DIR is untrusted: a ValueError naming it, not a KeyError,
    IndexError or AttributeError from inside the bucket lookup."""
    (tmp_path / "fp8_sm90.json").write_text(text.replace("BUCKET", json.dumps(BASE)))
    monkeypatch.setenv("KERNELHUB_MOE_CONFIG_DIR", str(tmp_path))
    cfgs.clear_config_cache()
    try:
        with pytest.raises(ValueError, match=match):
            fp8c.pick_fp8_config("sm90", 5, 272, 144, 18)
    finally:
        cfgs.clear_config_cache()

def test_stages_fit_the_shared_memory_of_smaller_cards():
    big = {"block_m": 128, "gate_up": {"BLOCK_N": 128, "num_warps": 8, "num_stages": 4},
           "down": {"BLOCK_N": 256, "num_warps": 8, "num_stages": 4}}
    fitted = fp8c.fit_fp8_shared_memory(big, 101376, 1)  # sm89: 99 KB per block
    # gate/up: (128 + 2 * 128) * 128 B = 48 KB per stage -> 2; down: (128 + 256) * 128 -> 2
    assert fitted["gate_up"]["num_stages"] == 2 and fitted["down"]["num_stages"] == 2
    assert fp8c.fit_fp8_shared_memory(big, 232448, 1) == big  # H100: 227 KB, 4 x 48 KB fits
    assert big["gate_up"]["num_stages"] == 4  # a copy



def test_stages_fit_counts_the_whole_group_depth_of_the_in_load_quantization(tmp_path, monkeypatch):
    """"quant_x": false on sm90 quantizes x in the gate/up load, which steps whole 128-column groups
    whatever the stage's BLOCK_K says (`_gemm`): its stages are fitted at that depth, or a bucket
    that looks like it fits would not launch."""
    gate_up = {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}
    mine = {**BASE, "block_m": 64, "quant_x": False, "max_rows_per_expert": None, "gate_up": gate_up}
    (tmp_path / "fp8_sm90.json").write_text(json.dumps({"buckets": [mine]}))
    monkeypatch.setenv("KERNELHUB_MOE_CONFIG_DIR", str(tmp_path))
    cfgs.clear_config_cache()
    try:
        # 16-bit x tile plus the gate and up weight tiles, 128 deep: (64 * 2 + 2 * 128) * 128 B = 48 KB a stage
        got = fp8c.picked_fp8_config("sm90", 8, 272, 144, 18, 101376)
        assert got["gate_up"]["num_stages"] == 2
        # the W8A16 math (sm80) steps 64 as the stage says: 24 KB a stage, 4 fit
        (tmp_path / "fp8_sm80.json").write_text(json.dumps({"buckets": [mine]}))
        assert fp8c.picked_fp8_config("sm80", 8, 272, 144, 18, 101376)["gate_up"]["num_stages"] == 4
        # float32 x: 4 bytes an element, (64 * 4 + 2 * 128) * 64 B = 32 KB a stage, 3 fit
        assert fp8c.picked_fp8_config("sm80", 8, 272, 144, 18, 101376, 4)["gate_up"]["num_stages"] == 3
    finally:
        cfgs.clear_config_cache()

@pytest.fixture(scope="module")
def tune():
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "tune_moe.py"
    spec = importlib.util.spec_from_file_location("tune_moe_fp8_under_test", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the search space; runs nothing on a GPU
    return module


@pytest.mark.parametrize("w8a16", [False, True])
@pytest.mark.parametrize(("block_m", "rows_per_expert"), [(16, 0.03), (32, 2), (32, 16), (64, 32), (64, 128),
                                                          (128, 512)])
def test_every_fp8_tune_candidate_is_a_valid_bucket(tune, block_m, rows_per_expert, w8a16):
    """What `tune_moe.py --fp8` may write loads for both variants (sm90 fp8 math: 128-column gate/up
    tiles), and every candidate keeps to the register rule the sm90 compiles follow, but the full
    128-row tiles (`fp8_wide_tiles`), which are offered at block_m 128 with fp8 math only."""
    for stage in ("gate_up", "down"):
        space = tune.fp8_stage_space(stage, block_m, rows_per_expert, w8a16)
        assert space, (stage, block_m)
        wide = tune.fp8_wide_tiles(stage == "gate_up")
        assert all(c in space for c in wide) == (block_m == 128 and not w8a16), (stage, block_m, w8a16)
        for c in space:
            bucket = {"block_m": block_m, "gate_up": BASE["gate_up"], "down": BASE["down"], stage: c}
            if w8a16:
                bucket["w8a16"] = True
            fp8c.check_fp8_bucket(bucket, f"candidate {c}", "sm90")
            fp8c.check_fp8_bucket(bucket, f"candidate {c}", "sm80")
            if c in wide and block_m == 128 and not w8a16:
                continue
            rows = c.get("BLOCK_M", block_m)
            acc = rows * c["BLOCK_N"] * (2 if stage == "gate_up" else 1) // (32 * c["num_warps"])
            # fp32 accumulator elements per thread: <= 64 beside the per-K-block product, or <= 128
            # without it ("RESCALE", fp8 math only, not on 128-row gate/up tiles)
            assert acc <= (128 if c.get("RESCALE") else 64), c
            assert not c.get("RESCALE") or (not w8a16 and not (stage == "gate_up" and rows == 128)), c


@pytest.mark.skipif(tuple(int(v) for v in __import__("triton").__version__.split(".")[:2]) < (3, 7),
                    reason="compile_check.py builds ASTSource signatures in Triton 3.7's format")
def test_shipped_sm90_fp8_tiles_compile_without_spills_within_shared_memory(tmp_path):
    """tools/compile_fp8_sm90.py (ptxas through Triton AOT, no GPU): every shipped sm90 bucket, both
    stages, both 16-bit dtypes, the in-load quantization and the quantize pass."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "tools" / "compile_fp8_sm90.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0 and "over budget or failed: 0" in res.stdout, (res.stdout[-3000:], res.stderr[-3000:])
    data = json.loads((fp8c._DIR / "fp8_sm90.json").read_text())
    shipped = data["buckets"]
    swept = [b for entries in data.get("shapes", {}).values() for b in entries]
    in_load = sum(not b.get("w8a16", False) for b in shipped)  # (the default buckets' A/B variant only)
    # each decode stage's Triton kernel, its Gluon kernel where it says GLUON, and a fallback's stages
    entries = [e for b in shipped + swept for e in (b.get("decode"), (b.get("decode") or {}).get("fallback")) if e]
    decode = sum(1 + bool(e[s].get("GLUON")) for e in entries for s in ("gate_up", "down"))
    assert res.stdout.count("ok   sm90") == 4 * (len(shipped) + len(swept)) + in_load + 1 + decode, res.stdout[-2000:]


DECODE = {"max_tokens": 4, "gate_up": {"BLOCK_N": 8, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1},
          "down": {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1}}
# K steps of whole scale blocks ([BLOCK_N, 2, 128] tiles), the widths past 128 the sweep times
DECODE_WIDE = {"max_tokens": 4, "gate_up": {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 4, "num_stages": 1},
               "down": {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 4, "num_stages": 1}}


def _both_stages(decode: dict, **keys) -> dict:
    return {**decode, **{s: {**decode[s], **keys} for s in ("gate_up", "down")}}


def _prefetched(decode: dict) -> dict:
    """`decode` with both stages' loads issued one K step ahead (their last step's prefetch masked)."""
    return _both_stages(decode, PREFETCH=True)


def _staged(decode: dict, stages: int = 3) -> dict:
    """`decode` with both stages' K loops pipelined `stages` deep (cp.async into shared memory on a
    GPU; the interpreter runs the loop as written)."""
    return _both_stages(decode, LOAD_STAGES=stages)


def _pdl(decode: dict) -> dict:
    """`decode` with the down kernel launched as a programmatic dependent of gate/up (inline PTX: a
    GPU's; the interpreter runs without it)."""
    return {**decode, "down": {**decode["down"], "PDL": True}}


def _gluon(decode: dict, stages: tuple[str, ...] = ("gate_up", "down")) -> dict:
    """`decode` whose stages ask for the Gluon kernels (`_fp8_decode_gluon`: a capability 9.0 GPU's;
    the interpreter and other devices run the Triton kernels with the same tiles)."""
    return {**decode, **{s: {**decode[s], "GLUON": True} for s in stages}}


def _kernels(run) -> list[str]:
    from kernelhub.device import CachedLaunch

    with CachedLaunch.recording() as calls:
        out = run()
    return out, [c.launcher.kernel.__name__ if hasattr(c.launcher.kernel, "__name__") else c.launcher.kernel.fn.__name__
                 for c in calls]


@pytest.mark.parametrize("variant", ["sm90", "sm80"])
@pytest.mark.parametrize(("T", "H", "decode"), [(1, 200, DECODE), (3, 200, DECODE), (1, 300, DECODE_WIDE),
                                                (3, 300, DECODE_WIDE), (3, 200, _prefetched(DECODE)),
                                                (1, 300, _prefetched(DECODE_WIDE)), (3, 300, _staged(DECODE)),
                                                (3, 300, _pdl(DECODE_WIDE)),
                                                (1, 300, _pdl(_prefetched(DECODE_WIDE))),
                                                (3, 300, _gluon(DECODE_WIDE))])
def test_decode_key_runs_the_token_major_kernels_and_matches_the_float64_loop(variant, T, H, decode):
    """Two launches (no routing, no combine), W8A16 math on both variants; -1 ids dropped; H and I
    not multiples of 128: BLOCK_K 32 / 64 chunks inside one scale block, or 256 (two scale blocks
    per step: H=300's second step holds one partial block and one past H); K = 3 (padded to 4);
    PREFETCH (loads one step ahead, the step past H or I masked); LOAD_STAGES; PDL (accepted; the
    interpreter launches without it); GLUON (accepted; the interpreter runs the Triton kernel)."""
    x, guq, dq, idx, w, scales = make_fp8(T, H, 136, 6, 3, seed=31, drop=1)
    cfg = {**BASE, "decode": decode}
    out, names = _kernels(lambda: moe.fused_experts(x, guq, dq, idx, w, variant=variant, config=cfg, **scales))
    assert names == ["_fp8_decode_gate_up_kernel", "_fp8_decode_down_kernel"]
    ref = oracle(x, guq, dq, idx, w, scales)
    assert rel(out, ref) < 1e-2
    # above max_tokens: the grouped path
    x5, guq5, dq5, idx5, w5, scales5 = make_fp8(5, 200, 136, 6, 3, seed=32)
    out5, names5 = _kernels(lambda: moe.fused_experts(x5, guq5, dq5, idx5, w5, variant=variant, config=cfg,
                                                        **scales5))
    assert "_fp8_decode_gate_up_kernel" not in names5 and "_fp8_gemm_kernel" in names5
    assert out5.shape == x5.shape


@pytest.mark.parametrize(("T", "seed"), [(1, 41), (2, 42)])
def test_shipped_sm80_config_decodes_one_token_by_the_token_major_kernels(T, seed):
    """configs/fp8_sm80.json: the buckets Qwen3-30B-A3B's and DeepSeek-V3's T=1 pick hold a
    "decode" key for one token, without PDL (sm90 only), and the default buckets (other shapes:
    untimed) none; its tiles (pinned: the interpreter ignores the files) run the two decode kernels
    at T=1 and the grouped W8A16 path at T=2, both matching the float64 loop (H = 300, I = 136:
    partial scale blocks)."""
    cfg = fp8c.pick_fp8_config("sm80", 128, 2048, 768, 8)
    assert cfg["decode"]["max_tokens"] == 1 and not cfg["decode"]["down"].get("PDL", False)
    assert fp8c.pick_fp8_config("sm80", 256, 7168, 2048, 8)["decode"] == cfg["decode"]
    assert "decode" not in fp8c.pick_fp8_config("sm80", 8, 4096, 14336, 2)
    x, guq, dq, idx, w, scales = make_fp8(T, 300, 136, 6, 3, seed=seed, drop=1)
    out, names = _kernels(lambda: moe.fused_experts(x, guq, dq, idx, w, variant="sm80", config=cfg, **scales))
    assert (names == ["_fp8_decode_gate_up_kernel", "_fp8_decode_down_kernel"]) == (T == 1), names
    assert rel(out, oracle(x, guq, dq, idx, w, scales)) < 1e-2


def test_pdl_is_gpu_only():
    """PDL (inline PTX) reaches the kernels as constexprs only on a GPU: the interpreter gets it off
    (and the plain down launcher), so the same bits as without it."""
    x, guq, dq, idx, w, scales = make_fp8(2, 300, 136, 6, 3, seed=35, drop=1)
    gus, dns = scales["gate_up_proj_scale_inv"], scales["down_proj_scale_inv"]
    from kernelhub.device import CachedLaunch

    with CachedLaunch.recording() as calls:
        got = fp8x.decode_forward(x, guq, dq, idx, w, gus, dns, _pdl(DECODE_WIDE))
    assert [c.launcher for c in calls] == [fp8x._decode_gate_up_launch, fp8x._decode_down_launch]
    gate_up, down = (dict(zip(c.launcher.names[-len(c.constexprs):], c.constexprs, strict=True)) for c in calls)
    assert (gate_up["TRIGGER"], down["PDL"]) == (False, False)
    assert torch.equal(got, fp8x.decode_forward(x, guq, dq, idx, w, gus, dns, DECODE_WIDE))


@pytest.mark.parametrize(("T", "H", "inter", "K", "decode"), [
    # partial scale blocks and runs (H = 300 ends inside a 16-column run), dropped ids, K = 3 (padded to 4)
    (3, 300, 136, 3, {"max_tokens": 4, "gate_up": {"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 2, "num_stages": 1},
                      "down": {"BLOCK_N": 4, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1}}),
    # whole scale blocks per step, one run a row per lane group, rows past I
    (1, 300, 136, 3, {"max_tokens": 4, "gate_up": {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 1},
                      "down": {"BLOCK_N": 8, "BLOCK_K": 32, "num_warps": 2, "num_stages": 1}}),
    (2, 144, 80, 2, {"max_tokens": 4, "gate_up": {"BLOCK_N": 4, "BLOCK_K": 16, "num_warps": 1, "num_stages": 1},
                     "down": {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8, "num_stages": 1}}),
])
def test_gluon_decode_kernels_run_in_the_interpreter_and_match_the_float64_loop(T, H, inter, K, decode, monkeypatch):
    """The Gluon decode kernels' own source (`_gluon_interpret`: layouts dropped, which change no
    value) launched by `decode_forward` as on an sm90 GPU with both stages "GLUON": the two Gluon
    launches, matching the float64 loop at edge shapes."""
    dg = fp8x.decode_gluon
    if dg.gluon is None or not fp8x.INTERPRET:
        pytest.skip("needs triton's Gluon and the interpreter")
    from _gluon_interpret import interpreted

    from kernelhub.device import CachedLaunch

    gate_up, down = interpreted(dg._fp8_decode_gate_up_gluon_kernel), interpreted(dg._fp8_decode_down_gluon_kernel)
    launches = (CachedLaunch(gate_up), CachedLaunch(down), CachedLaunch(down))
    monkeypatch.setattr(fp8x, "_decode_gluon_launches", launches)
    monkeypatch.setattr(fp8x, "INTERPRET", False)  # (decode_forward as on a GPU; the kernels are interpreted)
    monkeypatch.setattr(dg, "applies", lambda device, w_bits: True)
    x, guq, dq, idx, w, scales = make_fp8(T, H, inter, 6, K, seed=36, drop=1)
    with CachedLaunch.recording() as calls:
        out = fp8x.decode_forward(x, guq, dq, idx, w, scales["gate_up_proj_scale_inv"],
                                  scales["down_proj_scale_inv"], _gluon(decode))
    assert [c.launcher for c in calls] == [launches[0], launches[1]]
    assert rel(out, oracle(x, guq, dq, idx, w, scales)) < 1e-2


@pytest.mark.parametrize(("gluon_runs", "fallback", "want"), [
    (False, None, ["_fp8_gemm_kernel"]),  # (sm89, the interpreter: the bucket's grouped path)
    (False, DECODE, ["_fp8_decode_gate_up_kernel", "_fp8_decode_down_kernel"]),
    (True, None, ["_fp8_decode_gate_up_gluon_kernel", "_fp8_decode_down_gluon_kernel"]),
])
def test_decode_fallback_runs_where_the_gluon_kernels_do_not(gluon_runs, fallback, want, monkeypatch):
    """An entry with GLUON stages and a "fallback": where the Gluon kernels do not run (decided from
    x's device) the fallback entry's Triton tiles, or the grouped path for null; where they run, the
    entry itself (the Gluon kernels, here run in the interpreter from their own source)."""
    from kernelhub.device import CachedLaunch

    dg = fp8x.decode_gluon
    if gluon_runs:
        if dg.gluon is None or not fp8x.INTERPRET:
            pytest.skip("needs triton's Gluon and the interpreter")
        from _gluon_interpret import interpreted

        launches = (CachedLaunch(interpreted(dg._fp8_decode_gate_up_gluon_kernel)),
                    *(CachedLaunch(interpreted(dg._fp8_decode_down_gluon_kernel)) for _ in range(2)))
        monkeypatch.setattr(fp8x, "_decode_gluon_launches", launches)
        monkeypatch.setattr(fp8x, "INTERPRET", False)  # (decode_forward as on a GPU; the kernels are interpreted)
        monkeypatch.setattr(dg, "applies", lambda device, w_bits: True)
    x, guq, dq, idx, w, scales = make_fp8(1, 200, 136, 6, 3, seed=37, drop=1)
    # the entry's own tiles (BLOCK_K 256) differ from the fallback's (32 / 64)
    cfg = {**BASE, "decode": {**_gluon(DECODE_WIDE), "fallback": fallback}}
    with CachedLaunch.recording() as calls:
        out = moe.fused_experts(x, guq, dq, idx, w, variant="sm90", config=cfg, **scales)
    names = [getattr(c.launcher.kernel, "__name__", None) or c.launcher.kernel.fn.__name__ for c in calls]
    assert [n for n in names if "decode" in n or n == "_fp8_gemm_kernel"] == (want if "decode" in want[0]
                                                                               else want * 2)
    ks = [c.constexprs.BLOCK_K for c in calls if "decode" in names[calls.index(c)]]
    assert ks == ([] if "decode" not in want[0] else [256, 256] if gluon_runs else [32, 64])
    assert rel(out, oracle(x, guq, dq, idx, w, scales)) < (1e-2 if "decode" in want[0] else 0.1)


def test_decode_ids_out_of_range_are_dropped_when_unchecked():
    x, guq, dq, idx, w, scales = make_fp8(2, 144, 80, 4, 2, seed=33)
    bad = idx.clone()
    bad[0, 1] = 9  # >= E: dropped like -1 (check_indices=False: no host sync)
    dropped = bad.clone()
    dropped[0, 1] = -1
    cfg = {**BASE, "decode": DECODE}
    got = moe.fused_experts(x, guq, dq, bad, w, variant="sm80", config=cfg, check_indices=False, **scales)
    assert torch.equal(got, moe.fused_experts(x, guq, dq, dropped, w, variant="sm80", config=cfg, **scales))


@pytest.mark.parametrize(("patch", "match"), [
    ({"max_tokens": 0}, r"\['decode'\]\['max_tokens'\] must be an int >= 1"),
    ({"gate_up": {"BLOCK_N": 8, "BLOCK_K": 384, "num_warps": 4, "num_stages": 1}},
     r"\['decode'\]\['gate_up'\]\['BLOCK_K'\] must be one of \(16, 32, 64, 128, 256, 512, 1024\)"),
    ({"down": {"BLOCK_N": 2, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1}},
     r"\['decode'\]\['down'\]\['BLOCK_N'\] must be a power of two in \[4, 256\]"),
    ({"extra": 1}, r"\['decode'\]: keys must be"),
    ({"gate_up": {"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1, "PREFETCH": 1}},
     r"\['decode'\]\['gate_up'\]\['PREFETCH'\] must be a bool"),
    ({"down": {"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1, "PREFTCH": True}},
     r"\['decode'\]\['down'\] must be a dict of BLOCK_N"),
    ({"down": {"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1, "LOAD_STAGES": 2.0}},
     r"\['decode'\]\['down'\]\['LOAD_STAGES'\] must be an int"),
    ({"gate_up": {"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1, "LOAD_STAGES": 0}},
     r"\['decode'\]\['gate_up'\]\['LOAD_STAGES'\] must be in \[1, 8\]"),
    ({"down": {"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1, "PDL": "yes"}},
     r"\['decode'\]\['down'\]\['PDL'\] must be a bool"),
    ({"gate_up": {"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1, "GLUON": 1}},
     r"\['decode'\]\['gate_up'\]\['GLUON'\] must be a bool"),
    ({"gate_up": {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1, "GLUON": True}},
     r"\['decode'\]\['gate_up'\]\['BLOCK_K'\] must be at most 512 with GLUON"),
    ({"down": {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1, "GLUON": True}},
     r"\['decode'\]\['down'\]\['BLOCK_K'\] must be at most 512 with GLUON"),
    # PDL is the down kernel's (launched behind gate/up); gate/up has no such key
    ({"gate_up": {"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1, "PDL": True}},
     r"\['decode'\]\['gate_up'\] must be a dict of BLOCK_N"),
    # a fallback: only beside GLUON stages, itself an entry without GLUON or a fallback of its own
    ({"fallback": None}, r"\['decode'\]\['fallback'\] applies where a GLUON stage's Gluon kernel does not run"),
    ({**_gluon(DECODE), "fallback": _gluon(DECODE)}, r"\['decode'\]\['fallback'\]\['gate_up'\]\['GLUON'\]: a fallback"),
    ({**_gluon(DECODE), "fallback": {**DECODE, "fallback": None}}, r"\['decode'\]\['fallback'\]: keys must be"),
    ({**_gluon(DECODE), "fallback": [DECODE]}, r"\['decode'\]\['fallback'\] must be a dict"),
    ({**_gluon(DECODE), "fallback": {**DECODE, "max_tokens": 0}}, r"\['fallback'\]\['max_tokens'\] must be an int"),
])
def test_bad_decode_key_raises_naming_it(patch, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _run(_inputs(), {**BASE, "decode": {**DECODE, **patch}})


def test_decode_weight_bits_path_equals_fp8_pointer_loads():
    """sm80 reads the fp8 weights as uint8 bits (Triton has no fp8 pointers there): exact, so the
    same output as fp8 loads, bit for bit."""
    x, guq, dq, idx, w, scales = make_fp8(2, 200, 136, 5, 3, seed=34, drop=1)
    for decode in (DECODE, DECODE_WIDE, _prefetched(DECODE_WIDE), _staged(DECODE_WIDE)):
        args = (x, guq, dq, idx, w, scales["gate_up_proj_scale_inv"], scales["down_proj_scale_inv"], decode)
        bits = fp8x.decode_forward(*args, w_bits=True)
        assert torch.equal(bits, fp8x.decode_forward(*args, w_bits=False))
        assert rel(bits, oracle(x, guq, dq, idx, w, scales)) < 1e-2


# ---- GPU: the paths a shipped config does not take at these shapes ----

LARGE = {"block_m": 128, "gate_up": {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
         "down": {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "A_TMA": True}}


@pytest.mark.gpu
@pytest.mark.parametrize(("T", "config", "quantized"), [
    (600, {**LARGE, "quant_x": False}, True),
    (600, {**LARGE, "tma": False}, True),
    (600, {**LARGE, "down": {**LARGE["down"], "A_TMA": False}}, True),
    # x quantized into row order and read by TMA, gate and up as one MMA; full 128-row tiles
    (600, {**LARGE, "gate_up": {**LARGE["gate_up"], "A_TMA": True, "FUSED": True}}, True),
    (600, {**LARGE, "gate_up": {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "RESCALE": True, "A_TMA": True,
                                "FUSED": True},
           "down": {"BLOCK_N": 256, "num_warps": 8, "num_stages": 3, "RESCALE": True, "A_TMA": True}}, True),
    (600, {**LARGE, "gate_up": {"BLOCK_N": 128, "num_warps": 16, "num_stages": 3, "A_TMA": True, "FUSED": True}}, True),
    (600, {**LARGE, "gate_up": {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "RESCALE": True, "A_TMA": True,
                                "FUSED": True, "PERSISTENT": 1},
           "down": {"BLOCK_N": 256, "num_warps": 8, "num_stages": 3, "RESCALE": True, "A_TMA": True,
                    "PERSISTENT": 2}}, True),
    (600, {**LARGE, "w8a16": True, "gate_up": {**LARGE["gate_up"], "FUSED": True}}, False),
    (600, {**LARGE, "w8a16": True, "gate_up": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}}, False),
    (4, {**BASE, "decode": DECODE}, False),
    # compiled prefetching decode kernels, at the widths the sweep times (whole scale blocks per step)
    (4, {**BASE, "decode": _prefetched(DECODE)}, False),
    (1, {**BASE, "decode": _prefetched({"max_tokens": 1, "gate_up": {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 8,
                                                                     "num_stages": 2},
                                        "down": {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4,
                                                 "num_stages": 2}})}, False),
    # K loops pipelined through shared memory (cp.async), narrow and whole-scale-block steps
    (1, {**BASE, "decode": _staged({"max_tokens": 1, "gate_up": {"BLOCK_N": 4, "BLOCK_K": 128, "num_warps": 4,
                                                                 "num_stages": 2},
                                    "down": {"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 8, "num_stages": 2}}, 4)},
     False),
    (4, {**BASE, "decode": _staged(DECODE_WIDE)}, False),
    # down as a programmatic dependent launch of gate/up (sm90), at the shipped Qwen3 T=1 tiles
    (1, {**BASE, "decode": _pdl({"max_tokens": 1, "gate_up": {"BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 8,
                                                                 "num_stages": 2},
                                    "down": {"BLOCK_N": 4, "BLOCK_K": 128, "num_warps": 8, "num_stages": 2}})},
     False),
    (4, {**BASE, "decode": _pdl(_prefetched(DECODE_WIDE))}, False),
    # PDL + PREFETCH down with a wide step: most of a program's weights loaded before its wait for h
    (1, {**BASE, "decode": {"max_tokens": 1, "gate_up": {"BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 8, "num_stages": 2},
                            "down": {"BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 8, "num_stages": 2, "PDL": True,
                                     "PREFETCH": True}}},
     False),
    # the Gluon kernels (sm90), the down one a PDL launch, at the tiles the sweep times
    (1, {**BASE, "decode": _pdl(_gluon({"max_tokens": 1, "gate_up": {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8,
                                                                     "num_stages": 2},
                                        "down": {"BLOCK_N": 4, "BLOCK_K": 128, "num_warps": 8,
                                                 "num_stages": 2}}))}, False),
    (4, {**BASE, "decode": _gluon({**DECODE_WIDE, "gate_up": {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 2,
                                                              "num_stages": 2}})}, False),
    (4, {**BASE, "decode": _gluon(DECODE, ("down",))}, False),
])
def test_gpu_sm90_pinned_paths_match_the_oracle(T, config, quantized):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need sm89+")
    x, guq, dq, idx, w, scales = make_fp8(T, 2048, 768, 16, 8, seed=40)
    ref, emu = oracle(x, guq, dq, idx, w, scales), emulation(x, guq, dq, idx, w, scales)
    dev = torch.device("cuda")
    out = moe.fused_experts(x.to(dev), guq.to(dev), dq.to(dev), idx.to(dev), w.to(dev), variant="sm90",
                            config=config, **{k: v.to(dev) for k, v in scales.items()}).cpu()
    assert rel(out, ref) <= (1.25 * rel(emu, ref) if quantized else 1e-2)


@pytest.mark.gpu
def test_gpu_pdl_down_launch_is_a_dependent_one_and_captures_in_a_cuda_graph():
    """sm90: a "PDL" down stage goes through the launcher compiled with launch_pdl (gate/up gets
    TRIGGER); PDL changes no arithmetic, so eager and a CUDA graph's replay (on new inputs copied
    in) equal the plain kernels bit for bit."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a capability 9.0 GPU")
    from kernelhub.device import CachedLaunch

    dev = torch.device("cuda")
    plain = {"max_tokens": 2, "gate_up": {"BLOCK_N": 4, "BLOCK_K": 512, "num_warps": 8, "num_stages": 2},
             "down": {"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 8, "num_stages": 2, "PREFETCH": True}}

    def inputs(seed):
        x, guq, dq, idx, w, scales = make_fp8(2, 2048, 768, 16, 8, seed=seed, drop=1)
        return [t.to(dev) for t in (x, guq, dq, idx, w, scales["gate_up_proj_scale_inv"],
                                    scales["down_proj_scale_inv"])]

    a = inputs(42)
    with CachedLaunch.recording() as calls:
        got = fp8x.decode_forward(*a, _pdl(plain))
    assert [c.launcher for c in calls] == [fp8x._decode_gate_up_launch, fp8x._decode_down_pdl_launch]
    gate_up, down = (dict(zip(c.launcher.names[-len(c.constexprs):], c.constexprs, strict=True)) for c in calls)
    assert gate_up["TRIGGER"] and down["PDL"]
    assert all(hit[0].launch_pdl for hit in fp8x._decode_down_pdl_launch.by_spec.values())
    assert torch.equal(got, fp8x.decode_forward(*a, plain))
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = fp8x.decode_forward(*a, _pdl(plain))
    b = inputs(43)
    for dst, src in zip(a, b, strict=True):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, fp8x.decode_forward(*b, plain))


@pytest.mark.gpu
@pytest.mark.parametrize(("T", "H", "inter", "gate_up"), [
    (1, 2048, 768, {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8, "num_stages": 2}),
    # partial scale blocks and runs (H = 300 ends inside a 16-column run), dropped ids, K = 3
    (3, 300, 136, {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4, "num_stages": 2}),
    (2, 300, 136, {"BLOCK_N": 4, "BLOCK_K": 32, "num_warps": 1, "num_stages": 2}),
])
def test_gpu_gluon_decode_kernels_run_match_and_capture(T, H, inter, gate_up):
    """sm90: "GLUON" stages launch the Gluon kernels (recorded like the Triton ones, so replayable;
    the down one as a PDL dependent of gate/up), match the float64 loop, and a CUDA graph of the
    call replays new inputs as an eager call computes them."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a capability 9.0 GPU")
    if fp8x.decode_gluon.gluon is None:
        pytest.skip("this triton has no Gluon")
    from kernelhub.device import CachedLaunch

    dev = torch.device("cuda")
    decode = _pdl(_gluon({"max_tokens": 4, "gate_up": gate_up,
                          "down": {"BLOCK_N": 4, "BLOCK_K": 128, "num_warps": 8, "num_stages": 2}}))
    launches = fp8x._decode_gluon_launches

    def inputs(seed):
        x, guq, dq, idx, w, scales = make_fp8(T, H, inter, 16, 3 if H == 300 else 8, seed=seed, drop=1)
        return [t.to(dev) for t in (x, guq, dq, idx, w, scales["gate_up_proj_scale_inv"],
                                    scales["down_proj_scale_inv"])], (x, guq, dq, idx, w, scales)

    a, cpu = inputs(44)
    with CachedLaunch.recording() as calls:
        got = fp8x.decode_forward(*a, decode)
    assert [c.launcher for c in calls] == [launches[0], launches[2]]
    gate_up, down = (dict(zip(c.launcher.names[-len(c.constexprs):], c.constexprs, strict=True)) for c in calls)
    assert gate_up["TRIGGER"] and down["PDL"]
    assert rel(got.cpu(), oracle(*cpu)) < 1e-2
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = fp8x.decode_forward(*a, decode)
    b, _ = inputs(45)
    for dst, src in zip(a, b, strict=True):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, fp8x.decode_forward(*b, decode))


def test_pinned_config_reaches_the_kernels_under_torch_compile():
    """The compiled path passes `config` through its custom op: a W8A16 bucket on sm90 gives the
    unquantized result there as in eager, and a bad bucket raises while tracing."""
    args = _inputs(seed=26)
    x, guq, dq, idx, w, scales = args
    cfg = {**BASE, "w8a16": True}

    def f(a, c):
        return moe.fused_experts(a, guq, dq, idx, w, variant="sm90", config=c, **scales)

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(lambda a: f(a, cfg), backend="aot_eager", fullgraph=True)(x)
        assert torch.equal(got, f(x, cfg))
        assert rel(got, oracle(*args)) < 0.25 * rel(emulation(*args), oracle(*args))
        with pytest.raises(Exception, match=r"`config`\['gate_up'\]\['BLOCK_N'\] must be 128"):
            bad = {**BASE, "gate_up": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 1}}
            torch.compile(lambda a: f(a, bad), backend="aot_eager", fullgraph=True)(x)
