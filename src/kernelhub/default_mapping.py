"""The mapping kernelhub registers at import: the bundled kernel repositories, per capability."""

from __future__ import annotations

from pathlib import Path

from kernelhub.device import CUDAProperties, Device
from kernelhub.hub import LocalLayerRepository

__all__ = ["bundled_kernels_dir", "default_kernel_mapping"]

# Triton sm90 kernels (tensor descriptors, wgmma through Triton) also run on later generations;
# sm80 code covers Ampere and Ada.
SM90_AND_LATER = CUDAProperties(90, 129)
SM80_TO_SM89 = CUDAProperties(80, 89)


def bundled_kernels_dir() -> Path:
    """`kernels_repo/` shipped in the wheel, or the source checkout's copy in an editable install."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels_repo", here.parents[1] / "kernels_repo"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"bundled kernels_repo not found next to {here}")


def _variants(repo: Path, layer: str) -> dict[Device, LocalLayerRepository]:
    return {
        Device("cuda", properties=SM90_AND_LATER): LocalLayerRepository(repo, layer_name=f"{layer}Sm90"),
        Device("cuda", properties=SM80_TO_SM89): LocalLayerRepository(repo, layer_name=f"{layer}Sm80"),
        Device("cpu"): LocalLayerRepository(repo, layer_name=f"{layer}Reference"),
    }


def default_kernel_mapping() -> dict:
    root = bundled_kernels_dir()
    return {
        "SwiGLUMLP": _variants(root / "swiglu", "SwiGLUMLP"),
        "SiluAndMul": _variants(root / "swiglu", "SiluAndMul"),
        "MoEExperts": _variants(root / "moe", "MoEExperts"),
    }
