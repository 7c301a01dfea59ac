#!/bin/bash
# Issue 23: a 70B shape with tensor parallelism, one process over the GPUs of one host.
# Default: LLaMA-3-70B shape (random bf16) at TP=2 on two H200s: 65.7 GiB of weights per
# GPU (70.55e9 params x 2 bytes / 2), KV cache 160 KiB per token per GPU (80 layers x 4
# KV heads x 128 x 2 (k, v) x 2 bytes); the step benchmark's 16384 pages x 16 tokens take
# 40 GiB per GPU, the engine sizes its cache from what is left (0.9 of it).
# TP=8 variant (the paper's configuration): bench/scripts/tp_llama2_70b_8gpu.sh.
#
# Usage: OUT=dir PART=step|step1024|sharegpt|engine|8b bash bench/scripts/tp_llama3_70b.sh
# Each part is one call of under 10 minutes (LIMIT, default 560 s):
#   step     : the step at B_dense 2048 on 512/512 in the three modes (non-overlap,
#              nanobatch-only, overlap with the searched plan incl. network nano-ops);
#              % of optimal from both GPUs' GEMM rates measured in the run; timeline PNG
#              (collective time and the share of it under a GEMM: timeline
#              summary 'collective_overlapped_by_gemm'); HLO schedule report (each
#              all-reduce start/done pair and the other nano-batch's GEMMs between)
#   step1024 : the same at B_dense 1024 (no timeline)
#   sharegpt : the same on the sharegpt trace at B_dense 2048
#   engine   : the engine end to end, 256 requests of 512/512, non-overlap and overlap
#   8b       : LLaMA-3-8B shape at TP=2 against TP=1: step with the float32 reference
#              (distance of each to float32) and engine throughput on the same requests
# NUM_LAYERS=8: a first probe on the first 8 layers (compiles and inits 10x faster);
# MODES=...: a subset of modes when a part would run past its call.
set -u
OUT=${OUT:?set OUT}
PART=${PART:-step}
TP=${TP:-2}
MODEL=${MODEL:-llama3-70b}
PLAN=${PLAN:-bench/results/search_tp/plan_${MODEL}_tp${TP}_h200_datasheet.json}
LIMIT=${LIMIT:-560}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.95}
# NVLink multicast stays off (device README), in this process and any it starts
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# async all-reduces placed by the latency-hiding scheduler; no combining of the
# nano-batches' all-reduces into one (that would wait for every nano-batch's GEMM)
export XLA_FLAGS="${TP_XLA_FLAGS:---xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_all_reduce_combine_threshold_bytes=0}"
MODES=${MODES:-non-overlap,nanobatch-only,overlap}
step() {  # step NAME EXTRA_ARGS...
  local name=$1; shift
  timeout "$LIMIT" python3 -m nanojax bench step --model "random:$MODEL" \
    --tensor-parallel-size "$TP" --plan "$PLAN" --modes "$MODES" --repeats 10 --quiet \
    ${NUM_LAYERS:+--num-layers "$NUM_LAYERS"} --json "$OUT/$name.json" "$@" 2>&1 \
    | grep -v "^[WI]1" | tail -n 12
}
case "$PART" in
  step)
    step "step_${MODEL}_tp${TP}_2048" --b-dense 2048 --workloads 512/512 \
      --timeline "$OUT/timeline_${MODEL}_tp${TP}_2048.png" --dump-hlo "$OUT/hlo"
    find "$OUT/hlo" -type f ! -name '*after_optimizations.txt' -delete 2>/dev/null
    (cd "$OUT" && tar czf hlo_${MODEL}_tp${TP}.tar.gz hlo && rm -rf hlo) ;;
  step1024)
    step "step_${MODEL}_tp${TP}_1024" --b-dense 1024 --workloads 512/512 ;;
  sharegpt)
    step "step_${MODEL}_tp${TP}_2048_sharegpt" --b-dense 2048 --workloads sharegpt ;;
  engine)
    timeout "$LIMIT" python3 -m nanojax bench throughput --model "random:$MODEL" \
      --tensor-parallel-size "$TP" --plan "$PLAN" --modes non-overlap,overlap \
      --num-prompts 256 --input-len 512 --output-len 512 --b-dense 2048 \
      --constant-batch --fixed-shapes --admission predicted --quiet \
      --json "$OUT/engine_${MODEL}_tp${TP}_512_512.json" 2>&1 | grep -v "^[WI]1" | tail -n 8 ;;
  8b)
    for tp in 1 2; do
      plan=llama3-8b-1gpu
      [ "$tp" = 2 ] && plan=bench/results/search_tp/plan_llama3-8b_tp2_h200_datasheet.json
      timeout 270 python3 -m nanojax bench step --model random:llama3-8b \
        --tensor-parallel-size $tp --plan $plan --b-dense 2048 --workloads 512/512 \
        --modes non-overlap,overlap --f32-reference --quiet \
        --json "$OUT/step_llama3-8b_tp${tp}_f32ref.json" 2>&1 | grep -v "^[WI]1" | tail -n 4
    done
    for tp in 1 2; do
      timeout 250 python3 -m nanojax bench throughput --model random:llama3-8b \
        --tensor-parallel-size $tp --num-prompts 256 --input-len 512 --output-len 512 \
        --b-dense 2048 --constant-batch --fixed-shapes --quiet \
        --json "$OUT/engine_llama3-8b_tp${tp}_512_512.json" 2>&1 | grep -v "^[WI]1" | tail -n 3
    done ;;
  *) echo "unknown PART $PART" >&2; exit 2 ;;
esac
ls -la "$OUT"
