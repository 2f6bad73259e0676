bash benchmarks/gpu_run.sh comphost   # at da2d53a (tools/diag_compiled_host.py before its trivial-op rows), H100 80GB; call 4 got no machine
