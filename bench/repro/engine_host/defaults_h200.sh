#!/bin/bash
# The engine with no tuning flags against the tuned flags, in one call (issue 43 item 3),
# and the host loop (issue 43 item 1): LLaMA-3-8B shape, random weights, 4,096 requests of
# 128/128, bf16; then the tuned FP8 row against TensorRT-LLM's (issue 42); then the host
# loop alone (stand-in model) in this tree against BASE's, interleaved (host_ab.py).
# Usage: OUT=dir [BASE=dir] [VARIANTS="defaults tuned fp8_tuned"] [LIMIT=s]
#   bash bench/repro/engine_host/defaults_h200.sh
# LIMIT: seconds a run. A variant's first run on a fresh machine compiles its shapes:
# fp8_tuned did not finish in 170 s there; bf16_defaults' warm-up alone took 79 s
# (bench/results/host_loop/defaults_935036a/)
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=. PYTHONUNBUFFERED=1
common=(--model random:llama3-8b --num-prompts 4096 --input-len 128 --output-len 128 --quiet)
tuned=(--b-dense 2048 --admission predicted --fixed-shapes --max-model-len 256)
run() {  # name, flags...
  local name=$1; shift
  timeout "${LIMIT:-260}" python3 -m nanojax bench throughput "${common[@]}" "$@" \
    --json "$OUT/$name.json" 2>&1 | grep -v "^[WI]1" | grep "steady state\|tok/s total\|rror"
}
for v in ${VARIANTS:-defaults tuned fp8_tuned}; do
  case $v in
    defaults) run bf16_defaults ;;
    tuned) run bf16_tuned "${tuned[@]}" ;;
    tuned_sync_dispatch) run bf16_tuned_sync_dispatch "${tuned[@]}" --no-async-dispatch ;;
    fp8_tuned) run fp8_tuned "${tuned[@]}" --quantization fp8 --kv-cache-dtype fp8 ;;
  esac
done
if [ -n "${BASE:-}" ]; then
  python3 bench/repro/engine_host/host_ab.py "$BASE" "$OUT/host_ab.json" "${AB_RUNNING:-1000}" 1
fi
ls "$OUT"
