#!/bin/bash
# Steady state (issue 20 item 1), in ONE GPU call: the engine end to end, in the window where
# it is saturated, against one dense step of the same model, B_dense, kernels and workload.
#   1. step    nanojax bench step, one mode (non-overlap), the workload's steady-state batch
#   2. engine  nanojax bench (offline) on NUM_PROMPTS requests arriving at once: several
#              times what the KV cache holds, so the queue stays long and the batch can stay
#              full; fixed shapes (every step shape compiled before the clock starts),
#              predicted admission (the peak and the pace, nanojax/engine/scheduler.py)
#   3. merge   bench/repro/engine_host/merge_steady_state.py: engine steady tokens/s / step tokens/s
#              and where the rest goes -> $OUT/steady_state_summary.json
# NUM_PROMPTS: the H200's cache should hold ~53,000 pages of 16 tokens at MEM_FRACTION
# 0.95 (an estimate, not measured: 0.95 x 0.9 of ~139 GiB, less ~15 GiB of weights, 2 MiB
# a page; the engine file records kv_pages), ~830 requests of 1,024 tokens, ~1,090 at the
# steady state's mean of 776, so 3,072 requests are ~3.7x the cache. They are 3.15M tokens: ~2,020 iterations by the scheduler
# alone (nanojax bench schedule --b-dense 2048 --num-pages 53000 --max-num-seqs 1152
# --input-len 512 --output-len 512 --num-prompts 3072 --max-model-len 1024), at ~91 ms per
# full iteration (the step, bench/results/throughput_triton/step_2048.json) ~3 minutes;
# ~1,000 of them are the steady window (the ramp-up and the drain are ~510 each).
# Time: step ~1-2 min (weights, GEMM rate, one compile), engine ~2 min to start (weights,
# 5 shapes compiled) + ~3 min; TOTAL_LIMIT bounds the whole call (the engine gets what the
# step left).
# MAX_NUM_SEQS 1,152: rows of the fixed-shape step (logits and sampling per row); the
# steady state runs ~1,030 (1,024 decodes + prefilling ones), more while cohorts even out.
# KERNEL: the decode kernel of both runs (default auto, today's engine default: the Mosaic
# GPU swap-AB kernel on Hopper; the committed 0.961 run passed triton).
# KV=fp8: FP8 pages in both runs (the step's mode non-overlap::fp8kv, the engine's
# --kv-cache-dtype fp8): twice the pages, so an 80 GB H100 also keeps the batch full (§85).
# Usage: OUT=dir [KERNEL=auto|triton|mosaic] [NUM_PROMPTS=3072] [KV=fp8] bash bench/repro/engine_host/steady_state_llama3_8b.sh
# CPU dry run (tiny shapes, a plan for them): MODEL=random:tiny PLAN=plan.json B_DENSE=64
#   INPUT_LEN=32 OUTPUT_LEN=32 MAX_MODEL_LEN=64 NUM_PROMPTS=150 MAX_NUM_SEQS=64
#   NUM_PAGES=480 PAGE_SIZE=4 OUT=dir bash bench/repro/engine_host/steady_state_llama3_8b.sh
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.95}
MODEL=${MODEL:-random:llama3-8b}
PLAN=${PLAN:-llama3-8b-1gpu}
B_DENSE=${B_DENSE:-2048}
IN=${INPUT_LEN:-512}
OUTLEN=${OUTPUT_LEN:-512}
start=$(date +%s)
quiet() { grep -v "^[WI]1" | tail -n "$1"; }
kernel=(--decode-kernel "${KERNEL:-auto}")
step_mode=non-overlap
kv=()
if [ "${KV:-bf16}" = fp8 ]; then step_mode=non-overlap::fp8kv; kv=(--kv-cache-dtype fp8); fi
pages=()
[ -n "${NUM_PAGES:-}" ] && pages=(--num-pages "$NUM_PAGES")
# the engine through the step's plan, non-overlap mode, so the two run the same executor
# (ENGINE_PLAN= runs the engine's default forward; the first H200 run, §26, did)
ENGINE_PLAN=${ENGINE_PLAN-$PLAN}
engine_plan=()
[ -n "$ENGINE_PLAN" ] && engine_plan=(--plan "$ENGINE_PLAN" --modes non-overlap)

# TIMELINE_AT=N (default 800, inside the steady window; 0: none) profiles 6 engine
# iterations from the N-th: is the device idle between steps or is each step slower?
timeline=()
[ "${TIMELINE_AT:-800}" != 0 ] && timeline=(--timeline "$OUT/engine_timeline.events.json"
                                          --timeline-at "${TIMELINE_AT:-800}")
# STEP_NUM_PAGES: the step's KV pool (default 16,384 pages); the engine's (53,541 on the
# H200) spreads the pages a step reads over ~105 GB
step_pages=()
[ -n "${STEP_NUM_PAGES:-}" ] && step_pages=(--num-pages "$STEP_NUM_PAGES")

timeout "${LIMIT_STEP:-180}" python3 -m nanojax bench step --model "$MODEL" --plan "$PLAN" \
  --b-dense "$B_DENSE" --workloads "$IN/$OUTLEN" --modes "$step_mode" "${kernel[@]}" \
  "${step_pages[@]}" \
  --max-num-seqs "${MAX_NUM_SEQS:-1152}" \
  --max-model-len "${MAX_MODEL_LEN:-1024}" --quiet --json "$OUT/step.json" 2>&1 | quiet 6

left=$(( ${TOTAL_LIMIT:-560} - ($(date +%s) - start) - 15 ))
echo "engine: $left s left of the call"
# the engine's share of the card as the pool's (its KV cache keeps to
# --gpu-memory-utilization, default 0.9, within jax's pool)
timeout "$left" python3 -m nanojax bench --model "$MODEL" --quiet "${kernel[@]}" "${kv[@]}" \
  --gpu-memory-utilization "${MEM_FRACTION:-0.95}" \
  "${engine_plan[@]}" --b-dense "$B_DENSE" --admission predicted --fixed-shapes \
  --min-token-bucket "${MIN_TOKEN_BUCKET:-128}" --max-num-seqs "${MAX_NUM_SEQS:-1152}" \
  --page-size "${PAGE_SIZE:-16}" "${pages[@]}" --num-prompts "${NUM_PROMPTS:-3072}" \
  --input-len "$IN" --output-len "$OUTLEN" --max-model-len "${MAX_MODEL_LEN:-1024}" \
  "${timeline[@]}" --json "$OUT/engine.json" 2>&1 | quiet 8

python3 bench/repro/engine_host/merge_steady_state.py "$OUT/step.json" "$OUT/engine.json" \
  --out "$OUT/steady_state_summary.json"
echo "call took $(( $(date +%s) - start )) s"
ls -la "$OUT"
