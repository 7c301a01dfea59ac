#!/bin/bash
# Issue 20 item 3 on the CPU: wall time of a first and a second `nanojax generate` sharing
# one fresh compile cache (target: second <= 0.6 x first); 3 trials for the spread.
# Usage: bash bench/repro/engine_host/compile_cache_cpu.sh [OUT.json]   (~2-4 minutes on 2 cores)
set -eu
OUT=${1:-bench/results/compile_cache_cpu.json}
export PYTHONPATH=. PYTHONUNBUFFERED=1
python3 bench/repro/engine_host/start_times.py "$OUT" --runs 2 --trials "${TRIALS:-3}" -- \
  generate "Hello" --max-tokens 16
