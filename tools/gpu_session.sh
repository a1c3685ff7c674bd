#!/usr/bin/env bash
# The checks of a session lent a GPU, in the order DEVELOPERS.md gives them,
# inside one deadline (device time is short: each step is skipped when too
# little is left for it). Run from the repository root on the GPU machine:
#   BUDGET_S=570 bash tools/gpu_session.sh
# Logs go to $OUT (the device tool's folder) or /tmp/gpu-out.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
DEADLINE=$((SECONDS + ${BUDGET_S:-570}))
export PYTHONUNBUFFERED=1
PYTHONPATH=$(ls -d "$PWD"/packages/*/src | tr '\n' ':')
export PYTHONPATH
left() { echo $((DEADLINE - SECONDS)); }
# run NEED MAX LOG CMD...: skipped unless NEED seconds are left; at most MAX.
run() {
    local need=$1 max=$2 log=$3
    shift 3
    if [ "$(left)" -lt "$need" ]; then
        echo "SKIPPED (only $(left) s left): $*" | tee -a "$OUT/$log"
        return
    fi
    [ "$max" -gt "$(left)" ] && max=$(left)
    echo "== $* (limit $max s)" | tee -a "$OUT/$log"
    timeout "$max" "$@" 2>&1 | tee -a "$OUT/$log"
}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    free -g | head -2
    nproc
    python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
} 2>&1 | tee "$OUT/machine.txt"
# 1. nox -s gpu, without nox (these machines are offline and lack it).
run 60 ${GPU_TESTS_S:-170} gpu_tests.log python3 -m pytest packages/pc-comm/tests \
    packages/pc-offload/tests packages/pc-chunk/tests packages/pc-zero/tests \
    packages/pc-pipeline/tests packages/pc-tensor/tests packages/pc-booster/tests \
    integration_tests -m gpu -q -rfEs -p no:cacheprovider --durations=20 \
    --continue-on-collection-errors
# 2. The largest model: Gemini stepping in backward at the 2x-FSDP2 size,
#    FSDP2 + CPUOffloadPolicy's largest on this machine for tokens/s, then
#    a larger Gemini size while time is left.
L=benchmarks/gpu_largest_model.py
run 120 ${TRIAL_S:-240} largest.log python3 $L search --framework gemini-step-in-backward \
    --layers ${GEMINI_LAYERS:-76} --timeout ${TRIAL_S:-240}
run 100 ${TRIAL_S:-240} largest.log python3 $L search --framework fsdp2 \
    --layers ${FSDP2_LAYERS:-36} --timeout ${TRIAL_S:-240}
run 120 ${TRIAL_S:-240} largest.log python3 $L search --framework gemini-step-in-backward \
    --layers ${GEMINI_MORE:-88} --timeout ${TRIAL_S:-240}
echo "done with $(left) s left" | tee -a "$OUT/machine.txt"
