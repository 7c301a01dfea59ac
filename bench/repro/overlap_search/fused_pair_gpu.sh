#!/bin/bash
# Issue 18 item 2 in one GPU call: nanojax's fused GEMM + attention launch over its GEMM
# share G (bench/kernels/fused_pair.py, jax), then PyTorch's cuBLAS + SDPA on CUDA green
# contexts at the same shapes (green_context_pair.py), then one PNG of both; each bench in
# its own process (jax holds most of the GPU's memory until it exits). A bench cut short by
# its time limit keeps the JSON rows it wrote; the plot draws what is there.
# Usage: OUT=dir bash bench/repro/overlap_search/fused_pair_gpu.sh     (5 files into $OUT, ~8 min on an H200)
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 330 python3 bench/kernels/fused_pair.py --out "$OUT/fused_pair.json" \
    --power-seconds 1 2>&1 | grep -v "^[WI]1" | tee "$OUT/fused_pair.log"
timeout 150 python3 bench/kernels/green_context_pair.py \
    --out "$OUT/green_context_pair.json" --power-seconds 1 2>&1 \
    | tee "$OUT/green_context_pair.log"
python3 bench/kernels/plot_fused_pair.py "$OUT/fused_pair.json" "$OUT/green_context_pair.json" \
    --out "$OUT/fused_pair.png"
