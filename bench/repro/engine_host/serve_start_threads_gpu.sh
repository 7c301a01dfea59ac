#!/bin/bash
# Cold and warm serve starts with warm-up compiling step shapes in threads (EngineConfig
# compile_threads; runner.warmup), against one thread, on the GPU: `nanojax serve --model
# random:llama3-8b --b-dense 2048`, each cold start with its own empty compile cache.
# 1) --compile-threads 1, one cold start; 2) the default (half the cores, at most 8), a
# cold start then a warm one, in CACHE (kept: a benchmark after it starts warm, and the
# warm start's log says how many step shapes it loaded from the step cache).
# Usage: OUT=dir [CACHE=build/jaxcache] bash bench/repro/engine_host/serve_start_threads_gpu.sh  (~5 min)
set -eu
OUT=${OUT:?set OUT}; CACHE=${CACHE:-$PWD/build/jaxcache}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
cmd=(serve --model random:llama3-8b --b-dense 2048 --no-access-log)
python3 bench/repro/engine_host/start_times.py "$OUT/serve_start_threads1.json" --listen --runs 1 \
  --timeout 400 -- "${cmd[@]}" --compile-threads 1
python3 bench/repro/engine_host/start_times.py "$OUT/serve_start_threads_default.json" --listen \
  --runs 2 --timeout 400 --cache-dir "$CACHE" -- "${cmd[@]}"
