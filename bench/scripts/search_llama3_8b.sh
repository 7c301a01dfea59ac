#!/bin/bash
# Issue 7 on the GPU: profile the LLaMA-3-8B shape, search a plan, and time the searched
# plan beside the hand-written one (the first LAYERS layers; ratios from one process each),
# and check the plan's predicted layer makespan against the measured one.
# Usage: OUT=dir [LAYERS=8] [PLAN=searched.json: skip profile and search] \
#        bash bench/scripts/search_llama3_8b.sh
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=. PYTHONUNBUFFERED=1
quiet() { grep -v "^[WI]1" | tail -n "$1"; }
if [ -z "${PLAN:-}" ]; then
  timeout "${LIMIT_PROFILE:-380}" python3 -m nanojax profile --b-dense 2048 --granularity 256 \
    --shares 0.25,0.5,1.0 --out "$OUT/profile_llama3-8b_1xh200.json" 2>&1 | tr '\r' '\n' | quiet 6
  echo "profile rc=${PIPESTATUS[0]} (124: timed out)"
  timeout 120 python3 -m nanojax search --profile "$OUT/profile_llama3-8b_1xh200.json" \
    --out "$OUT/plan_llama3-8b_searched.json" --max-k 3 --time-limit 30 \
    --png "$OUT/plan_llama3-8b_searched.png" 2>&1 | quiet 8
  PLAN=$OUT/plan_llama3-8b_searched.json
fi
for plan in llama3-8b-1gpu "$PLAN"; do
  name=$(basename "$plan" .json)
  timeout 120 python3 -m nanojax bench step --model random:llama3-8b --num-layers "${LAYERS:-8}" \
    --plan "$plan" --b-dense 2048 --workloads 512/512 --modes non-overlap,overlap --quiet \
    --json "$OUT/step_${name}.json" 2>&1 | quiet 4
done
# the searched plan's predicted layer makespan against the measured one: the step at half
# the layers too, and the difference per layer (no embedding, LM head or sampling in it)
half=$(( ${LAYERS:-8} / 2 ))
timeout 120 python3 -m nanojax bench step --model random:llama3-8b --num-layers "$half" \
  --plan "$PLAN" --b-dense 2048 --workloads 512/512 --modes overlap --quiet \
  --json "$OUT/step_${half}layers_searched.json" 2>&1 | quiet 2
python3 bench/scripts/prediction_check.py "$PLAN" "$OUT/step_${half}layers_searched.json" \
  "$OUT/step_$(basename "$PLAN" .json).json" --out "$OUT/prediction_check.json" | quiet 6
ls -la "$OUT"
