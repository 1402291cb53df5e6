#!/usr/bin/env bash
# The GPU checks of the Triton kernels, in order, on a CUDA machine with this project installed:
#   1. the Triton tests compiled for the GPU (2D and 1D), and the FlexAttention gradient tests that skip on the CPU;
#   2. the 2D study: ViL-Small's first stage (bfloat16, batch 64, 3 heads x 32, w 7, one global token, relative
#      bias) at 28x28, 56x56 and 112x112: triton, flex (compiled), sliding_chunk and SDPA (flash);
#   3. the 1D study: Longformer's settings (12 heads x 64, w 256, bfloat16, batch 1) from 4k to 64k tokens, causal
#      and not, dilation 1 and 2: triton, flex (compiled, the same band as a block mask), sliding_chunk, chunks and
#      SDPA (flash; causal for the causal rows).
# Tables go to docs/attention_gpu*.md (override with OUT=dir); each step goes on after a failing one, and the
# script exits non-zero if any failed.
#
#   bash tools/gpu_checks.sh            # everything (about 10 minutes on an H100)
#   STEPS="1" bash tools/gpu_checks.sh  # only the tests
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs}
STEPS=${STEPS:-"1 2 3"}
failed=0
run() { echo "+ $*"; "$@" || { echo "FAILED: $*"; failed=1; }; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
for step in $STEPS; do
  case $step in
    1) run env TRITON_INTERPRET=0 python -m pytest -q -rs tests/test_triton_kernels.py tests/test_triton_kernels_1d.py \
         tests/test_local_attention.py tests/test_local_attention_1d.py -k "triton or flex or gradients" ;;
    2) run python tools/benchmark_attention.py --device cuda --dtype bfloat16 --batch 64 --heads 3 --head-dim 32 \
         --window 7 --num-global 1 --rel-bias --sizes 28 56 112 --backends triton flex sliding_chunk \
         --markdown "$OUT/attention_gpu.md" ;;
    3) for causal in "" "--causal"; do
         for dilation in 1 2; do
           run python tools/benchmark_attention.py --dim 1 --device cuda --dtype bfloat16 --sizes 4096 8192 16384 \
             32768 65536 --dilation "$dilation" $causal --backends triton flex sliding_chunk chunks \
             --markdown "$OUT/attention_gpu_1d_dilation${dilation}${causal:+_causal}.md"
         done
       done ;;
  esac
done
exit $failed
