NCU_TIMEOUT=240 NCU_LINES=200 bash benchmarks/gpu_run.sh ncudecode   # (wheels from .whl/ installed first, as gpu_run.sh does)
