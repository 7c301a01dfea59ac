#!/bin/bash
# Today's GPU defaults (XLA's dot merger off, the fused RoPE + append; §54) in one call:
#   1. the engine's GPU test (tests/test_engine_gpu.py: Pallas backend against pure JAX)
#   2. the 8B step (B_dense 2048, swap-AB + chunked-prefill kernels) on 512/512 and the
#      three traces: non-overlap with the defaults, with the old ones
#      (non-overlap::dotmerge:nofusedappend) and nanobatch-only, one process, a timeline
#   3. the engine end to end with the defaults, 128 requests of 512/512 (no peer)
# Usage: OUT=dir bash bench/scripts/defaults_check_gpu.sh
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
quiet() { grep -v "^[WI]1" | tail -n "$1"; }
timeout "${LIMIT1:-90}" python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py \
  > "$OUT/engine_gpu_test.txt" 2>&1
tail -n 3 "$OUT/engine_gpu_test.txt"
timeout "${LIMIT2:-220}" python3 -m nanojax bench step --model random:llama3-8b \
  --plan llama3-8b-1gpu --b-dense 2048 \
  --workloads "${WORKLOADS:-512/512,sharegpt,lmsys,splitwise}" \
  --decode-kernel auto --prefill-kernel \
  --modes non-overlap,non-overlap::dotmerge:nofusedappend,nanobatch-only --repeats 10 --quiet \
  --timeline "$OUT/timeline_defaults.png" --json "$OUT/step_defaults.json" 2>&1 | quiet 16
timeout "${LIMIT3:-170}" python3 -m nanojax bench --model random:llama3-8b --quiet \
  --b-dense 2048 --admission predicted --fixed-shapes --num-prompts 128 \
  --input-len 512 --output-len 512 --max-model-len 1024 --max-num-seqs 128 \
  --json "$OUT/engine_defaults_512_512.json" 2>&1 | quiet 6
ls -la "$OUT"
