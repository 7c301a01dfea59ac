#!/bin/bash
# The committed step benchmark (bench/results/step_llama3-8b_1xh200.json and the timeline):
# one dense iteration of each pipeline mode, LLaMA-3-8B shape, random bf16 weights, in one
# process; then the same with the opt-in Pallas prefill kernel and fused RoPE+append (the
# fused append has been the GPU default since §54: both runs have it unless told otherwise).
# Usage: OUT=dir [BDENSE=2048] [WORKLOADS=512/512,splitwise] bash bench/scripts/step_llama3_8b.sh
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=. PYTHONUNBUFFERED=1
args=(--model random:llama3-8b --plan llama3-8b-1gpu --b-dense "${BDENSE:-2048}"
      --workloads "${WORKLOADS:-512/512,splitwise}" --quiet)
timeout "${LIMIT1:-300}" python3 -m nanojax bench step "${args[@]}" \
  --modes non-overlap,nanobatch-only,overlap,overlap:1.0:nogroups \
  --timeline "$OUT/timeline_llama3-8b_2048.png" --dump-hlo "$OUT/hlo" \
  --json "$OUT/step_llama3-8b_1xh200.json" 2>&1 | grep -v "^[WI]1" | tail -n 14
if [ -n "${KERNELS:-1}" ]; then
  timeout "${LIMIT2:-200}" python3 -m nanojax bench step "${args[@]}" \
    --prefill-kernel --fused-append --modes non-overlap,overlap \
    --json "$OUT/step_llama3-8b_1xh200_kernels.json" 2>&1 | grep -v "^[WI]1" | tail -n 8
fi
find "$OUT/hlo" -type f ! -name '*after_optimizations.txt' -delete 2>/dev/null
(cd "$OUT" && tar czf hlo.tar.gz hlo && rm -rf hlo)
ls -la "$OUT"
