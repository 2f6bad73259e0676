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


def _variants(
    repo: Path, layer: str, *, sm90_range: CUDAProperties, sm90_layer: str = "Sm90"
) -> dict[Device, LocalLayerRepository]:
    variants = {
        Device("cuda", properties=sm90_range): LocalLayerRepository(repo, layer_name=f"{layer}{sm90_layer}"),
        Device("cuda", properties=SM80_TO_SM89): LocalLayerRepository(repo, layer_name=f"{layer}Sm80"),
        Device("cpu"): LocalLayerRepository(repo, layer_name=f"{layer}Reference"),
    }
    if sm90_range != SM90_AND_LATER:
        variants[Device("cuda", properties=SM100_AND_LATER)] = LocalLayerRepository(repo, layer_name=f"{layer}Sm80")
    return variants


def default_kernel_mapping() -> dict:
    root = bundled_kernels_dir()
    return {
        # SwiGLU on sm90+: the sm80 (one tile per program) kernels, measured faster on an H200 than
        # the persistent sm90 ones (0.97-0.98 vs 0.88-0.89 of copy bandwidth, docs/performance.md);
        # pin layer SwiGLUMLPSm90 in config to use those.
        "SwiGLUMLP": _variants(root / "swiglu", "SwiGLUMLP", sm90_range=SM90_AND_LATER, sm90_layer="Sm80"),
        "SiluAndMul": _variants(root / "swiglu", "SiluAndMul", sm90_range=SM90_AND_LATER, sm90_layer="Sm80"),
        # The sm90 grouped GEMM's TMA tiles are sized for Hopper's shared memory and untested on
        # Blackwell, so sm100+ gets the pointer-load kernels until they are measured there.
        "MoEExperts": _variants(root / "moe", "MoEExperts", sm90_range=SM90_ONLY),
    }
