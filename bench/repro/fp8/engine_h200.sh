#!/bin/bash
# The engine end to end on TensorRT-LLM's H200 rows (issue 42), one call: LLaMA-3-8B
# shape, random weights, the tuned flags, with FP8 weights + FP8 KV and, on the 128/128
# row, the same requests with bf16 weights and KV in the same call for the ratio.
# ROWS: "in/out/requests" items; each row's requests should be several times what fits.
# Usage: OUT=dir [ROWS="128/128/4096 1000/1000/2048"] [BF16=1] bash bench/repro/fp8/engine_h200.sh
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=. PYTHONUNBUFFERED=1
tuned=(--model random:llama3-8b --b-dense 2048 --admission predicted --fixed-shapes --quiet)
for row in ${ROWS:-128/128/4096 1000/1000/2048}; do
  IFS=/ read -r inp outp n <<< "$row"
  len=$((inp + outp))
  variants="fp8"
  [ "${BF16:-1}" = 1 ] && [ "$inp" = 128 ] && variants="fp8 bf16"
  for v in $variants; do
    q=(--quantization fp8 --kv-cache-dtype fp8)
    [ "$v" = bf16 ] && q=()
    timeout "${LIMIT:-240}" python3 -m nanojax bench throughput "${tuned[@]}" "${q[@]}" \
      --num-prompts "$n" --input-len "$inp" --output-len "$outp" --max-model-len "$len" \
      --json "$OUT/engine_${v}_${inp}_${outp}.json" 2>&1 | grep -v "^[WI]1" | tail -n 6
  done
done
ls -la "$OUT"
