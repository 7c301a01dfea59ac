#!/bin/bash
# FP8 KV through the swap-AB decode kernel (keys widened to f16 straight into the WGMMA's
# registers) against Triton's FP8 path and bf16 pages, one call:
#   1. the swap-AB kernel's GPU tests (the FP8 case against the f32 reference), and TESTS
#      (-m gpu: the GPU tests only)
#   2. the decode kernels alone, bf16 and FP8 pages, Triton and swap-AB, one process
#      (fp8_kv_kernels.py --decode-only), at SHAPES
#   3. the 8B step (B_dense 2048, 32 layers, chunked-prefill kernel) with bf16 pages
#      (swap-AB), FP8 pages through Triton and FP8 pages through swap-AB, one process,
#      WORKLOADS, a timeline
# Usage: OUT=dir [SHAPES=512x1024,1024x4096] [WORKLOADS=...] [TESTS=more test paths] \
#          bash bench/scripts/fp8_decode_gpu.sh
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
quiet() { grep -v "^[WI]1" | tail -n "$1"; }
timeout "${LIMIT1:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu -rA --tb=short \
  tests/test_decode_attention_swapab.py ${TESTS:-} > "$OUT/gpu_tests.txt" 2>&1
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.txt" | tail -n 12
timeout "${LIMIT2:-150}" python3 bench/scripts/fp8_kv_kernels.py "$OUT/fp8_decode_kernels.json" \
  --decode-kernels triton,swapab --decode-only --shapes "${SHAPES:-512x1024,1024x4096}" \
  2>&1 | quiet 3
timeout "${LIMIT3:-280}" python3 -m nanojax bench step --model random:llama3-8b \
  --plan llama3-8b-1gpu --b-dense 2048 \
  --workloads "${WORKLOADS:-512/512,sharegpt,lmsys,splitwise}" \
  --decode-kernel auto --prefill-kernel \
  --modes non-overlap,non-overlap::fp8kv,non-overlap::fp8kv:mosaicdecode --repeats 10 --quiet \
  --timeline "$OUT/timeline_fp8.png" --json "$OUT/step_fp8.json" 2>&1 | quiet 14
ls -la "$OUT"
