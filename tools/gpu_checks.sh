#!/usr/bin/env bash
# The GPU checks of the Triton kernels and of compiled FlexAttention, in order, on a CUDA machine with this project's
# requirements (from a checkout that is not installed too: the packages vil_kernels and vil_tools are then linked
# to kernels/ and tools/ in a temporary folder on PYTHONPATH):
#   1. the Triton tests compiled for the GPU: tests/test_triton_kernels.py and tests/test_triton_kernels_1d.py;
#   2. the other tests that need CUDA: FlexAttention's gradients (torch has no FlexAttention backward on the CPU),
#      and whole models with the Triton kernels (tests/test_models_on_gpu.py: transformers' Longformer accelerated,
#      ViL-Tiny against sliding_chunk);
#   3. the 2D study: ViL-Small's first stage (bfloat16, batch 64, 3 heads x 32, w 7, one global token, relative
#      bias) at 28x28, 56x56 and 112x112: triton, sliding_chunk and SDPA (flash), then flex (compiled) on its own;
#   4. the 1D study: Longformer's settings (12 heads x 64, w 256, bfloat16, batch 1) at 32k tokens (SIZES_1D, a
#      list; 32k is where the 1D targets are), causal and not, dilation 1 and 2: triton, flex (compiled, the
#      same band as a block mask), sliding_chunk, chunks and SDPA (flash; causal for the causal rows).
#   5. (only when STEPS names it) the model study: ViL-Small against timm's Swin-T, batch 64 at 224, in bfloat16
#      autocast and in float32, with tools/benchmark_model.py.
#   6. (only when STEPS names it) the host CPU's tests and bfloat16 figures on two cores (taskset: the first two of the
#      CPUs the script may run on; OMP_NUM_THREADS=2), as on the 2-core machines of BENCHMARKS.md: the fused CPU
#      kernels' tests (tests/test_fused_cpu_precision.py and tests/test_fused_cpu_1d.py: every way of multiplying
#      that the CPU has, AMX tiles where the OS grants them, against float64); their C++ argument checks once more,
#      built for each instruction set below the CPU's own (ATEN_CPU_CAPABILITY avx2 and default: the builds for
#      x86-64-v3 and for any x86-64), each in a process of its own, so that a check that fails in one build only
#      shows which; the fused CPU kernels in float32 and bfloat16 against SDPA and the CPU's matrix products
#      (tools/benchmark_precision.py; its CPU line says whether the OS grants AMX tiles); ViL-Small against Swin-T
#      under bfloat16 autocast, with the profiler's table of two training steps of each (tools/benchmark_model.py).
#   7. (only when STEPS names it) the host CPU's other figures, on the same two cores: ViL-Small against Swin-T in
#      float32, and transformers' Longformer at 4096 tokens against the accelerated one
#      (tools/benchmark_longformer.py).
# Tests print each result as it ends (pytest -v), with pytest-xdist's workers where it is installed (WORKERS, default
# 12), and their failures' tracebacks at the end. Every step runs under a time limit (LIMIT_1 .. LIMIT_7 seconds; the
# steps of several runs share theirs out among them), so that a slow step cannot take the time of the next. The
# studies print each size's rows as it ends, then the profiler's table of each backend (kernel by kernel) and, but for
# flex in 2D, the host's time per call against the GPU's (--host-time); their last column is the first call's time
# (compilation and tuning), and each backend's first call is reported as it ends; a study's table holds the sizes it
# measured before its time ran out, a size whose profiles the limit stopped included. The shares go by what a run
# compiles: in a fresh machine the first 1D run of each kind (causal or not) compiles its kernels (triton 14 s, flex
# 11 s on an H200), the second finds them in the on-disk caches (2.5 s, 8 s).
# The limits fit the checks into 15 minutes of a GPU machine in two calls, the second while the machine is still
# warm (times of 2026-11-29 on a fresh H200 machine, whose first calls compile everything):
#   bash tools/gpu_checks.sh                  # steps 1 and 2: 170 + 120 s (the tests took 140 s and 100 s with 8
#                                             # workers, and both ran out)
#   STEPS="3 4 6" bash tools/gpu_checks.sh    # steps 3 and 4 (210 + 250 s), step 6 beside them (470 s)
# Step 6, named with other steps on a machine of at least 8 cores, runs beside them, on its two cores while they run
# on the others (its lines on the terminal marked "[host CPU]"). Its benchmarks compare contenders alternating in one
# process, so their ratios hold beside the GPU steps; STEPS=6 alone gives the absolute times with no neighbours. Its
# share of 470 s: 110 s for the tests (the kernels' build included; 143 of 189 ended in 80 s on the H200's host), 80 s
# for the two other builds' checks, 140 s for each bfloat16 run, which end within theirs only on a CPU with bfloat16
# matrix instructions (AVX512-BF16 or AMX). Step 7 takes 200 s: 90 s for the model in float32, 110 s for the
# Longformer run (80 s on a 2-core AMD EPYC).
# Logs and tables go to OUT (default docs/): tests_triton.log, tests_cuda.log, studies.log, attention_gpu.md,
# attention_gpu_flex.md, attention_gpu_1d_dilation{1,2}[_causal].md, models_gpu.log, cpu_host.log. Each step goes
# on after a failing one, and the script exits non-zero if any failed or ran out of time.
#
#   STEPS=4 SIZES_1D="4096 32768" LIMIT_4=400 bash tools/gpu_checks.sh
#   STEPS=5 bash tools/gpu_checks.sh             # the model study alone
#   STEPS=6 bash tools/gpu_checks.sh             # the host CPU's tests and bfloat16 figures alone
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs}
STEPS=${STEPS:-"1 2"}
# The CPUs this process may run on: steps 6 and 7 take the first two, the GPU steps beside them the others.
read -r -a cpus <<< "$(python -c "import os; print(*sorted(os.sched_getaffinity(0)))")"
host_steps=$(echo " $STEPS " | tr ' ' '\n' | grep -x -E '6|7' | xargs)
gpu_steps=$(echo " $STEPS " | tr ' ' '\n' | grep -v -x -E '6|7' | xargs)
if [ -n "$host_steps" ] && [ -n "$gpu_steps" ] && command -v taskset > /dev/null && [ "${#cpus[@]}" -ge 8 ]; then
  STEPS="$host_steps" bash tools/gpu_checks.sh 2>&1 | sed -u 's/^/[host CPU] /' &
  host=$!
  STEPS="$gpu_steps" taskset -c "$(IFS=,; echo "${cpus[*]:2}")" bash tools/gpu_checks.sh
  gpu_rc=$?
  wait "$host"
  host_rc=$?
  exit $((gpu_rc || host_rc))
fi
SIZES_1D=${SIZES_1D:-32768}
failed=0
mkdir -p "$OUT"
# limited SECONDS LOG COMMAND...: run COMMAND under a time limit, its output to the terminal and appended to LOG.
limited() {
  local seconds=$(($1 > 0 ? $1 : 1)) log=$2  # timeout's 0 would be no limit at all
  shift 2
  echo "+ $* (limit ${seconds} s)"
  timeout --kill-after=5 "$seconds" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "OUT OF TIME after ${seconds} s: $*"
    failed=1
  elif [ "$rc" != 0 ]; then
    echo "FAILED ($rc): $*"
    failed=1
  fi
}
# on_host_cpus LIMIT RUN...: each RUN ("SHARE:COMMAND", COMMAND with any VARIABLE=value before it) under its SHARE
# of LIMIT seconds (the shares of all RUNs make the whole), on the host's first two CPUs with OMP_NUM_THREADS=2, its
# output in cpu_host.log.
on_host_cpus() {
  local limit=$1 parts=0 run pin=()
  shift
  for run in "$@"; do
    parts=$((parts + ${run%%:*}))
  done
  if command -v taskset > /dev/null && [ "${#cpus[@]}" -ge 2 ]; then
    pin=(taskset -c "${cpus[0]},${cpus[1]}")
  else
    echo "taskset is missing, or fewer than two CPUs: all of them run."
  fi
  for run in "$@"; do
    # shellcheck disable=SC2086  # a command line of words
    limited $((limit * ${run%%:*} / parts)) "$OUT/cpu_host.log" "${pin[@]}" env OMP_NUM_THREADS=2 ${run#*:}
  done
}
host_model="tools/benchmark_model.py --config-file configs/vil_small.yaml --batch 4 --steps 4 --rounds 3 --timm \
swin_tiny_patch4_window7_224"  # then the config's overrides, which end the command line
cpu_fused="MODEL.VIT.MSVIT.ATTN_TYPE fused_cpu AMP.ON_CPU True"
if ! python -c "import vil_kernels, vil_tools" 2>/dev/null; then
  links=$(mktemp -d)
  ln -s "$PWD/kernels" "$links/vil_kernels"
  ln -s "$PWD/tools" "$links/vil_tools"
  export PYTHONPATH="$links:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
pytest_args=(-v -rfEs --tb=short -p no:cacheprovider)
if python -c "import xdist" 2>/dev/null; then
  pytest_args+=(-n "${WORKERS:-12}")
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for step in $STEPS; do
  case $step in
    1) limited "${LIMIT_1:-170}" "$OUT/tests_triton.log" env TRITON_INTERPRET=0 python -m pytest "${pytest_args[@]}" \
         tests/test_triton_kernels.py tests/test_triton_kernels_1d.py ;;
    2) limited "${LIMIT_2:-120}" "$OUT/tests_cuda.log" env TRITON_INTERPRET=0 python -m pytest "${pytest_args[@]}" \
         tests/test_local_attention.py tests/test_local_attention_1d.py tests/test_models_on_gpu.py \
         -k "flex and cuda or models_on_gpu" ;;
    3) # flex in a run of its own, so that its compilation (minutes, before its window rule was in closed form) holds
       # back no other row; the host's time per call (--host-time) in the first run only: flex takes 0.7 s a call at
       # 112x112. The first run, whose triton tunes its kernels at three sizes, gets 3/5 of the step's time.
       for run in "attention_gpu:triton sliding_chunk:--host-time:3" "attention_gpu_flex:flex::2"; do
         IFS=: read -r table backends host_time fifths <<< "$run"
         # shellcheck disable=SC2086  # a list of backends, and a switch or nothing
         limited $((${LIMIT_3:-210} * fifths / 5)) "$OUT/studies.log" python tools/benchmark_attention.py --device cuda \
           --dtype bfloat16 --batch 64 --heads 3 --head-dim 32 --window 7 --num-global 1 --rel-bias --sizes 28 56 112 \
           --backends $backends --profile $host_time --markdown "$OUT/$table.md"
       done ;;
    4) # Of each kind's share, the first run (dilation 1, which compiles the kernels) gets 3/5, the second 2/5.
       for causal in "" "--causal"; do
         for dilation in 1 2; do
           # shellcheck disable=SC2086  # SIZES_1D is a list of lengths
           limited $((${LIMIT_4:-250} * (4 - dilation) / 10)) "$OUT/studies.log" \
             python tools/benchmark_attention.py --dim 1 --device cuda \
             --dtype bfloat16 --sizes $SIZES_1D --dilation "$dilation" $causal \
             --backends triton flex sliding_chunk chunks --profile --host-time \
             --markdown "$OUT/attention_gpu_1d_dilation${dilation}${causal:+_causal}.md"
         done
       done ;;
    5) for precision in "True" "False"; do
         limited $((${LIMIT_5:-180} / 2)) "$OUT/models_gpu.log" python tools/benchmark_model.py \
           --config-file configs/vil_small.yaml --device cuda --batch 64 --steps 10 --rounds 2 \
           --timm swin_tiny_patch4_window7_224 AMP.ENABLED "$precision"
       done ;;
    6) # Each run's share of the step's time and its command line. The fused CPU kernels' tests come
       # first: they build the kernels, and they run every way of multiplying this CPU has (AMX tiles included).
       "${CXX:-c++}" --version 2>&1 | head -n 1 | tee -a "$OUT/cpu_host.log"  # the compiler that builds the kernels
       checks="-m pytest -q -p no:cacheprovider tests/test_fused_cpu_1d.py tests/test_local_attention.py -k \
refuse_other_shapes"
       on_host_cpus "${LIMIT_6:-470}" \
         "11:python -m pytest -q -p no:cacheprovider tests/test_fused_cpu_precision.py tests/test_fused_cpu_1d.py" \
         "4:ATEN_CPU_CAPABILITY=avx2 python $checks" "4:ATEN_CPU_CAPABILITY=default python $checks" \
         "14:python tools/benchmark_precision.py --rounds 3" \
         "14:python $host_model --profile $cpu_fused AMP.ENABLED True" ;;
    7) on_host_cpus "${LIMIT_7:-200}" "9:python $host_model $cpu_fused AMP.ENABLED False" \
         "11:python tools/benchmark_longformer.py --lengths 4096 --what model --rounds 3" ;;
    *) echo "Unknown step $step; the steps are 1 2 3 4 5 6 7."; failed=1 ;;
  esac
done
exit $failed
