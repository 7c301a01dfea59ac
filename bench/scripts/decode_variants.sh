#!/bin/bash
# Issue 5's bounded grid: the decode kernel's launch variants (keys per step, warps,
# stages, hand prefetch) at batch 512 / context 1024 for 66..4096 programs, then the first
# LAYERS layers of the step with and without prefetch at attention shares 1, 0.25, 0.125
# (one process per prefetch setting; ratios within a process).
# Usage: OUT=dir [LAYERS=8] bash bench/scripts/decode_variants.sh
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout "${LIMIT_VARIANTS:-240}" python3 -m pallas_kernels.bench_decode --variants \
  --out "$OUT/decode_variants_h200.json" 2>&1 | grep -v "^[WI]1" | tail -n 4
for pf in 0 1; do
  NANOJAX_DECODE_PREFETCH=$pf timeout "${LIMIT_STEP:-150}" python3 -m nanojax bench step \
    --model random:llama3-8b --num-layers "${LAYERS:-8}" --plan llama3-8b-1gpu \
    --b-dense 2048 --workloads 512/512 --quiet \
    --modes non-overlap,overlap,overlap:0.25,overlap:0.125 \
    --json "$OUT/step_${LAYERS:-8}layers_prefetch${pf}.json" 2>&1 | grep -v "^[WI]1" | tail -n 7
done
ls -la "$OUT"
