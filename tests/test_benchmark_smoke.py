"""The benchmark scripts run end to end on the CPU (their DEVICE=cpu / tiny-shape modes).

Why: GPU time is scarce and a benchmark that fails on the GPU machine wastes it. These runs go
through the same code as a GPU run (every configuration, compiled and reduce-overhead included)
at tiny shapes, and check that each configuration wrote its row and that kernelhub's rows agree
with the reference. Timings on the CPU mean nothing and are not checked.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, out: Path, **env: str) -> str:
    full = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OUT": str(out), **env}
    res = subprocess.run([sys.executable, str(ROOT / script)], capture_output=True, text=True, timeout=600,
                         env=full, cwd=ROOT)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    return res.stdout


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_bench_moe_times_every_configuration(tmp_path):
    _run("kernels_repo/moe/benchmarks/bench_moe.py", tmp_path, DEVICE="cpu", TOKENS="1", MODES="fwd,fwdbwd")
    rows = [r for r in _rows(tmp_path / "bench_moe.jsonl") if r["kind"] in ("moe_fwd", "moe_fwdbwd")]
    seen = {(r["kind"], r["impl"]) for r in rows}
    for kind in ("moe_fwd", "moe_fwdbwd"):
        for impl in ("kernelhub", "kernelhub[compiled]", "kernelhub[reduce-overhead]", "hf_grouped_mm",
                     "hf_grouped_mm[compiled]", "hf_grouped_mm[reduce-overhead]"):
            assert (kind, impl) in seen, (kind, impl, sorted(seen))
    for r in rows:
        assert r["recompiles"] == 0, r
        if r["kind"] == "moe_fwd" and r.get("relerr") is not None:
            assert r["relerr"] < 2e-2, r


def test_bench_moe_order_compiled_first_times_compiled_before_eager(tmp_path):
    """ORDER=compiled-first: a point's compiled configurations are timed before its eager call (the
    A/B that tells a compiled/eager gap from the card's drift within a point)."""
    _run("kernels_repo/moe/benchmarks/bench_moe.py", tmp_path, DEVICE="cpu", TOKENS="1", MODES="fwd",
         IMPLS="kernelhub", COMPILE="default", STAGES="0", ORDER="compiled-first")
    impls = [r["impl"] for r in _rows(tmp_path / "bench_moe.jsonl") if r["kind"] == "moe_fwd"]
    assert impls.index("kernelhub[compiled]") < impls.index("kernelhub"), impls


def test_bench_model_slice_times_every_configuration(tmp_path):
    _run("benchmarks/bench_model_slice.py", tmp_path, DEVICE="cpu", TOKENS="1")
    rows = _rows(tmp_path / "bench_model_slice.jsonl")
    assert {r["model"] for r in rows if r["kind"] == "slice_model"} == {"qwen3_30b_a3b", "deepseek_v3"}
    timed = [r for r in rows if r["kind"] == "slice_fwd"]
    for model in ("qwen3_30b_a3b", "deepseek_v3"):
        impls = {r["impl"] for r in timed if r["model"] == model}
        assert {"kernelhub", "kernelhub[compiled]", "kernelhub[reduce-overhead]", "hf_grouped_mm",
                "hf_grouped_mm[compiled]"} <= impls, impls
    moe_layers = {"qwen3_30b_a3b": 2, "deepseek_v3": 1}  # DeepSeek-V3's slice: a dense layer, then MoE
    for r in timed:
        assert r["recompiles"] == 0, r
        if r["base"] == "kernelhub":  # against hf_grouped_mm eager: two bf16 layers, random routing
            assert r["relerr"] is not None and r["relerr"] < 5e-2, r
        # fused_experts bodies per forward: one per MoE layer for kernelhub (no CUDA graphs on a CPU;
        # no replays: they are CUDA-only), none for transformers' own experts
        bodies = moe_layers[r["model"]] if r["base"] == "kernelhub" else 0
        assert (r["moe_bodies_per_forward"], r["moe_replays_per_forward"]) == (bodies, 0), r


def test_bench_swiglu_times_every_configuration(tmp_path):
    _run("kernels_repo/swiglu/benchmarks/bench_swiglu.py", tmp_path, DEVICE="cpu", ROUNDS="2", SHAPES="8x128")
    impls = {r.get("impl") for r in _rows(tmp_path / "swiglu_bench.jsonl") if r["kind"] == "swiglu"}
    assert {"ours", "ours[compiled]", "ours[reduce-overhead]", "eager", "compile",
            "compile[reduce-overhead]"} <= impls, impls


def test_bench_fp8_runs_and_says_why_a_peer_is_skipped(tmp_path):
    out = _run("kernels_repo/moe/benchmarks/bench_fp8.py", tmp_path, TRITON_INTERPRET="1", SHAPES="tiny",
               TOKENS="1,3")
    assert "fp8 tiny T=3 kernelhub_fp8:" in out and "fp8 tiny T=3 summary:" in out, out[-2000:]
    relerr = [float(line.rsplit("relerr", 1)[1]) for line in out.splitlines() if "kernelhub_fp8:" in line]
    assert relerr and all(e < 6e-2 for e in relerr), out[-2000:]  # activation rounding: ~4-5% on random data
    # no peer runs on a CPU here (no _scaled_grouped_mm, no Hub kernel offline): each one says why
    assert out.count("skip ") >= 1, out[-2000:]



def _tool(*args: str) -> None:
    res = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-2000:])


def test_config_tools_write_valid_configs(tmp_path):
    """tools/gluon_sm90_config.py (GLUON on every block_m-128 bucket, nothing else) and
    tools/merge_fp8_decode.py (a sweep's decode key on the shipped shape's first bucket, the other
    buckets as shipped) write files the config checks accept."""
    sys.path.insert(0, str(ROOT / "src"))
    from kernelhub._loader import load_kernel_from_dir

    moe = load_kernel_from_dir(ROOT / "kernels_repo" / "moe")
    cfgs = importlib.import_module(moe.__name__ + "._experts_configs")
    fp8c = importlib.import_module(moe.__name__ + "._fp8_configs")
    configs = ROOT / "kernels_repo" / "moe" / "torch-ext" / "moe" / "configs"

    _tool("tools/gluon_sm90_config.py", str(tmp_path / "gl" / "sm90.json"), "--group-m", "4")
    shipped, got = (json.loads(p.read_text()) for p in (configs / "sm90.json", tmp_path / "gl" / "sm90.json"))
    pairs = list(zip(shipped["buckets"] + [b for bs in shipped["shapes"].values() for b in bs],
                     got["buckets"] + [b for bs in got["shapes"].values() for b in bs]))
    assert any(a["block_m"] == 128 for a, _ in pairs)
    for a, b in pairs:
        cfgs.check_bucket(b, "gluon config")
        for stage in ("gate_up", "down"):
            want = {**a[stage], "GLUON": True, "GROUP_M": 4} if a["block_m"] == 128 else a[stage]
            assert b[stage] == want
        assert {k: v for k, v in b.items() if k not in ("gate_up", "down")} == \
            {k: v for k, v in a.items() if k not in ("gate_up", "down")}

    fp8 = json.loads((configs / "fp8_sm90.json").read_text())
    key, other = sorted(fp8["shapes"])[:2]
    decode = {"max_tokens": 8, "gate_up": {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 2,
                                           "GLUON": True},
              "down": {"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2}}
    small = {**decode, "max_tokens": 1}
    no_decode = {k: v for k, v in fp8["shapes"][other][0].items() if k != "decode"}  # (the grouped path won)
    tuned = {"shapes": {key: [{**fp8["shapes"][key][0], "decode": small}, {**fp8["shapes"][key][0], "decode": decode}],
                        other: [no_decode]}}
    (tmp_path / "tuned.json").write_text(json.dumps(tuned))
    _tool("tools/merge_fp8_decode.py", str(tmp_path / "tuned.json"), str(tmp_path / "out"))
    merged = json.loads((tmp_path / "out" / "fp8_sm90.json").read_text())
    want = json.loads((configs / "fp8_sm90.json").read_text())
    # a GLUON entry keeps the shipped entry's fallback (what sm89 runs; the sweep times sm90 only)
    assert "fallback" in want["shapes"][key][0]["decode"]
    want["shapes"][key][0]["decode"] = {**decode, "fallback": want["shapes"][key][0]["decode"]["fallback"]}
    want["shapes"][other][0].pop("decode", None)
    assert merged == want
    for name, buckets in merged["shapes"].items():
        for i, b in enumerate(buckets):
            fp8c.check_fp8_bucket(b, f"{name}[{i}]", "sm90")

    # a 16-bit sweep (DECODE_ONLY=1, sm90.json): merged into sm90.json; a shape the file has no
    # entry for gets the default buckets, the key on the first
    bf16 = json.loads((configs / "sm90.json").read_text())
    plain = {**decode, "gate_up": {k: v for k, v in decode["gate_up"].items() if k != "GLUON"}}  # (fp8's key)
    staged = {s: {**plain[s], "LOAD_STAGES": 3} for s in ("gate_up", "down")}
    tuned = {"shapes": {"E256_H7168_I2048": [{**bf16["buckets"][0], "decode": {**plain, **staged}}]}}
    (tmp_path / "bf16").mkdir()
    (tmp_path / "bf16" / "sm90.json").write_text(json.dumps(tuned))
    _tool("tools/merge_fp8_decode.py", str(tmp_path / "bf16" / "sm90.json"), str(tmp_path / "out"))
    merged = json.loads((tmp_path / "out" / "sm90.json").read_text())
    want = {**bf16, "shapes": {**bf16["shapes"], "E256_H7168_I2048": json.loads(json.dumps(bf16["buckets"]))}}
    want["shapes"]["E256_H7168_I2048"][0]["decode"] = {**plain, **staged}
    assert merged == want
    for i, b in enumerate(merged["shapes"]["E256_H7168_I2048"]):
        cfgs.check_bucket(b, f"E256_H7168_I2048[{i}]")
