#!/usr/bin/env bash
# One self-contained GPU check of genpool, for a borrowed single-GPU machine (written for an H200)
# with no network: it builds its own random-weight checkpoints on the device (SmolLM2-135M's shape
# and Llama-3.2-1B's), then checks Triton-vs-reference parity of the whole engine, engine throughput
# against HF `generate` on the same GPU, and paged-attention bandwidth, and prints ONE table.
#
#   benchmarks/gpu_check.sh            # on the GPU; logs and rows under ./gpu_check_out (GPU_CHECK_OUT)
#   benchmarks/gpu_check.sh --smoke    # the same steps on the CPU: tiny shapes, TRITON_INTERPRET=1
#                                      # (tests/integration/test_gpu_check.py runs it so the script cannot rot)
#
# Needs torch, triton, transformers and safetensors installed (nothing is downloaded). Each step has
# its own time limit and all share one budget (GPU_CHECK_BUDGET_S, default 450 s: under 8 minutes).
# A failing step does not stop the later ones; the exit code is the number of failed steps.
set -u -o pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT_DIR=${GPU_CHECK_OUT:-gpu_check_out}
BUDGET=${GPU_CHECK_BUDGET_S:-450}
SMOKE=()
DEVICE=cuda
DTYPE=bfloat16
MODELS=(smollm2-shape llama-1b-shape)
if [[ "${1:-}" == "--smoke" ]]; then
    SMOKE=(--smoke)
    DEVICE=cpu
    DTYPE=float32
    MODELS=(tiny-a tiny-b)
    export TRITON_INTERPRET=1
else
    unset TRITON_INTERPRET  # compiled kernels, not the CPU interpreter
fi
mkdir -p "$OUT_DIR"
# genpool.* from this checkout without installing it (a borrowed GPU machine may have no network for a
# build): a directory of genpool/<folder> links, first on PYTHONPATH. Never the checkout root itself:
# its folders would shadow other distributions' top-level names (transformers imports `kernels`).
NS=$(mktemp -d)
trap 'rm -rf "$NS"' EXIT
mkdir "$NS/genpool"
for d in engine kernels workers producer schemas; do ln -s "$PWD/$d" "$NS/genpool/$d"; done
export PYTHONUNBUFFERED=1 PYTHONPATH="$NS${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
START=$(date +%s)
FAILED=0
ROWS="$OUT_DIR/rows.jsonl"
: >"$ROWS"

# step NAME LIMIT_S ARGS...: gpu_check.py ARGS with min(LIMIT, budget left) seconds, log in $OUT_DIR/NAME.log
step() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - ($(date +%s) - START)))
    if ((left < 15)); then
        echo "SKIP  $name (overall budget spent)"
        FAILED=$((FAILED + 1))
        return 1
    fi
    ((limit > left)) && limit=$left
    echo "=== $name (limit ${limit}s) ==="
    local t0=$(date +%s) rc=0
    timeout --kill-after=5 "$limit" "$PY" benchmarks/gpu_check.py "$@" --device "$DEVICE" --rows "$ROWS" \
        "${SMOKE[@]}" >"$OUT_DIR/$name.log" 2>&1 || rc=$?
    grep -E '^(PASS|FAIL|info) ' "$OUT_DIR/$name.log" || tail -n 15 "$OUT_DIR/$name.log"
    ((rc == 124 || rc == 137)) && echo "TIMEOUT  $name"
    echo "--- $name: rc=$rc, $(($(date +%s) - t0))s"
    ((rc == 0)) || FAILED=$((FAILED + 1))
    return $rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
if step checkpoints 150 checkpoints --out "$OUT_DIR/models"; then
    for m in "${MODELS[@]}"; do
        step "parity-$m" 90 parity --model "$OUT_DIR/models/$m"
    done
    for m in "${MODELS[@]}"; do
        step "throughput-$m" 120 throughput --model "$OUT_DIR/models/$m" --dtype "$DTYPE"
    done
else
    FAILED=$((FAILED + 4))
fi
step bandwidth 90 bandwidth --peak-gbs "${GPU_PEAK_GBS:-4800}"

echo "=== genpool GPU check ($(($(date +%s) - START))s, ${#SMOKE[@]} smoke) ==="
"$PY" benchmarks/gpu_check.py table --rows "$ROWS"
echo "failed steps: $FAILED"
exit "$FAILED"
