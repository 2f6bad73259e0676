bash benchmarks/gpu_run.sh comphost   # at the diag commit, H100 80GB (call 4 got no machine)
