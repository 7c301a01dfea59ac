#!/bin/bash
# Do the three modes compute the same function on the GPU? At 4 layers, B_dense 512 and
# 2048, each mode's tokens and logits against non-overlap's and against the same step in
# float32 (--f32-reference), first with XLA's default GEMM kernels, then with Triton GEMM
# fusions off (every GEMM through cuBLAS, as inside the side-stream regions, where XLA
# calls cuBLAS for the GEMMs it gives Triton on the main stream). Then 32 layers, B_dense
# 2048, 512/512: what Triton GEMMs off costs the non-overlap and overlap modes.
# Usage: OUT=dir bash bench/scripts/mode_agreement.sh
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=. PYTHONUNBUFFERED=1
step=(python3 -m nanojax bench step --model random:llama3-8b --plan llama3-8b-1gpu --quiet
      --decode-kernel "${KERNEL:-triton}")
check=(--num-layers 4 --b-dense 512,2048 --workloads "${WORKLOADS:-sharegpt,splitwise}"
       --modes non-overlap,nanobatch-only,overlap --repeats 3 --num-pages 8192 --f32-reference)
quiet() { grep -v "^[WI]1" | tail -n "$1"; }
timeout 150 "${step[@]}" "${check[@]}" --json "$OUT/modes_4layers_default_gemms.json" \
  2>&1 | quiet 14
XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout 150 "${step[@]}" "${check[@]}" \
  --json "$OUT/modes_4layers_cublas_gemms.json" 2>&1 | quiet 14
echo "32 layers at ${SECONDS} s"
for flags in "" "--xla_gpu_enable_triton_gemm=false"; do
  XLA_FLAGS=$flags timeout "${LIMIT32:-150}" "${step[@]}" --b-dense 2048 --workloads 512/512 \
    --modes non-overlap,overlap --repeats 5 \
    --json "$OUT/modes_32layers${flags:+_cublas_gemms}.json" 2>&1 | quiet 4
done
