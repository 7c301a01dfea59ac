#!/bin/bash
# The engine end to end on TensorRT-LLM's H200 rows (issue 42), one call: LLaMA-3-8B
# shape, random weights, the tuned flags, with FP8 weights + FP8 KV and, on the 128/128
# row, the same requests with bf16 weights and KV in the same call for the ratio.
# ROWS: "in/out/requests[/limit_s]" items; each row's requests should be several times what
# fits; limit_s (default LIMIT, 240) bounds the row's process.
# Each row runs in its own process; they share jax's compilation cache (NANOJAX_COMPILE_CACHE,
# default here /tmp/nanojax_compile), which also holds XLA's per-fusion autotuning results
# (jax puts them in its xla_gpu_per_fusion_autotune_cache_dir: an XLA_FLAGS value for that
# is overridden), so only the first row pays for the FP8 GEMMs' autotuning (§68).
# CACHE_SAVE=1 leaves in $OUT/compile_cache.tgz.* (15 MB parts) those results and the
# cache's smaller programs (1 MiB or less: weight init, quantization, samplers; the step
# executables, ~100 MB, stay); CACHE_SEED=dir puts such parts in place first (a carried
# folder on a fresh machine of the same card: a cold H100 spent ~99 s before its warm-up
# and 228 s in it, fp8.md §91). Reassemble nothing: the script reads the parts.
# Usage: OUT=dir [ROWS="128/128/4096 1000/1000/2048"] [BF16=1] [LIMIT=s] [AB="flags"] [MAX_LEN=n] [RUN_S=s] [EXTRA="flags"] [CACHE_SAVE=1] [CACHE_SEED=dir] bash bench/repro/fp8/engine_h200.sh
# A code change A/B in one lease: `git archive BASE | tar -x -C .abase` (a folder git ignores;
# leave out bench/results and tests: a call carries 64 MiB), carry .abase, and run this
# script inside it in a second call on the same warm machine (bench/results/log/fp8.md §93).
# A row stopped by its limit (SIGTERM from timeout) or by RUN_S (the bench's --time-limit on
# the timed run) still writes its JSON, marked "complete": false, with its steady window.
# MAX_LEN: one --max-model-len for every row (the same step shapes: later rows load them
# from the step cache instead of compiling; default: each row's in + out). For rows of like
# lengths only: the decode batch is sized from the KV cache at half of it (MAX_LEN=4096
# held 128/128 to 445 sequences on an H100, bench/results/log/fp8.md §91).
# TensorRT-LLM's four rows at ~2-3x what fits with FP8 KV on the H200 (107,292 pages at
# 0.9 of the card), one call (10 minutes) each:
#   ROWS="128/128/8192/430"  ROWS="1000/1000/3000/560"  ROWS="500/2000/3000/590"  ROWS="2048/2048/1500/590"
# A row with a new max_model_len compiles its fixed shapes first (~100 s on a warm
# autotune cache, bench/results/log/fp8.md §86; 13 shapes since the GPU's steps of 256,
# 211 s on a fresh H100 with CACHE_SEED, §94): 2048/2048 needs a limit well past 260 s.
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT"  # (a missing OUT failed each run at its end, copying its profile there)
export PYTHONPATH=. PYTHONUNBUFFERED=1
export NANOJAX_COMPILE_CACHE=${NANOJAX_COMPILE_CACHE:-/tmp/nanojax_compile}
if [ -n "${CACHE_SEED:-}" ] && ! compgen -G "$CACHE_SEED/compile_cache.tgz.*" >/dev/null; then
  echo "CACHE_SEED=$CACHE_SEED holds no compile_cache.tgz.* parts" >&2; exit 2
fi
if [ -n "${CACHE_SEED:-}" ]; then
  mkdir -p "$NANOJAX_COMPILE_CACHE" && cat "$CACHE_SEED"/compile_cache.tgz.* | tar xzf - -C "$NANOJAX_COMPILE_CACHE" \
    && echo "compile cache seeded: $(find "$NANOJAX_COMPILE_CACHE" -type f | wc -l) files"
fi
tuned=(--model random:llama3-8b --b-dense 2048 --admission predicted --fixed-shapes --quiet)
for row in ${ROWS:-128/128/4096 1000/1000/2048}; do
  IFS=/ read -r inp outp n limit <<< "$row"
  len=$((inp + outp))
  variants="fp8"
  [ "${BF16:-1}" = 1 ] && [ "$inp" = 128 ] && variants="fp8 bf16"
  [ -n "${AB:-}" ] && variants="$variants fp8ab"
  variants=${VARIANTS:-$variants}  # e.g. VARIANTS=fp8ab: the A/B row alone (its own limit)
  for v in $variants; do
    q=(--quantization fp8 --kv-cache-dtype fp8)
    [ "$v" = bf16 ] && q=()
    # AB="flags": the FP8 row again with them, in the same call (e.g. AB="--full-step-row-shapes 1")
    [ "$v" = fp8ab ] && read -r -a ab <<< "$AB" && q+=("${ab[@]}")
    tl=()  # TIMELINE_AT=N: a profile of 6 iterations from the N-th (in the steady window)
    [ -n "${TIMELINE_AT:-}" ] && tl=(--timeline "$OUT/engine_${v}_${inp}_${outp}.events.json"
                                     --timeline-at "$TIMELINE_AT")
    read -r -a extra <<< "${EXTRA:-}"  # EXTRA="flags": every variant (e.g. --num-layers 8)
    timeout "${limit:-${LIMIT:-240}}" python3 -m nanojax bench throughput "${tuned[@]}" "${q[@]}" "${extra[@]}" \
      --num-prompts "$n" --input-len "$inp" --output-len "$outp" --max-model-len "${MAX_LEN:-$len}" \
      ${RUN_S:+--time-limit "$RUN_S"} "${tl[@]}" \
      --json "$OUT/engine_${v}_${inp}_${outp}.json" 2>&1 | grep -v "^[WI]1" | tail -n 6
    echo "row $row $v done at $SECONDS s"
  done
done
if [ "${CACHE_SAVE:-0}" = 1 ] && [ -d "$NANOJAX_COMPILE_CACHE" ]; then
  rm -f "$OUT"/compile_cache.tgz.*  # (an earlier save's parts would be joined on)
  (cd "$NANOJAX_COMPILE_CACHE" && find . -type f -size -2M -print0 | tar czf - --null -T -) \
    | split -b 15M - "$OUT/compile_cache.tgz."
  echo "compile cache saved: $(du -ch "$OUT"/compile_cache.tgz.* | tail -1)"
fi
ls -la "$OUT"
