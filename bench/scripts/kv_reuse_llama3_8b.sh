#!/bin/bash
# Issue 21's GPU figures: KV reuse (prefix caching on the GPU pages, host/disk offload) on
# the LLaMA-3-8B shape, random bf16 weights, one H200, the engine as served (no plan,
# every step shape and page-copy shape compiled before the clock: --fixed-shapes). Each
# PART is one process comparing its modes on the same requests (greedy: the JSON's
# same_outputs_as_* says whether reuse changed any token), and fits one 10-minute call.
#   PART=multi   multi-round conversations (CONVS, default 192, of up to ROUNDS turns; each turn adds
#                the previous answer and a new message of IN tokens, answers of OUT) through
#                recompute, prefix (GPU prefix caching) and offload (prefix caching + a
#                HOST_BYTES host tier). The GPU pool is cut to PAGES pages (default 8,192 =
#                131k tokens, ~16 GB) so the histories do not all stay on the GPU and the
#                host tier has work. Throughput counts every prompt token (history
#                included); the JSON also has TTFT of first and returning turns per mode.
#   PART=cost    the offload's cost on a single-round workload (NUM=512 requests of 512/512
#                unless IN/OUT_LEN/TRACE say otherwise; nothing to reuse): recompute (no
#                prefix caching: its own bookkeeping cost), prefix, and offload with the host
#                tier and a disk tier under DISK_DIR, full GPU memory. Target (NanoFlow):
#                offload_over_prefix >= 0.97.
#   PART=serve   time to first token of returning turns online: `nanojax serve` with reuse
#                (prefix + host tier), then without (--no-enable-prefix-caching), each
#                driven by `nanojax bench serve --multi-round` at RATE conversations/s.
#                Each server takes ~2.5 min to compile and listen: ~8 min in all.
# TRACE=sharegpt (or splitwise, lmsys) draws every turn's message and answer lengths from
# that trace instead of IN/OUT: the same rows for the traces.
# Usage: OUT=dir PART=multi|cost|serve [TRACE=sharegpt] bash bench/scripts/kv_reuse_llama3_8b.sh
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=. PYTHONUNBUFFERED=1 NANOJAX_DECODE_KERNEL=${KERNEL:-triton}
TAG=${TRACE:-${IN:-256}_${OUT_LEN:-128}}
if [ -n "${TRACE:-}" ]; then lens=(--trace "$TRACE"); else
  lens=(--input-len "${IN:-256}" --output-len "${OUT_LEN:-128}"); fi
common=(--model random:llama3-8b --quiet --b-dense 2048 --admission predicted --fixed-shapes
        --max-model-len "${MAX_LEN:-4096}")
quiet() { grep -v "^[WI]1" | tail -n "$1"; }
case "${PART:?set PART to multi, cost or serve}" in
multi)
  timeout "${LIMIT1:-570}" python3 -m nanojax bench "${common[@]}" "${lens[@]}" \
    --num-prompts "${CONVS:-192}" --multi-round "${ROUNDS:-4}" --num-pages "${PAGES:-8192}" \
    --reuse-modes recompute,prefix,offload --kv-offload-host-bytes "${HOST_BYTES:-32G}" \
    --json "$OUT/kv_reuse_multi_round_${TAG}.json" 2>&1 | quiet 12
  ;;
cost)
  disk=${DISK_DIR:-/tmp/nanojax_kv_offload}
  rm -rf "$disk"
  if [ -z "${TRACE:-}" ]; then
    lens=(--input-len "${IN:-512}" --output-len "${OUT_LEN:-512}"); TAG=${IN:-512}_${OUT_LEN:-512}; fi
  timeout "${LIMIT1:-570}" python3 -m nanojax bench "${common[@]}" "${lens[@]}" \
    --num-prompts "${NUM:-512}" --multi-round 1 --reuse-modes recompute,prefix,offload \
    --kv-offload-host-bytes "${HOST_BYTES:-32G}" --kv-offload-dir "$disk" \
    --kv-offload-disk-bytes "${DISK_BYTES:-32G}" \
    --json "$OUT/kv_reuse_offload_cost_${TAG}.json" 2>&1 | quiet 12
  rm -rf "$disk"
  ;;
serve)
  port=${PORT:-8123}
  for mode in reuse recompute; do
    if [ $mode = reuse ]; then flags=(--kv-offload-host-bytes "${HOST_BYTES:-32G}")
    else flags=(--no-enable-prefix-caching); fi
    python3 -m nanojax serve --model random:llama3-8b --b-dense 2048 --admission predicted \
      --max-model-len "${MAX_LEN:-4096}" --num-pages "${PAGES:-8192}" --port "$port" \
      --no-access-log "${flags[@]}" > "$OUT/serve_${mode}.log" 2>&1 &
    server=$!
    for _ in $(seq 240); do  # up to 4 minutes to compile and listen
      curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
    timeout "${LIMIT2:-150}" python3 -m nanojax bench serve --base-url "http://127.0.0.1:$port" \
      "${lens[@]}" --num-prompts "${CONVS:-64}" --multi-round "${ROUNDS:-4}" \
      --request-rate "${RATE:-2}" --vocab-size 128256 --quiet \
      --json "$OUT/kv_reuse_serve_${mode}_${TAG}.json" 2>&1 | quiet 20
    kill "$server"; wait "$server" 2> /dev/null
  done
  ;;
esac
ls -la "$OUT"
