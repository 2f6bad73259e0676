from pathlib import Path

import pytest
import torch

from kernelhub import (
    CUDAProperties,
    Device,
    LocalLayerRepository,
    Mode,
    register_kernel_mapping,
    registry,
    use_kernel_mapping,
)
from kernelhub.registry import get_kernel_mapping, resolve_repository

TOY = Path(__file__).parent / "fixtures" / "kernels" / "toy_mlp"


@pytest.fixture(autouse=True)
def _restore_global_mapping(monkeypatch):
    """register_kernel_mapping also writes the process-wide mapping (as kernels does), even inside a
    use_kernel_mapping block: put it back so that the toy layers do not reach later test modules."""
    monkeypatch.setattr(registry, "_GLOBAL_MAPPING", registry._GLOBAL_MAPPING)


def repo(layer: str) -> LocalLayerRepository:
    return LocalLayerRepository(TOY, layer_name=layer)


def resolved_layer(device: str, capability, mode=Mode.INFERENCE) -> str | None:
    r = resolve_repository("SwiGLUMLP", torch.device(device), capability, mode)
    return None if r.repository is None else r.repository.layer_name


def test_narrowest_capability_range_wins():
    mapping = {
        "SwiGLUMLP": {
            Device("cuda", properties=CUDAProperties(80, 120)): repo("ToyMLPSm80"),
            Device("cuda", properties=CUDAProperties(90, 90)): repo("ToyMLPSm90"),
            Device("cuda"): repo("ToyMLPCpu"),
        }
    }
    with use_kernel_mapping(mapping, inherit_mapping=False):
        assert resolved_layer("cuda:0", 90) == "ToyMLPSm90"
        assert resolved_layer("cuda:0", 86) == "ToyMLPSm80"
        assert resolved_layer("cuda:0", 75) == "ToyMLPCpu"


def test_index_entry_beats_index_agnostic_entry():
    mapping = {
        "SwiGLUMLP": {
            Device("cuda", properties=CUDAProperties(90, 90)): repo("ToyMLPSm90"),
            Device("cuda", 1): repo("ToyMLPIndex1"),
        }
    }
    with use_kernel_mapping(mapping, inherit_mapping=False):
        assert resolved_layer("cuda:1", 90) == "ToyMLPIndex1"
        assert resolved_layer("cuda:0", 90) == "ToyMLPSm90"


def test_mode_priority_follows_hf_kernels():
    mapping = {
        "SwiGLUMLP": {
            "cuda": {Mode.TRAINING: repo("ToyMLPSm80"), Mode.FALLBACK: repo("ToyMLPCpu")},
        }
    }
    with use_kernel_mapping(mapping, inherit_mapping=False):
        # INFERENCE may use a TRAINING kernel (it has a backward, so it also runs forward).
        assert resolved_layer("cuda:0", 90, Mode.INFERENCE) == "ToyMLPSm80"
        assert resolved_layer("cuda:0", 90, Mode.TRAINING) == "ToyMLPSm80"
        # TRAINING | TORCH_COMPILE must not take a plain TRAINING kernel.
        assert resolved_layer("cuda:0", 90, Mode.TRAINING | Mode.TORCH_COMPILE) == "ToyMLPCpu"


def test_no_entry_gives_a_reason():
    with use_kernel_mapping({"SwiGLUMLP": {"cpu": repo("ToyMLPCpu")}}, inherit_mapping=False):
        r = resolve_repository("SwiGLUMLP", torch.device("cuda", 0), 80, Mode.INFERENCE)
        assert r.repository is None and "cuda:0" in r.reason and "80" in r.reason
        r = resolve_repository("Other", torch.device("cpu"), None, Mode.INFERENCE)
        assert "no kernel mapping for layer 'Other'" in r.reason


def test_register_merges_per_layer_device_and_mode():
    with use_kernel_mapping({}, inherit_mapping=False):
        register_kernel_mapping({"SwiGLUMLP": {"cuda": {Mode.INFERENCE: repo("ToyMLPSm80")}}})
        register_kernel_mapping({"SwiGLUMLP": {"cuda": {Mode.TRAINING: repo("ToyMLPSm90")}}})
        register_kernel_mapping({"SwiGLUMLP": {"cpu": repo("ToyMLPCpu")}})
        m = get_kernel_mapping()["SwiGLUMLP"]
        assert set(m[Device("cuda")]) == {Mode.INFERENCE, Mode.TRAINING}
        assert m[Device("cpu")][Mode.FALLBACK].layer_name == "ToyMLPCpu"


def test_use_kernel_mapping_restores_previous_mapping():
    before = get_kernel_mapping()
    with use_kernel_mapping({"Extra": {"cpu": repo("ToyMLPCpu")}}):
        assert "Extra" in get_kernel_mapping()
    assert get_kernel_mapping() == before


def test_global_mapping_is_seen_from_other_threads():
    import threading

    seen = []
    t = threading.Thread(target=lambda: seen.append("SwiGLUMLP" in get_kernel_mapping()))
    t.start()
    t.join()
    assert seen == [True]


@pytest.mark.parametrize(
    "value",
    ["kernels-community/swiglu", 42, {Mode.INFERENCE: "not a repo"}],
)
def test_mapping_value_must_be_a_repository(value):
    with pytest.raises(TypeError, match="repository"):
        register_kernel_mapping({"SwiGLUMLP": {"cuda": value}})


def test_mapping_device_key_must_be_a_device():
    with pytest.raises(ValueError, match="device key"):
        register_kernel_mapping({"SwiGLUMLP": {"gpu0": repo("ToyMLPCpu")}})
    with pytest.raises(TypeError, match="device key"):
        register_kernel_mapping({"SwiGLUMLP": {3: repo("ToyMLPCpu")}})
    with pytest.raises(ValueError, match="device key 'rocm:x'"):
        register_kernel_mapping({"SwiGLUMLP": {"rocm:x": repo("ToyMLPCpu")}})


def test_rocm_and_npu_string_keys_as_in_hf_kernels():
    with use_kernel_mapping({"SwiGLUMLP": {"rocm": repo("ToyMLPSm90"), "npu:1": repo("ToyMLPCpu")}},
                            inherit_mapping=False):
        mapping = get_kernel_mapping()["SwiGLUMLP"]
    assert set(mapping) == {Device("rocm"), Device("npu", 1)}
