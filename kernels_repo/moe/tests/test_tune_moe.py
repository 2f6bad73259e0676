"""The tuning script's search space: every candidate it can write into configs/ must load."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "tune_moe.py"


@pytest.fixture(scope="module")
def tune():
    spec = importlib.util.spec_from_file_location("tune_moe_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the search space; runs nothing on a GPU
    return module


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("rows_per_expert", [1, 16, 256, 4096])
def test_every_gemm_candidate_is_a_valid_stage(tune, full, rows_per_expert):
    space = list(tune.gemm_space(full, rows_per_expert))
    assert space
    wgrad = next(tune.wgrad_space(False, True))
    for c in space:
        for stage in ("gate_up", "down", "dgrad"):
            tune.cfgs.check_bucket({"block_m": 64, "gate_up": space[0], "down": space[0], "dgrad": space[0],
                                    "wgrad": wgrad, stage: c}, f"candidate {c}")
    # the register-capped tile shipped for sm90's dgrad at block_m=128 is searched from 64 rows up
    assert any(c.get("maxnreg") == 128 for c in space) == (rows_per_expert > 32)


@pytest.mark.parametrize("pair", [False, True])
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("rows_per_expert", [16, 256])
def test_down_candidates_read_h_by_tma_from_persistent_programs_on_sm90(tune, rows_per_expert, tma, pair):
    """The down tile's space adds "A_TMA" + "PERSISTENT" variants on sm90 (tma) above 32 rows per
    expert; every candidate loads, with or without pair_m."""
    wgrad = next(tune.wgrad_space(False, True))
    base = next(tune.gemm_space(False, rows_per_expert))
    for stage in ("gate_up", "down", "dgrad"):
        space = tune.stage_space(stage, False, rows_per_expert, tma)
        persistent = [c for c in space if c.get("PERSISTENT")]
        assert bool(persistent) == (stage == "down" and tma and rows_per_expert > 32)
        assert all(c.get("A_TMA") and c["BLOCK_N"] >= 128 for c in persistent)
        for c in space:
            bucket = {"block_m": 64, "gate_up": base, "down": base, "dgrad": base, "wgrad": wgrad, stage: c}
            if pair:
                bucket["pair_m"] = True
            tune.cfgs.check_bucket(bucket, f"candidate {c}")


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("tma", [False, True])
def test_every_wgrad_candidate_is_a_valid_stage(tune, full, tma):
    space = list(tune.wgrad_space(full, tma))
    gemm = next(tune.gemm_space(False, 256))
    for c in space:
        tune.cfgs.check_bucket({"block_m": 64, "gate_up": gemm, "down": gemm, "dgrad": gemm, "wgrad": c},
                               f"candidate {c}")
    assert {c.get("ROWS_PARTS") for c in space if c.get("ROWS")} >= {1, 2, 4}
    assert any(c.get("TMA_STORE") for c in space) == tma
