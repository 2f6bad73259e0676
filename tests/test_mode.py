import pytest

from kernelhub import Mode


def test_inference_and_training_exclude_each_other():
    with pytest.raises(ValueError, match="INFERENCE and TRAINING"):
        Mode.INFERENCE | Mode.TRAINING


def test_fallback_stands_alone():
    with pytest.raises(ValueError, match="FALLBACK"):
        Mode.FALLBACK | Mode.TORCH_COMPILE


def test_torch_compile_combines():
    m = Mode.TRAINING | Mode.TORCH_COMPILE
    assert Mode.TRAINING in m and Mode.TORCH_COMPILE in m
