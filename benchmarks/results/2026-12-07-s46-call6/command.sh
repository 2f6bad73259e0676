bash benchmarks/gpu_run.sh comphost slice   # at d80e045 (diag with the trivial-op rows), H100 80GB
