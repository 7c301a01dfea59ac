#!/bin/bash
# The committed throughput benchmark (bench/results/throughput_llama3-8b_1xh200.json):
# LLaMA-3-8B shape, random bf16 weights, one H200, hand-written plan. Each PART fits one
# GPU call (10 min); then, on any machine, bench/repro/step/merge_throughput.py DIR... merges.
#   PART=step    one dense iteration per mode on steady-state batches of every workload,
#                B_dense 2048, all three modes, with a timeline
#   PART=sweep   the same at B_dense $SWEEP (512,1024,4096), non-overlap and overlap
#   PART=engine  the engine as served (default forward, no plan; batches bucketed to the
#                load, since a constant 2,048-token batch would pad 128 decodes 16x; every
#                shape compiled before the clock starts: --fixed-shapes) end to end on
#                NUM_PROMPTS requests, and the same requests through transformers'
#                generate_batch, in one run (the peer served ~1,100 tokens/s on 128
#                requests; 512 requests did not finish in 200 s). ~5 min.
# Compile time per mode at 32 layers, Triton decode kernel: ~6 s non-overlap, ~12 s
# nanobatch-only, ~50-70 s overlap; with KERNEL=auto (Mosaic GPU) the first two took 52 s
# and 120 s, so PART=step with Mosaic needs LIMIT1 near the whole call.
# EXTRA: more flags for every run. KERNEL: the decode kernel (auto: swap-AB on Hopper; §1
# ran KERNEL=triton, before the chunked-prefill kernel was the default). KV8=1 adds each
# mode again on FP8 pages (mode option fp8kv), in the same process (issue 17 item 5).
# Usage: OUT=dir PART=step|sweep|engine [KERNEL=auto] [EXTRA=flags] [KV8=1]
#          bash bench/repro/step/throughput_llama3_8b.sh
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=. PYTHONUNBUFFERED=1
WORKLOADS=${WORKLOADS:-512/512,1024/512,512/1024,splitwise,lmsys,sharegpt}
# shellcheck disable=SC2206  # EXTRA is a list of flags
kernel=(--decode-kernel "${KERNEL:-auto}" ${EXTRA:-})
model=(--model random:llama3-8b --plan llama3-8b-1gpu --quiet "${kernel[@]}")
quiet() { grep -v "^[WI]1" | tail -n "$1"; }
modes() {  # the modes, and with KV8=1 each again on FP8 pages
  local m=$1
  if [ -n "${KV8:-}" ]; then m="$m,$(echo "$1" | sed 's/\([^,]*\)/\1::fp8kv/g')"; fi
  echo "$m"
}
case "${PART:?set PART to step, sweep or engine}" in
step)
  timeout "${LIMIT1:-540}" python3 -m nanojax bench step "${model[@]}" --b-dense 2048 \
    --workloads "$WORKLOADS" --modes "$(modes non-overlap,nanobatch-only,overlap)" \
    --timeline "$OUT/timeline_llama3-8b_2048_32layers.png" \
    --json "$OUT/step_2048.json" 2>&1 | quiet 24
  ;;
sweep)
  timeout "${LIMIT1:-540}" python3 -m nanojax bench step "${model[@]}" \
    --b-dense "${SWEEP:-512,1024,4096}" --workloads "$WORKLOADS" --modes "$(modes non-overlap,overlap)" \
    --json "$OUT/step_bdense_sweep.json" 2>&1 | quiet 40
  ;;
engine)
  n=${NUM_PROMPTS:-128}
  timeout "${LIMIT1:-540}" python3 -m nanojax bench --model random:llama3-8b --quiet "${kernel[@]}" \
    --b-dense 2048 --admission predicted --fixed-shapes --num-prompts "$n" \
    --input-len 512 --output-len 512 --max-model-len 1024 --max-num-seqs "$n" \
    --peer --peer-timeout "${PEER_LIMIT:-300}" --json "$OUT/engine_peer_512_512.json" \
    2>&1 | quiet 12
  ;;
esac
ls -la "$OUT"
