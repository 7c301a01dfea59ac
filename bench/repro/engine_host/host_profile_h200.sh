#!/bin/bash
# Where the engine's host time goes on the H200 (issue 43 item 1, "measure first"): the
# host loop alone around a stand-in model at 1,000 / 2,000 / 4,000 running requests
# (`nanojax bench host`), then the 8B engine (random weights, bf16, the tuned flags) on
# 4,096 requests of 128/128 with Python's profiler over 100 steady iterations, with and
# without the step executable cache (is calling a loaded executable slower?).
# BASE=dir: the same engine row from another tree first (e.g. `git archive <commit>`
# unpacked there), in the same call, for the before/after ratio (without the profiler).
# Usage: OUT=dir [BASE=dir] [VARIANTS="step_cache no_step_cache"] bash bench/repro/engine_host/host_profile_h200.sh
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -m nanojax bench host --running ${RUNNING:-1000,2000,4000} --json "$OUT/host_mock.json" \
  2>&1 | grep "^running"
common=(--model random:llama3-8b --num-prompts 4096 --input-len 128 --output-len 128
        --max-model-len 256 --b-dense 2048 --admission predicted --fixed-shapes --quiet
        --timeline-at 250 --timeline-iterations 100)
if [ -n "${BASE:-}" ]; then
  (cd "$BASE" && PYTHONPATH=. timeout "${LIMIT:-240}" python3 -m nanojax bench throughput \
    "${common[@]:0:${#common[@]}-4}" --json "$OUT/engine_base.json" 2>&1 | grep -v "^[WI]1" | tail -n 4)
fi
for v in ${VARIANTS:-step_cache no_step_cache}; do
  flags=()
  [ "$v" = no_step_cache ] && flags=(--no-step-cache)
  timeout "${LIMIT:-240}" python3 -m nanojax bench throughput "${common[@]}" "${flags[@]}" \
    --host-profile "$OUT/engine_$v.prof" --json "$OUT/engine_$v.json" 2>&1 \
    | grep -v "^[WI]1" | tail -n 4
done
ls "$OUT"
