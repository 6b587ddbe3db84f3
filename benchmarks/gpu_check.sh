#!/usr/bin/env bash
# GPU check (one H200, about 5-6 minutes, capped at 8): bf16 prefill and decode ratios on a Qwen2-1.5B-shaped random
# model, the fraction of the GPU's bf16 dense peak the base prefill reaches, and the QLoRA stage-1 step against the
# same step on the bf16 base (benchmarks/gpu_qlora.py). Results: JSON per step plus results_gpu.md in $OUT (or benchmarks/results_gpu).
#
#   bash benchmarks/gpu_check.sh            # PEAK_TFLOPS=989 (H200 bf16 dense) unless set
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
DEST=${OUT:-benchmarks/results_gpu}
PEAK=${PEAK_TFLOPS:-989}
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA device visible to torch; this script only runs on a GPU." >&2
    exit 2
fi
mkdir -p "$DEST"
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$DEST/gpu.txt"

step() {  # step NAME SECONDS COMMAND...: run with a time cap, keep going on failure, log to $DEST/NAME.log
    local name=$1 cap=$2
    shift 2
    echo "== $name (cap ${cap}s)"
    local t0=$SECONDS
    timeout "$cap" "$@" > "$DEST/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc in $((SECONDS - t0))s"
    if [ $rc -ne 0 ]; then status=1; tail -20 "$DEST/$name.log"; fi
}

GPU=(--device cuda --dtype bfloat16 --shape qwen2-1.5b --threads 4)
PREFILL=(--timing round-robin)  # lockstep would drain the GPU queue at every layer
# Question 1 at the CPU suite's batch (8 x 256), then at 8 x 2048 where the base prefill can approach the peak.
step prefill_8x256 100 "$PY" benchmarks/bench_prefill.py "${GPU[@]}" "${PREFILL[@]}" --batch 8 --seq 256 --warmup 3 --repeats 15 \
    --peak-tflops "$PEAK" --out "$DEST/prefill_8x256.json"
step prefill_8x2048 100 "$PY" benchmarks/bench_prefill.py "${GPU[@]}" "${PREFILL[@]}" --batch 8 --seq 2048 --warmup 3 --repeats 10 \
    --peak-tflops "$PEAK" --out "$DEST/prefill_8x2048.json"
# Question 2: greedy decode with KV cache, 128 new tokens, batch 1 and 8.
step decode 150 "$PY" benchmarks/bench_decode.py "${GPU[@]}" --warmup 1 --repeats 4 --whole-repeats 0 --out "$DEST/decode.json"
# QLoRA stage-1 step (nf4, bf16 compute) against the same step on the bf16 base, with the gradient check.
step qlora 120 "$PY" benchmarks/gpu_qlora.py --device cuda --dtype bfloat16 --warmup 2 --repeats 10 --out "$DEST/qlora.json"

"$PY" benchmarks/run_all.py --gpu-summary "$DEST" || status=1
exit $status
