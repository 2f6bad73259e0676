"""bench_swiglu.py's timing sections on the CPU: a peer that fails (a compile error, say) is
recorded as an error row and the others are still timed, instead of ending the run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_swiglu.py"


@pytest.fixture
def bench(monkeypatch, tmp_path):
    monkeypatch.setenv("DEVICE", "cpu")
    monkeypatch.setenv("OUT", str(tmp_path))
    spec = importlib.util.spec_from_file_location("bench_swiglu_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # (module level only: runs no benchmark)
    return module


def _impls():
    def broken(g, u):
        raise RuntimeError("peer cannot run here")

    return {"eager": lambda g, u: F.silu(g) * u, "liger[compiled]": broken}


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "swiglu_bench.jsonl").read_text().splitlines()]


def test_host_overhead_survives_a_failing_peer(bench, tmp_path):
    bench.host_overhead(_impls())
    rows = _rows(tmp_path)
    assert {(r["impl"], r["pass_"]) for r in rows if r["kind"] == "host_overhead"} == {("eager", "fwd"),
                                                                                    ("eager", "fwdbwd")}
    errors = [r for r in rows if r["kind"] == "error"]
    assert {r["impl"] for r in errors} == {"liger[compiled]"} and "peer cannot run here" in errors[0]["error"]


def test_interleaved_survives_a_failing_peer(bench, tmp_path):
    bench.interleaved_eager(_impls(), [(8, 16)], 2, copy_bw=1e9)
    rows = _rows(tmp_path)
    timed = {(r["impl"], r["pass_"]) for r in rows if r["kind"] == "swiglu_interleaved"}
    assert timed == {("eager", "fwd"), ("eager", "fwdbwd")}
    assert all(torch.isfinite(torch.tensor(r["eager_us"])) for r in rows if r["kind"] == "swiglu_interleaved")
    assert {r["impl"] for r in rows if r["kind"] == "error"} == {"liger[compiled]"}
