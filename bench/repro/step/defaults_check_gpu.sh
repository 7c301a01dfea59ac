#!/bin/bash
# The GPU defaults and the next candidates in one call:
#   1. the engine's GPU test (tests/test_engine_gpu.py: Pallas backend against pure JAX) and
#      the swap-AB decode kernel's GPU tests (-m gpu: its interpret-mode tests are slow on
#      the GPU box; they ran past LIMIT1 in §59)
#   2. the 8B step (B_dense 2048, swap-AB + chunked-prefill kernels) on WORKLOADS in MODES,
#      one process, a timeline: by default today's defaults (XLA's dot merger off, the
#      fused RoPE + append, §54), the old ones (mode option dotmerge:nofusedappend) and
#      command buffers (cmdbuf)
#   3. the engine end to end, NUM_PROMPTS (128) requests of 512/512 with at most MAX_SEQS
#      (NUM_PROMPTS) running, no peer, with the defaults and, when ENGINE_B is set, again
#      with those flags (e.g. ENGINE_B=--prefill-kernel)
# §57 ran it with MODES=non-overlap,non-overlap::dotmerge:nofusedappend,nanobatch-only and
# no ENGINE_B.
# Usage: OUT=dir [MODES=...] [WORKLOADS=...] [ENGINE_B=flags] [NUM_PROMPTS=n MAX_SEQS=n] \
#          bash bench/repro/step/defaults_check_gpu.sh
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
quiet() { grep -v "^[WI]1" | tail -n "$1"; }
timeout "${LIMIT1:-120}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_engine_gpu.py \
  tests/test_decode_attention_swapab.py > "$OUT/engine_gpu_test.txt" 2>&1
tail -n 3 "$OUT/engine_gpu_test.txt"
modes=${MODES:-non-overlap,non-overlap::dotmerge:nofusedappend,non-overlap::cmdbuf}
timeout "${LIMIT2:-220}" python3 -m nanojax bench step --model random:llama3-8b \
  --plan llama3-8b-1gpu --b-dense 2048 \
  --workloads "${WORKLOADS:-512/512,sharegpt,lmsys,splitwise}" \
  --decode-kernel auto --prefill-kernel --modes "$modes" --repeats 10 --quiet \
  --timeline "$OUT/timeline_defaults.png" --json "$OUT/step_defaults.json" 2>&1 | quiet 16
engine() {  # name limit extra flags...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m nanojax bench --model random:llama3-8b --quiet \
    --b-dense 2048 --admission predicted --fixed-shapes --num-prompts "${NUM_PROMPTS:-128}" \
    --input-len 512 --output-len 512 --max-model-len 1024 \
    --max-num-seqs "${MAX_SEQS:-${NUM_PROMPTS:-128}}" "$@" \
    --json "$OUT/engine_${name}_512_512.json" 2>&1 | quiet 4
}
engine defaults "${LIMIT3:-170}"
if [ -n "${ENGINE_B:-}" ]; then
  # shellcheck disable=SC2086  # ENGINE_B is a list of flags
  engine b "${LIMIT4:-170}" $ENGINE_B
fi
ls -la "$OUT"
