#!/bin/bash
# Issue 5's bounded grid: the decode kernels' launch variants at batch 512 / context 1024
# for 66..4096 programs (Triton: keys per step, warps, stages, hand prefetch; then the
# Mosaic GPU kernel: keys per step, steps in flight), then the first LAYERS layers of the
# step with each decode kernel at attention shares 1, 0.5, 0.25 (one process per kernel;
# ratios within a process). For the Mosaic kernel a share is whole SMs: 0.5 = 66 programs.
# Usage: OUT=dir [LAYERS=8] [KERNELS="triton mosaic"] [VARIANT_KERNELS=triton,mosaic] \
#        [STEP_MODES=non-overlap,overlap,overlap:0.5,overlap:0.25] \
#        bash bench/scripts/decode_variants.sh
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout "${LIMIT_VARIANTS:-300}" python3 bench/kernels/bench_decode.py --variants \
  --kernels "${VARIANT_KERNELS:-triton,mosaic}" --out "$OUT/decode_attention_variants_h200.json" 2>&1 | grep -v "^[WI]1" | cut -c1-400 | tail -n 6
for kernel in ${KERNELS-triton mosaic}; do  # KERNELS= : no step
  timeout "${LIMIT_STEP:-150}" python3 -m nanojax bench step --decode-kernel "$kernel" \
    --model random:llama3-8b --num-layers "${LAYERS:-8}" --plan llama3-8b-1gpu \
    --b-dense 2048 --workloads 512/512 --quiet \
    --modes "${STEP_MODES:-non-overlap,overlap,overlap:0.5,overlap:0.25}" \
    --json "$OUT/step_${LAYERS:-8}layers_${kernel}.json" 2>&1 | grep -v "^[WI]1" | tail -n 7
done
ls -la "$OUT"
