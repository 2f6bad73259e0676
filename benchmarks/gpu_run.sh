#!/usr/bin/env bash
# One run on a GPU machine, from the repository root: versions, GPU tests, the demo, then the benchmarks.
# Usage: bash benchmarks/gpu_run.sh [tests] [demo] [swiglu] [routing] [moe] [slice] [fp8] [tune] [cfgab] [dirab] [decodeab]
#   diagnostics (scripts in tools/): [tiles] [profile] [moehost] [diag] [compdiag] [fp8diag] [comphost] [graphdiag] [ncudecode] [decodescale] [sweep] [persist] [moeprof] [flatcheck] [ncu] [pairab]
# Env: OUT (logs and JSON lines; default /tmp/kernelhub-out), GPU_TESTS (pytest paths for `tests`), GPU_K (its -k
# expression), CFG_A, CFG_B, AB_ROUNDS=2 (cfgab), MOE_OLD (dirab), TESTS_TIMEOUT, MOE_TIMEOUT, SWEEP_TIMEOUT,
# PERSIST_TIMEOUT, TUNE_TIMEOUT, TUNE_ARGS, and the benchmarks' own (SHAPES, TOKENS, IMPLS, MODES, COMPILE...).
# Compiled peers: `swiglu`, `moe` and `slice` time every configuration eager and under torch.compile (default
# and reduce-overhead; COMPILE=none: eager only). moe: one process per shape (SHAPES, default all three) with
# TOKENS (default 1,4096,16384), each under MOE_TIMEOUT (default 160 s), then the table of $OUT/bench_moe.jsonl.
# slice: bench_model_slice.py, one process per model (SLICE_MODELS, default qwen3_30b_a3b,deepseek_v3) at
# SLICE_TOKENS (default 1,4096), each under SLICE_TIMEOUT (default 230 s). swiglu: SWIGLU_TIMEOUT (450 s).
# fp8: bench_fp8.py (issue 31), one process per shape (FP8_SHAPES, default deepseek_v3,qwen3_30b_a3b) at
# FP8_TOKENS (default 1,32,512,4096,16384, run in that order), each under FP8_TIMEOUT (default 200 s), then
# its table; FP8_COMPILE (default: COMPILE's value) the compiled configurations of kernelhub's fp8 call
# and of its torch peer.
# Runs from the source tree (PYTHONPATH=src) on the machine's own torch/triton/transformers; wheels
# in .whl/ are installed first: kernelhub's own pure-Python dependencies the GPU image lacks (pydantic,
# with pydantic-core wheels for each Python) and Liger-Kernel, a peer.
set -u
OUT=${OUT:-/tmp/kernelhub-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} KERNELHUB_TEST_GPU=1 TRITON_INTERPRET=0
if ls .whl/*.whl >/dev/null 2>&1; then  # one by one: wheels for other Pythons are skipped
  for w in .whl/*.whl; do
    python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site "$w" 2>/dev/null
  done
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
steps=${*:-tests demo swiglu routing moe}
# Peers' Triton autotuning (Liger's fused MoE: minutes per model shape) is kept on disk so that a
# later run skips it: every run packs the Triton cache's *.autotune.json files into
# $OUT/peer_autotune.tgz, and unpacks the tarballs found in $PEER_AUTOTUNE (default .peer_autotune/,
# ignored by git: copy an earlier run's tarball there) into the cache first. Without them Triton tunes
# again. The results hold for one GPU, Triton and peer version. Our kernels do not autotune (their
# tiles are data: configs/*.json), so this only spares the peers' tuning time.
export TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
mkdir -p "$TRITON_CACHE_DIR"
for t in "${PEER_AUTOTUNE:-.peer_autotune}"/*.tgz; do [ -f "$t" ] && tar xzf "$t" -C "$TRITON_CACHE_DIR"; done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
bench_runs() { # VAR NAME=DIR...: bench_moe.py once per NAME=DIR argument, with env VAR=DIR (empty DIR:
  # ours as shipped); JSON lines in $OUT/NAME/bench_moe.jsonl, every run's log in one file, $OUT/ab.log;
  # eager only unless AB_COMPILE names compiled configurations (bench_moe.py's COMPILE)
  local var=$1; shift
  for arg in "$@"; do
    local run=${arg%%=*} dir=${arg#*=}
    mkdir -p "$OUT/$run"
    echo "=== $run (${dir:-shipped})" >> "$OUT/ab.log"
    env ${dir:+$var=$dir} OUT="$OUT/$run" IMPLS=${IMPLS:-kernelhub} COMPILE=${AB_COMPILE:-none} SHAPES=${SHAPES:-qwen3_30b_a3b,deepseek_v3} \
      TOKENS=${TOKENS:-4096,16384} timeout ${MOE_TIMEOUT:-150} python3 kernels_repo/moe/benchmarks/bench_moe.py \
      2>&1 | tee -a "$OUT/ab.log" | grep -E "^kind=moe_(fwd|fwdbwd|stages)" | sed "s/^/$run /"
  done
}
bench_ab() { bench_runs KERNELHUB_MOE_CONFIG_DIR "$@"; }  # NAME=CONFIG_DIR: another config directory
for step in $steps; do
  echo "=== $step ($(date -u +%T))"
  case $step in
    tests) timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short ${GPU_TESTS:-} ${GPU_K:+-k "$GPU_K"} > "$OUT/gpu_tests.log" 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -30 ;;
    demo) timeout 120 python3 examples/demo.py 2>&1 | tee "$OUT/demo.log" | tail -40 ;;
    swiglu) OUT="$OUT" timeout ${SWIGLU_TIMEOUT:-450} python3 kernels_repo/swiglu/benchmarks/bench_swiglu.py 2>&1 | tee "$OUT/bench_swiglu.log" | grep -E "^--|^kind=error"
      python3 benchmarks/summarize.py swiglu "$OUT/swiglu_bench.jsonl" ;;
    tiles) timeout 150 python3 tools/sweep_tiles.py 2>&1 | tee "$OUT/sweep_tiles.log" | grep "^sweep" ;;
    profile) timeout 60 python3 tools/profile_swiglu_host.py 2>&1 | tee "$OUT/profile_swiglu.log" | head -45 ;;
    moehost) # MOEHOST_OLD: another copy of kernels_repo/moe, profiled first in the same run
      if [ -n "${MOEHOST_OLD:-}" ]; then timeout 90 python3 tools/profile_moe_host.py ${MOEHOST_T:-1} "$MOEHOST_OLD" 2>&1 | tee "$OUT/profile_moe_host_old.log" | head -${MOEHOST_LINES:-45}; fi
      timeout 90 python3 tools/profile_moe_host.py ${MOEHOST_T:-1} 2>&1 | tee "$OUT/profile_moe_host.log" | head -${MOEHOST_LINES:-45} ;;
    diag) timeout 200 python3 tools/diag_host.py ${DIAG:-} > "$OUT/diag.log" 2>&1; grep -E "^##|Error" "$OUT/diag.log" ;;
    comphost) timeout 200 python3 tools/diag_compiled_host.py > "$OUT/diag_compiled_host.log" 2>&1; grep -E "^T=|^python|Error" "$OUT/diag_compiled_host.log" ;;
    compdiag) timeout ${COMPDIAG_TIMEOUT:-300} python3 tools/diag_compiled.py > "$OUT/diag_compiled.log" 2>&1; grep -E "^T=|^bound|Error" "$OUT/diag_compiled.log" ;;
    fp8diag) timeout ${FP8DIAG_TIMEOUT:-150} python3 tools/diag_fp8_decode.py 2>&1 | tee "$OUT/diag_fp8_decode.log" | tail -25 ;;
    decodescale) timeout 120 python3 tools/diag_decode_scaling.py 2>&1 | tee "$OUT/decode_scaling.log" | grep -v -i warn ;;
    graphdiag) timeout 200 python3 tools/diag_swiglu_graph.py 2>&1 | tee "$OUT/diag_swiglu_graph.log" | tail -8 ;;
    sweep) timeout ${SWEEP_TIMEOUT:-240} python3 tools/sweep_backward.py 2>&1 | tee "$OUT/sweep_backward.log" | grep -v "^ " ;;
    tune) timeout ${TUNE_TIMEOUT:-400} python3 kernels_repo/moe/benchmarks/tune_moe.py ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune_moe.log" | grep -E "^==| block_m=|wrote" ;;
    routing) timeout 120 python3 benchmarks/bench_moe_routing.py 2>&1 | tee "$OUT/bench_routing.log" | tail -40 ;;
    moe) # one process per shape: a shape cut by its timeout keeps the points it finished (rows are flushed per point)
      for shape in $(echo "${SHAPES:-qwen3_30b_a3b,mixtral_8x7b,deepseek_v3}" | tr , ' '); do
        OUT="$OUT" SHAPES=$shape TOKENS=${TOKENS:-1,4096,16384} timeout ${MOE_TIMEOUT:-160} \
          python3 kernels_repo/moe/benchmarks/bench_moe.py 2>&1 | tee -a "$OUT/bench_moe.log" | grep -E "^-- .* took|^kind=moe_error"
      done
      python3 benchmarks/summarize.py moe "$OUT/bench_moe.jsonl" ;;
    slice) # whole-model rows: one process per model slice
      for model in $(echo "${SLICE_MODELS:-qwen3_30b_a3b,deepseek_v3}" | tr , ' '); do
        OUT="$OUT" MODELS=$model TOKENS=${SLICE_TOKENS:-1,4096} timeout ${SLICE_TIMEOUT:-230} \
          python3 benchmarks/bench_model_slice.py 2>&1 | tee -a "$OUT/bench_model_slice.log" | grep -E "^-- |^kind=slice_(error|model)"
      done
      python3 benchmarks/summarize.py slice "$OUT/bench_model_slice.jsonl" ;;
    fp8) # one process per shape: each measures its ceilings first; rows are flushed per point
      for shape in $(echo "${FP8_SHAPES:-deepseek_v3,qwen3_30b_a3b}" | tr , ' '); do
        OUT="$OUT" SHAPES=$shape TOKENS=${FP8_TOKENS:-1,32,512,4096,16384} COMPILE=${FP8_COMPILE:-${COMPILE:-default,reduce-overhead}} timeout ${FP8_TIMEOUT:-200} \
          python3 kernels_repo/moe/benchmarks/bench_fp8.py 2>&1 | tee -a "$OUT/bench_fp8.log" | grep -E "^ceiling|summary|^skip"
      done
      python3 benchmarks/summarize.py fp8 "$OUT/bench_fp8.jsonl" ;;
    moeprof) timeout ${PROF_TIMEOUT:-150} python3 tools/profile_moe.py 2>&1 | tee "$OUT/profile_moe.log" | grep -E "^==|^  " | head -${PROF_LINES:-80} ;;
    persist) timeout ${PERSIST_TIMEOUT:-300} python3 tools/sweep_persistent.py 2>&1 | tee "$OUT/sweep_persistent.log" | grep -E "^(==|persist|sum)|skip|Error" ;;
    flatcheck) timeout ${FLAT_TIMEOUT:-200} python3 tools/check_flat_wgrad.py 2>&1 | tee "$OUT/check_flat_wgrad.log" | tail -40 ;;
    ncu) # hardware counters of the MoE GEMMs in one forward+backward (NCU_POINT, NCU_K kernel regex, NCU_C launches)
      NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      if [ -z "$NCU" ]; then echo "no ncu on this machine"; else
        POINTS=${NCU_POINT:-deepseek_v3:4096} MODES=fwdbwd REPS=1 timeout ${NCU_TIMEOUT:-300} "$NCU" -k "regex:${NCU_K:-_grouped}" \
          -c ${NCU_C:-6} --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
          python3 tools/profile_moe.py > "$OUT/ncu.log" 2>&1
        grep -E "_grouped|Throughput|Duration|Hit Rate|Achieved Occupancy|ERR|==PROF==|==ERROR==" "$OUT/ncu.log" | head -${NCU_LINES:-90}
      fi ;;
    ncudecode) # hardware counters of fp8 (shipped tiles) and 16-bit decode calls at T=1 (tools/ncu_decode.py; SHAPE)
      NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      if [ -z "$NCU" ]; then echo "no ncu on this machine"; else
        timeout ${NCU_TIMEOUT:-300} "$NCU" -k "regex:decode" -c 4 --section SpeedOfLight --section ComputeWorkloadAnalysis \
          --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis --section Occupancy \
          --section LaunchStats python3 tools/ncu_decode.py > "$OUT/ncu_decode.log" 2>&1
        grep -E "decode|Duration|Throughput|Issue Slots Busy|Issued Ipc|Warp Cycles Per Issued|Stall|Achieved Occupancy|Registers Per|relative|==ERR" "$OUT/ncu_decode.log" | head -${NCU_LINES:-120}
      fi ;;
    decodeab) # DECODE_KIND=fp8 (default) or bf16: the decode-only sweep at T=1 (DECODE_SHAPES, default
      # qwen3_30b_a3b; DECODE_BUDGET_S=90), merged into a copy of the shipped configs ($OUT/decode_cfg, plus
      # DECODE_CFG: a file to copy there first, e.g. an earlier fp8 merge), then bench_fp8.py at T=1 (fp8 and
      # bf16 side by side), shipped and merged interleaved (A B B A) in separate processes
      kind=${DECODE_KIND:-fp8}; cfg=$OUT/decode_cfg; mkdir -p "$cfg"
      # (DECODE_CFG read before the shipped files land: it may be $cfg's own merge of an earlier run)
      extra=; if [ -n "${DECODE_CFG:-}" ]; then extra=$(mktemp); cp "$DECODE_CFG" "$extra"; fi
      cp kernels_repo/moe/torch-ext/moe/configs/*.json "$cfg/"
      [ -n "$extra" ] && cp "$extra" "$cfg/$(basename "$DECODE_CFG")"
      if [ "$kind" = fp8 ]; then sweep="FP8_DECODE_ONLY=1 FP8_BUDGET_S=${DECODE_BUDGET_S:-90}"; args="--fp8"; tuned=fp8_sm90.json
      else sweep="DECODE_ONLY=1 BUDGET_S=${DECODE_BUDGET_S:-90}"; args="--forward-only"; tuned=sm90.json; fi
      env $sweep SHAPES=${DECODE_SHAPES:-qwen3_30b_a3b} TOKENS=1 timeout $(( ${DECODE_BUDGET_S:-90} + 40 )) \
        python3 kernels_repo/moe/benchmarks/tune_moe.py $args --out "$OUT/decode_tuned" > "$OUT/decode_tune.log" 2>&1
      grep -E "end to end|check|wrote|Error" "$OUT/decode_tune.log"
      python3 tools/merge_fp8_decode.py "$OUT/decode_tuned/$tuned" "$cfg" && diff "kernels_repo/moe/torch-ext/moe/configs/$tuned" "$cfg/$tuned"
      for run in shipped merged merged2 shipped2; do
        case $run in merged*) dir=$cfg;; *) dir=;; esac
        mkdir -p "$OUT/$run"
        env ${dir:+KERNELHUB_MOE_CONFIG_DIR=$dir} OUT="$OUT/$run" PEERS=0 SHAPES=${DECODE_SHAPES:-qwen3_30b_a3b} TOKENS=1 \
          COMPILE=none timeout ${FP8_TIMEOUT:-60} python3 kernels_repo/moe/benchmarks/bench_fp8.py 2>&1 \
          | tee -a "$OUT/decode_ab.log" | grep -E "^fp8 .*T=1 kernelhub" | sed "s/^/$run /"
      done ;;
    pairab) # fused_experts as shipped, then with the 128-row buckets as block_m=64 + pair_m (same run)
      python3 tools/pair_m_configs.py /tmp/pair_m_configs
      bench_ab shipped= pair_m=/tmp/pair_m_configs ;;
    dirab) # bench_moe.py on the kernel repository copy $MOE_OLD (an older commit), then on ours (same run);
      # AB_ROUNDS=2: old, new, old, new (host drift within a run)
      old=${MOE_OLD:?set MOE_OLD to a copy of kernels_repo/moe}
      runs="old=$old new="; [ "${AB_ROUNDS:-1}" = 2 ] && runs="$runs old2=$old new2="
      TOKENS=${TOKENS:-4096} bench_runs MOE_DIR $runs ;;
    cfgab) # fused_experts with the config file $CFG_A (and $CFG_B, if set; as sm90.json) against the shipped configs (same run)
      mkdir -p /tmp/cfg_a && cp "${CFG_A:?set CFG_A to an sm90.json to compare}" /tmp/cfg_a/sm90.json
      if [ -n "${CFG_B:-}" ]; then mkdir -p /tmp/cfg_b && cp "$CFG_B" /tmp/cfg_b/sm90.json; fi
      if [ "${AB_ROUNDS:-1}" = 2 ]; then  # interleaved: A, (B,) shipped, A, (B,) shipped (drift within a run)
        bench_ab cfg_a=/tmp/cfg_a ${CFG_B:+cfg_b=/tmp/cfg_b} shipped= cfg_a2=/tmp/cfg_a ${CFG_B:+cfg_b2=/tmp/cfg_b} shipped2=
      else
        bench_ab cfg_a=/tmp/cfg_a ${CFG_B:+cfg_b=/tmp/cfg_b} shipped=
      fi ;;
  esac
done
( cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | sort > /tmp/peer_autotune.list
  [ -s /tmp/peer_autotune.list ] && tar czf "$OUT/peer_autotune.tgz" -T /tmp/peer_autotune.list )
echo "=== done ($(date -u +%T))"
