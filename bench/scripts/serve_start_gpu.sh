#!/bin/bash
# Issue 20 item 3 on the GPU: time until `nanojax serve --model random:llama3-8b
# --b-dense 2048` answers /health, twice with one fresh compile cache (target: the second
# within 30 s; the first compiles every step shape, ~2.5 min before the cache).
# STEP_CACHE=1 adds --step-cache (nanojax/step_cache.py: the second start loads the step
# executables instead of tracing them; its warm-up runs each loaded shape once, so a
# second start that answers /health ran all of them).
# Usage: [STEP_CACHE=1] bash bench/scripts/serve_start_gpu.sh [OUT.json]   (~4-5 minutes)
set -eu
OUT=${1:-bench/results/serve_start_llama3-8b_1xh200.json}
export PYTHONPATH=. PYTHONUNBUFFERED=1
extra=()
[ "${STEP_CACHE:-0}" = 1 ] && extra=(--step-cache)
python3 bench/scripts/start_times.py "$OUT" --listen --runs 2 --timeout 420 -- \
  serve --model random:llama3-8b --b-dense 2048 --no-access-log "${extra[@]}"
