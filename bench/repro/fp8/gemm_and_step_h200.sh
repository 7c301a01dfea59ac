#!/bin/bash
# FP8 on one H200 (issue 42), one call: the FP8 projection against torch._scaled_mm at the
# LLaMA-3-8B shapes (bench/kernels/fp8_gemm.py, one process per side), then the
# 32-layer step at B_dense 2048 with bf16 weights, FP8 weights (':fp8w', W8A8 quantized
# from the same random weights) and FP8 weights + FP8 KV in one process, held 2 s per mode
# and workload for power and clock, with a timeline; the step's optimized HLO is searched
# for cuBLASLt's FP8 GEMM. ':fusedquant': the FP8 projections' inputs quantized inside
# RMSNorm and SiLU x up (pallas_kernels/act_quant.py) instead of by XLA's two passes after
# them (KernelConfig.act_quant; its default flips to auto once this measures it faster).
# ':fp8static': static activation scales (one per projection, calibrated through the float
# model; nanojax/models/fp8_calibration.py): no per-token absmax pass at all.
# F32=1: also the float32 step, each mode's logits distance from it (issue 42 item 4: the
# FP8 modes' distance beside bf16's; ~32 GB more weights, a compile more). Its float32
# KV pool of the default 16,384 pages is 69 GB: on an H100 give PAGES=4096 (17 GB; the
# step reads random pages of the pool, so only the pool's size changes) and
# XLA_PYTHON_CLIENT_MEM_FRACTION=0.92.
# KEEP_HLO=1: keep the optimized HLO (gzipped, $OUT/hlo_opt/) to name the fusions.
# Usage: OUT=dir [GEMM=0: skip the GEMM bench] [MODES=...] [WORKLOADS=...] [SUSTAIN=s] [F32=1]
#   [PAGES=n] [KEEP_HLO=1]
#   bash bench/repro/fp8/gemm_and_step_h200.sh
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=. PYTHONUNBUFFERED=1
# twice: each process times one side's kernels on the device (--profile; CUPTI takes one
# profiler a process); the kernel-time ratio is the jax file's rate over the torch file's
# (bench/results/log/fp8.md §96); both files hold both sides' wall rates
for side in jax torch; do
  [ "${GEMM:-1}" = 0 ] || timeout "${LIMIT_GEMM:-150}" python3 bench/kernels/fp8_gemm.py \
    --profile "$side" --out "$OUT/fp8_gemm_h200_$side.json" 2>&1 | grep -v "^[WI]1" | cut -c1-400
done
timeout "${LIMIT_STEP:-400}" python3 -m nanojax bench step --model random:llama3-8b \
  --plan llama3-8b-1gpu --b-dense 2048 --num-pages "${PAGES:-16384}" --workloads "${WORKLOADS:-512/512,sharegpt,lmsys,splitwise}" \
  --modes "${MODES:-non-overlap,non-overlap::fp8w,non-overlap::fp8w:fp8kv,non-overlap::fp8w:fp8kv:fusedquant,non-overlap::fp8w:dotmerge}" \
  --repeats 10 --sustain-seconds "${SUSTAIN:-2}" --timeline "$OUT/timeline_fp8.png" \
  --dump-hlo "$OUT/hlo" ${F32:+--f32-reference} --quiet --json "$OUT/step_fp8_h200.json" 2>&1 \
  | grep -v "^[WI]1" | tail -n 30
for f in "$OUT"/hlo/*after_optimizations.txt; do
  [ -f "$f" ] || continue
  echo "$(basename "$f"): fp8 cublasLt calls $(grep -c 'cublas\$lt\$matmul\$f8' "$f"), other cublas $(grep -c 'custom_call_target="__cublas\$gemm\|custom_call_target="__cublas\$lt\$matmul"' "$f")"
done > "$OUT/hlo_fp8_calls.txt"
cat "$OUT/hlo_fp8_calls.txt" | head -20
if [ "${KEEP_HLO:-0}" = 1 ]; then  # the optimized HLO, gzipped, to name each fusion
  mkdir -p "$OUT/hlo_opt"
  for f in "$OUT"/hlo/*after_optimizations.txt; do
    [ -f "$f" ] && gzip -c "$f" > "$OUT/hlo_opt/$(basename "$f").gz"
  done
fi
rm -rf "$OUT/hlo"
ls -la "$OUT"
