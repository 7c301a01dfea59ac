#!/bin/bash
# Issues 7 and 18 on the GPU: profile the LLaMA-3-8B shape (with PAIR_SHARES, also the fused
# GEMM + attention pair over those G, which the search then reads: it overlaps only where the
# measured pair beat back to back), search a plan, and time the searched plan beside the
# hand-written one (the first LAYERS layers, WORKLOADS, MODES; ratios from one process each,
# the searched plan's first workload with a timeline), and check the plan's predicted layer
# makespan against the measured one (CHECK=0: skip).
# Usage: OUT=dir [LAYERS=8] [PLAN=searched.json: skip profile and search] [PAIR_SHARES=44,88]
#        [PAIR_GEMMS=gate_up: the pair's GEMMs, default all four]
#        [WORKLOADS=512/512] [MODES=non-overlap,overlap] [HANDWRITTEN=1] [LIMIT_STEP=120] [CHECK=1]
#        [QUANT=fp8] [KV=fp8] bash bench/repro/overlap_search/search_llama3_8b.sh
# FP8 (issue 42 item 6): QUANT=fp8 KV=fp8 profiles the FP8 projections and FP8 pages (no
# pair: it reads bf16 pages); give the steps the same, MODES=non-overlap::fp8w:fp8kv,overlap::fp8w:fp8kv
# With the Mosaic GPU decode kernel (today's Hopper default) the profile compiles a kernel per
# attention size and share: with a pair it ran past 400 s (2026-12-03, §64), so give it a
# call of its own (LIMIT_PROFILE near the call's 600 s) and run the steps with PLAN= after.
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT"  # (with PLAN= no profile makes it)
export PYTHONPATH=. PYTHONUNBUFFERED=1
quiet() { grep -v "^[WI]1" | tail -n "$1"; }
if [ -z "${PLAN:-}" ]; then
  timeout "${LIMIT_PROFILE:-380}" python3 -m nanojax profile --b-dense 2048 --granularity 256 \
    --shares 0.25,0.5,1.0 ${PAIR_SHARES:+--pair-shares "$PAIR_SHARES" --pair-power-seconds 0.5} \
    ${PAIR_GEMMS:+--pair-gemms "$PAIR_GEMMS"} ${QUANT:+--quantization "$QUANT"} \
    ${KV:+--kv-cache-dtype "$KV"} \
    --out "$OUT/profile_llama3-8b_1xh200.json" 2>&1 | tr '\r' '\n' | quiet 12
  echo "profile rc=${PIPESTATUS[0]} (124: timed out)"
  timeout 120 python3 -m nanojax search --profile "$OUT/profile_llama3-8b_1xh200.json" \
    --out "$OUT/plan_llama3-8b_searched.json" --max-k 3 --time-limit 30 \
    --png "$OUT/plan_llama3-8b_searched.png" 2>&1 | quiet 8
  PLAN=$OUT/plan_llama3-8b_searched.json
fi
# HANDWRITTEN=0: the searched plan alone (its first workload's iteration drawn either way)
plans=("$PLAN"); [ "${HANDWRITTEN:-1}" = 0 ] || plans=(llama3-8b-1gpu "$PLAN")
for plan in "${plans[@]}"; do
  name=$(basename "$plan" .json)
  draw=(); [ "$plan" = "$PLAN" ] && draw=(--timeline "$OUT/timeline_searched.png")
  timeout "${LIMIT_STEP:-120}" python3 -m nanojax bench step --model random:llama3-8b \
    --num-layers "${LAYERS:-8}" --plan "$plan" --b-dense 2048 --workloads "${WORKLOADS:-512/512}" \
    --modes "${MODES:-non-overlap,overlap}" --quiet --json "$OUT/step_${name}.json" \
    "${draw[@]}" 2>&1 | quiet 8
done
[ "${CHECK:-1}" = 0 ] && { ls -la "$OUT"; exit 0; }
# the searched plan's predicted layer makespan against the measured one: the step at half
# the layers too, and the difference per layer (no embedding, LM head or sampling in it)
half=$(( ${LAYERS:-8} / 2 ))
timeout 120 python3 -m nanojax bench step --model random:llama3-8b --num-layers "$half" \
  --plan "$PLAN" --b-dense 2048 --workloads 512/512 --modes overlap --quiet \
  --json "$OUT/step_${half}layers_searched.json" 2>&1 | quiet 2
python3 bench/repro/overlap_search/prediction_check.py "$PLAN" "$OUT/step_${half}layers_searched.json" \
  "$OUT/step_$(basename "$PLAN" .json).json" --out "$OUT/prediction_check.json" | quiet 6
ls -la "$OUT"
