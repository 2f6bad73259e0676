"""bench_fp8.py's CPU smoke mode (DEVICE=cpu, as the other benchmarks): the tiny shape by default,
not DeepSeek-V3's 11 GB of weights on the host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_fp8.py"
SRC = Path(__file__).resolve().parents[3] / "src"


def smoke(out: Path, **extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEVICE": "cpu", "OUT": str(out), "TOKENS": "1", "PEERS": "0", "COMPILE": "none",
           "PYTHONPATH": str(SRC), **extra}
    env.pop("SHAPES", None)
    run = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return run


def test_device_cpu_runs_the_tiny_shape(tmp_path):
    run = smoke(tmp_path)
    assert "fp8 tiny T=1 kernelhub_fp8:" in run.stdout
    assert "deepseek_v3" not in run.stdout


def test_rows_go_to_out_as_json_lines(tmp_path):
    """As every benchmark's: the numbers the issue asks for (ceilings of the same run, per point and
    implementation ms, fraction of the fp8 rate, of the weight-bytes bound) in $OUT/bench_fp8.jsonl."""
    smoke(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "bench_fp8.jsonl").read_text().splitlines()]
    ceiling = [r for r in rows if r["kind"] == "fp8_ceiling"]
    assert len(ceiling) == 1 and {"fp8_mm_TFLOPs", "bf16_mm_TFLOPs", "copy_GBps"} <= set(ceiling[0])
    points = {r["impl"]: r for r in rows if r["kind"] == "fp8_fwd"}
    assert {"kernelhub_fp8", "kernelhub_bf16"} <= set(points)
    for r in points.values():
        assert (r["shape"], r["T"]) == ("tiny", 1)
        assert r["ms"] > 0 and r["frac_fp8_rate"] >= 0 and r["frac_bw"] >= 0 and r["relerr"] < 0.1
        H, I, K = 256, 128, 2  # the tiny shape (T=1): useful FLOPs 2 * T * K * 3 * H * I
        assert abs(r["TFLOPs"] - 2 * K * 3 * H * I / (r["ms"] * 1e-3) / 1e12) <= 1e-6 * r["TFLOPs"]
        assert abs(r["frac_fp8_rate"] - r["TFLOPs"] / ceiling[0]["fp8_mm_TFLOPs"]) <= 1e-6 * r["frac_fp8_rate"]


def test_the_torch_peer_is_also_timed_compiled_and_its_failure_does_not_end_the_run(tmp_path):
    """torch._scaled_grouped_mm's path under torch.compile (default and reduce-overhead) is a peer
    configuration of its own; here (no CPU kernel for the op) each is skipped with its reason."""
    run = smoke(tmp_path, PEERS="1", COMPILE="default,reduce-overhead")
    for config in ("compiled", "reduce-overhead"):
        assert f"skip torch_scaled_grouped_mm[{config}]: NotImplementedError" in run.stdout
    assert "fp8 tiny T=1 summary" in run.stdout
    none = smoke(tmp_path, PEERS="1", COMPILE="none")
    assert "torch_scaled_grouped_mm[" not in none.stdout


def test_kernelhub_is_also_timed_compiled_against_its_eager_call(tmp_path):
    """kernelhub's fp8 call under torch.compile (fullgraph: its custom op) is a row of its own, with
    its error against the bf16 path like the eager row's, and the summary says compiled / eager."""
    run = smoke(tmp_path, COMPILE="default")
    rows = [json.loads(line) for line in (tmp_path / "bench_fp8.jsonl").read_text().splitlines()]
    points = {r["impl"]: r for r in rows if r["kind"] == "fp8_fwd"}
    assert "kernelhub_fp8[compiled]" in points, run.stdout[-2000:]
    assert abs(points["kernelhub_fp8[compiled]"]["relerr"] - points["kernelhub_fp8"]["relerr"]) < 1e-3
    summary = [r for r in rows if r["kind"] == "fp8_summary"]
    assert len(summary) == 1 and set(summary[0]["compiled_over_eager"]) == {"compiled"}
    assert "compiled / eager" in run.stdout
    summarize = Path(__file__).resolve().parents[3] / "benchmarks" / "summarize.py"
    table = subprocess.run([sys.executable, str(summarize), "fp8", str(tmp_path / "bench_fp8.jsonl")],
                           capture_output=True, text=True, timeout=60).stdout
    row = next(line for line in table.splitlines() if line.startswith("| tiny | 1 |"))
    compiled_ms = points["kernelhub_fp8[compiled]"]["ms"]
    assert row.split(" | ")[5] == f"{compiled_ms:.4f}, -", row  # (reduce-overhead not asked for)


def test_summarize_fp8_table(tmp_path):
    smoke(tmp_path)
    summarize = Path(__file__).resolve().parents[3] / "benchmarks" / "summarize.py"
    run = subprocess.run([sys.executable, str(summarize), "fp8", str(tmp_path / "bench_fp8.jsonl")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| tiny | 1 |")]
    assert len(rows) == 1 and rows[0].count("|") == 13


def test_torch_peer_has_no_data_dependent_shapes():
    """The torch._scaled_grouped_mm peer runs under FakeTensorMode: no op whose output size depends
    on the data (bincount's would be a host sync on CUDA and no CUDA graph under reduce-overhead)."""
    import importlib.util

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = importlib.util.spec_from_file_location("bench_fp8_under_test", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    E, H, I, T, K = 4, 256, 128, 8, 2
    with FakeTensorMode():
        gu_t, gu_s = bench.rowwise_weights(torch.randn(E, 2 * I, H, dtype=torch.bfloat16))
        dn_t, dn_s = bench.rowwise_weights(torch.randn(E, H, I, dtype=torch.bfloat16))
        x = torch.randn(T, H, dtype=torch.bfloat16)
        idx = torch.randint(0, E, (T, K))
        out = bench.scaled_grouped_forward(x, gu_t, gu_s, dn_t, dn_s, idx, torch.rand(T, K))
    assert out.shape == (T, H)
