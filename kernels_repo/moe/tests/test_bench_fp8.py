"""bench_fp8.py's CPU smoke mode (DEVICE=cpu, as the other benchmarks): the tiny shape by default,
not DeepSeek-V3's 11 GB of weights on the host."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_fp8.py"
SRC = Path(__file__).resolve().parents[3] / "src"


def test_device_cpu_runs_the_tiny_shape(tmp_path):
    env = {**os.environ, "DEVICE": "cpu", "OUT": str(tmp_path), "TOKENS": "1", "PEERS": "0",
           "PYTHONPATH": str(SRC)}
    env.pop("SHAPES", None)
    run = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "fp8 tiny T=1 kernelhub_fp8:" in run.stdout
    assert "deepseek_v3" not in run.stdout
