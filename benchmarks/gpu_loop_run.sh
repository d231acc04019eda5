#!/usr/bin/env bash
# One device run of the decoding loop's GPU figures (issue 12), within one device command (<= 6 minutes
# of limits; the kernel suite only with SUITE=1, 4 more):
#   1. host work per step with the device stubbed out, on the GPU machine's host (bench_host_step);
#   2. the adaptive controller's cost per step on that host (bench_controller);
#   3. the quick e2e run on the GPU, draft model and n-gram (batch 1, greedy, 64 new tokens): tokens/s,
#      adaptive vs each fixed k, the host's own work per step and step wall - device time per row;
#   4. with SUITE=1, the kernel suite (gpu_suite.py, its own budget).
# Each step has a time limit and appends its table to benchmarks/RESULTS.md; logs and that file are copied
# to $OUT after every step (a step cut by its limit keeps what the others wrote).
#
# Run on the device:  bash benchmarks/gpu_loop_run.sh            (OUT: where the results go; default /tmp/out)
# Dry run on a CPU:   DRY_RUN=1 bash benchmarks/gpu_loop_run.sh  (tiny sizes, CPU backends, ~1 minute; CI runs it)
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/out}
PY=${PYTHON:-python3}
DRY=${DRY_RUN:-0}
mkdir -p "$OUT"
cd "$HERE"
export PYTHONPATH="$HERE/..${PYTHONPATH:+:$PYTHONPATH}"

# step NAME LIMIT_SECONDS COMMAND...: runs COMMAND with a limit, keeps its log and RESULTS.md in $OUT
step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "rc=$rc seconds=$((SECONDS - start))" >> "$OUT/$name.log"
    tail -n 25 "$OUT/$name.log"
    cp RESULTS.md "$OUT/RESULTS.md"
}

if [ "$DRY" = 1 ]; then
    device=cpu
    host_args=(--batch-sizes 1 --max-new-tokens 16 --repeats 1)
    controller_args=(--steps 200)
    e2e_args=(--quick --max-new-tokens 8 --repeats 1 --modes 2 adaptive --k-values 0 2)
    suite_args=(--dry-run --budget-s 60)
    append=()
else
    device=cuda
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/nvidia-smi.txt"
    host_args=()
    controller_args=()
    e2e_args=(--quick --max-new-tokens 64 --repeats 3)
    suite_args=(--budget-s 220)
    append=(--append)
fi

step host_step 60 env JAX_PLATFORMS=cpu "$PY" bench_host_step.py "${host_args[@]}" "${append[@]}"
step controller 40 "$PY" bench_controller.py "${controller_args[@]}" "${append[@]}"
step e2e_model 150 env JAX_PLATFORMS=$device "$PY" bench_e2e.py "${e2e_args[@]}" "${append[@]}"
if [ "$DRY" != 1 ]; then      # (the dry run checks bench_e2e once: the same script as e2e_model's)
    step e2e_ngram 110 env JAX_PLATFORMS=$device "$PY" bench_e2e.py --ngram "${e2e_args[@]}" "${append[@]}"
fi
if [ "${SUITE:-0}" = 1 ]; then
    step gpu_suite 240 "$PY" gpu_suite.py --out "$OUT/suite" "${suite_args[@]}"
fi
