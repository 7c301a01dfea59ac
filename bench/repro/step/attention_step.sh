#!/bin/bash
# Issue 17: the 32-layer step (LLaMA-3-8B shape, random bf16 weights, B_dense 2048) with
# each decode-attention configuration, one process each, one GPU call:
#   triton      the Triton decode kernel, prefill tokens as decode rows (the old default)
#   mosaic      the Mosaic GPU swap-AB decode kernel (the new default on Hopper)
#   mosaic_pf   + the chunked-prefill kernel, all three modes, with a timeline; decode
#               kernel "auto": swap-AB on the main stream, Triton on side streams (with
#               "mosaic" named, the overlap step had not compiled after 330 s)
#   fp8_pf      FP8 KV pages (Triton decode + chunked-prefill kernels), when KV8=1
#   logits_ab   (only when ONLY names it) the LM head's rows, 512/512, non-overlap, Mosaic:
#               the engine's rows (2048 here: 1026 sequences, a power-of-two bucket)
#               against all B_dense tokens (':alllogits', the same shapes: the A/B's noise)
#               and the sequences only (':seqlogits', 1032 rows: finer row buckets' gain)
# Usage: OUT=dir [WORKLOADS=512/512,sharegpt,lmsys,splitwise] [KV8=1] [ONLY="triton mosaic"]
#        bash bench/repro/step/attention_step.sh
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=. PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache
step=(python3 -m nanojax bench step --model random:llama3-8b --plan llama3-8b-1gpu
      --b-dense 2048 --workloads "${WORKLOADS:-512/512,sharegpt,lmsys,splitwise}" --quiet)
quiet() { grep -v "^[WI]1" | tail -n "$1"; }
run() {  # name limit args...
  local name=$1 limit=$2; shift 2
  case " ${ONLY:-triton mosaic mosaic_pf fp8_pf} " in *" $name "*) ;; *) return ;; esac
  echo "== $name"
  timeout "$limit" "${step[@]}" "$@" --json "$OUT/step_$name.json" 2>&1 | quiet 16
}
run triton 150 --decode-kernel triton --no-prefill-kernel --modes non-overlap
run mosaic 200 --decode-kernel mosaic --no-prefill-kernel --modes non-overlap
run mosaic_pf 330 --decode-kernel auto --prefill-kernel \
  --modes non-overlap,nanobatch-only,overlap --timeline "$OUT/timeline_mosaic_pf.png"
run logits_ab 150 --decode-kernel mosaic --no-prefill-kernel --workloads 512/512 \
  --modes non-overlap,non-overlap::alllogits,non-overlap::seqlogits
if [ -n "${KV8:-}" ]; then
  run fp8_pf 150 --decode-kernel triton --prefill-kernel --kv-cache-dtype fp8 --modes non-overlap
fi
ls -la "$OUT"
