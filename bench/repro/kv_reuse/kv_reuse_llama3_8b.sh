#!/bin/bash
# Issue 21's GPU figures: KV reuse (prefix caching on the GPU pages, host/disk offload) on
# the LLaMA-3-8B shape, random bf16 weights, one H200, the engine as served (no plan;
# every step shape and page-copy shape compiled before the clock: --fixed-shapes). Each
# PART is one process comparing MODES on the same requests (greedy: the JSON's
# same_outputs_as_<first mode> says whether reuse changed any token) and should fit one
# 10-minute call (each mode: ~1-1.5 min of compiles + its run); split MODES over two
# calls if one runs long.
#   PART=multi   multi-round conversations: CONVS (128) conversations of up to ROUNDS (4)
#                turns; each turn adds the previous answer and a new message of IN (256)
#                tokens, answers of OUT_LEN (128). MODES (recompute,prefix,offload):
#                recompute = no prefix caching, prefix = GPU prefix caching, offload =
#                prefix caching + a HOST_BYTES (32G) host tier. The GPU pool is cut to PAGES
#                (8,192 pages = 131k tokens, ~16 GB) so the histories do not all stay on the
#                GPU and the host tier has work. Throughput counts every prompt token
#                (history included); per mode the JSON has prompt_tokens_computed, prefix
#                hits, offload loads, and TTFT of first and of returning turns.
#   PART=cost    the offload's cost on a single-round workload with nothing to reuse: NUM
#                (512) requests of IN/OUT_LEN (512/512 here), full GPU memory, MODES
#                (prefix,offload; add recompute for prefix caching's own bookkeeping cost),
#                offload = host tier + a DISK_BYTES (16G) disk tier under DISK_DIR.
#                Target (NanoFlow): offload_over_prefix >= 0.97.
#   PART=serve   TTFT of returning turns online: for each of MODES (reuse recompute),
#                `nanojax serve` (reuse: prefix caching + host tier; recompute:
#                --no-enable-prefix-caching; PAGES pages), driven by `nanojax bench serve
#                --multi-round ROUNDS` with CONVS (64) conversations at RATE (2)/s. A server
#                compiles for ~2.5 min before it listens: ~4 min per mode.
#   PART=probe   bench/repro/kv_reuse/kv_offload_copy_probe.py: the copy methods against a stand-in
#                engine loop (none, copy_to_host_async, worker np.asarray, pinned, the
#                offloader) and the ways of loading pages back (numpy rows on the loop
#                thread as the offloader does, through pinned memory, staged by a worker),
#                one process (~2-3 min).
# TRACE=sharegpt (or splitwise, lmsys) draws every turn's message and answer lengths from
# that trace instead of IN/OUT_LEN: the same rows for the traces.
# MODEL, B_DENSE, VOCAB (random:llama3-8b, 2048, 128256) only for a CPU dry run (random:tiny).
# Usage: OUT=dir PART=multi|cost|serve|probe [TRACE=sharegpt] [MODES=...] \
#        bash bench/repro/kv_reuse/kv_reuse_llama3_8b.sh
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=. PYTHONUNBUFFERED=1  # decode kernel: --decode-kernel (default auto)
PART=${PART:?set PART to multi, cost, serve or probe}
if [ "$PART" = cost ]; then IN=${IN:-512}; OUT_LEN=${OUT_LEN:-512}; fi
IN=${IN:-256}; OUT_LEN=${OUT_LEN:-128}
if [ -n "${TRACE:-}" ]; then lens=(--trace "$TRACE"); TAG=$TRACE
else lens=(--input-len "$IN" --output-len "$OUT_LEN"); TAG=${IN}_${OUT_LEN}; fi
MAX_LEN=${MAX_LEN:-4096}
MODEL=${MODEL:-random:llama3-8b}; B_DENSE=${B_DENSE:-2048}
common=(--model "$MODEL" --quiet --b-dense "$B_DENSE" --admission predicted --fixed-shapes
        --max-model-len "$MAX_LEN" --max-num-seqs "${SEQS:-512}")
quiet() { grep -v "^[WI]1" | tail -n "$1"; }
# TIMELINE_AT=N (multi, cost): profile 6 iterations of each mode from its N-th; the raw
# traces (engine phases included) for bench/repro/engine_host/engine_host_timeline.py
if [ -n "${TIMELINE_AT:-}" ]; then
  common+=(--timeline "$OUT/kv_${PART}_timeline.json" --timeline-at "$TIMELINE_AT")
fi
case "$PART" in
multi)
  timeout "${LIMIT1:-580}" python3 -m nanojax bench "${common[@]}" "${lens[@]}" \
    --num-prompts "${CONVS:-128}" --multi-round "${ROUNDS:-4}" --num-pages "${PAGES:-8192}" \
    --reuse-modes "${MODES:-recompute,prefix,offload}" \
    --kv-offload-host-bytes "${HOST_BYTES:-32G}" \
    --json "$OUT/kv_reuse_multi_round_${TAG}_$(m=${MODES:-recompute,prefix,offload}; echo ${m//,/-}).json" \
    2>&1 | quiet 12
  ;;
cost)
  disk=${DISK_DIR:-/tmp/nanojax_kv_offload}
  rm -rf "$disk"
  timeout "${LIMIT1:-580}" python3 -m nanojax bench "${common[@]}" "${lens[@]}" \
    --num-prompts "${NUM:-512}" --multi-round 1 --reuse-modes "${MODES:-prefix,offload}" \
    --kv-offload-host-bytes "${HOST_BYTES:-32G}" --kv-offload-dir "$disk" \
    --kv-offload-disk-bytes "${DISK_BYTES:-16G}" \
    --json "$OUT/kv_reuse_offload_cost_${TAG}_$(m=${MODES:-prefix,offload}; echo ${m//,/-}).json" 2>&1 | quiet 12
  du -sh "$disk"; rm -rf "$disk"
  ;;
serve)
  port=${PORT:-8123}
  for mode in ${MODES:-reuse recompute}; do
    if [ "$mode" = reuse ]; then flags=(--kv-offload-host-bytes "${HOST_BYTES:-32G}")
    else flags=(--no-enable-prefix-caching); fi
    python3 -m nanojax serve --model "$MODEL" --b-dense "$B_DENSE" --admission predicted \
      --max-model-len "$MAX_LEN" --num-pages "${PAGES:-8192}" --max-num-seqs "${SEQS:-512}" \
      --port "$port" --no-access-log "${flags[@]}" > "$OUT/serve_${mode}_${TAG}.log" 2>&1 &
    server=$!
    for _ in $(seq 300); do  # up to 5 minutes to compile and listen
      curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
    timeout "${LIMIT2:-150}" python3 -m nanojax bench serve --base-url "http://127.0.0.1:$port" \
      "${lens[@]}" --num-prompts "${CONVS:-64}" --multi-round "${ROUNDS:-4}" \
      --request-rate "${RATE:-2}" --vocab-size "${VOCAB:-128256}" --quiet \
      --json "$OUT/kv_reuse_serve_${mode}_${TAG}.json" 2>&1 | quiet 24
    curl -s "http://127.0.0.1:$port/metrics" | grep -E "prefix_cache|kv_offload" \
      > "$OUT/serve_${mode}_${TAG}_metrics.txt"
    kill "$server"; wait "$server" 2> /dev/null
  done
  ;;
probe)  # how each way of copying pages to the host disturbs a stand-in engine loop (~2 min)
  timeout "${LIMIT1:-300}" python3 bench/repro/kv_reuse/kv_offload_copy_probe.py \
    "$OUT/kv_offload_copy_probe.json" 2>&1 | quiet 14
  ;;
*) echo "PART must be multi, cost, serve or probe" >&2; exit 2 ;;
esac
ls -la "$OUT"
