#!/bin/bash
# Issue 17 item 4: the rest of the step. The 32-layer LLaMA-3-8B-shape step (random bf16,
# B_dense 2048, 512/512, swap-AB decode + chunked-prefill kernels: §23's 59.9% setup) in one
# process in MODES (default: today's defaults, XLA's dot merger off, against it on: mode
# option dotmerge; §54 ran it when the merger was on by default), a timeline of each, and
# the optimized HLO of the step kept (gzipped) to name the non-GEMM fusions. E.g.
# MODES=non-overlap,non-overlap::cmdbuf for the command buffers' A/B.
# Usage: OUT=dir [MODES=...] [EXTRA="--no-fused-append"] bash bench/scripts/step_rest_ab.sh
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
hlo=/tmp/step_hlo
rm -rf "$hlo"
timeout "${LIMIT1:-420}" python3 -m nanojax bench step --model random:llama3-8b \
  --plan llama3-8b-1gpu --b-dense 2048 --workloads "${WORKLOADS:-512/512}" \
  --decode-kernel auto --prefill-kernel ${EXTRA:-} \
  --modes "${MODES:-non-overlap,non-overlap::dotmerge}" --repeats 20 --quiet \
  --dump-hlo "$hlo" --timeline "$OUT/timeline_rest_ab.png" --json "$OUT/step_rest_ab.json" \
  2>&1 | grep -v "^[WI]1" | tail -n 20
# the optimized modules of the step (one per mode), largest first, gzipped
ls -S "$hlo"/*after_optimizations.txt 2>/dev/null | head -2 | while read -r f; do
  gzip -c "$f" > "$OUT/$(basename "$f" | cut -c1-80).gz"; done
ls -la "$OUT"
