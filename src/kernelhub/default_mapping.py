"""The mapping kernelhub registers at import: the bundled kernel repositories, per capability."""

from __future__ import annotations

from pathlib import Path

from kernelhub.device import CUDAProperties, Device
from kernelhub.hub import LocalLayerRepository

__all__ = ["bundled_kernels_dir", "default_kernel_mapping"]

SM80_TO_SM89 = CUDAProperties(80, 89)  # Ampere, Ada
SM90_AND_LATER = CUDAProperties(90, 129)
SM90_ONLY = CUDAProperties(90, 99)
SM100_AND_LATER = CUDAProperties(100, 129)


def bundled_kernels_dir() -> Path:
    """`kernels_repo/` shipped in the wheel, or the source checkout's copy in an editable install."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels_repo", here.parents[1] / "kernels_repo"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"bundled kernels_repo not found next to {here}")


def _variants(repo: Path, layer: str, *, sm90_range: CUDAProperties) -> dict[Device, LocalLayerRepository]:
    variants = {
        Device("cuda", properties=sm90_range): LocalLayerRepository(repo, layer_name=f"{layer}Sm90"),
        Device("cuda", properties=SM80_TO_SM89): LocalLayerRepository(repo, layer_name=f"{layer}Sm80"),
        Device("cpu"): LocalLayerRepository(repo, layer_name=f"{layer}Reference"),
    }
    if sm90_range != SM90_AND_LATER:
        variants[Device("cuda", properties=SM100_AND_LATER)] = LocalLayerRepository(repo, layer_name=f"{layer}Sm80")
    return variants


def default_kernel_mapping() -> dict:
    root = bundled_kernels_dir()
    return {
        # Elementwise sm90 kernels (persistent grid, wide vectors) suit every later generation too.
        "SwiGLUMLP": _variants(root / "swiglu", "SwiGLUMLP", sm90_range=SM90_AND_LATER),
        "SiluAndMul": _variants(root / "swiglu", "SiluAndMul", sm90_range=SM90_AND_LATER),
        # The sm90 grouped GEMM's TMA tiles are sized for Hopper's shared memory and untested on
        # Blackwell, so sm100+ gets the pointer-load kernels until they are measured there.
        "MoEExperts": _variants(root / "moe", "MoEExperts", sm90_range=SM90_ONLY),
    }
