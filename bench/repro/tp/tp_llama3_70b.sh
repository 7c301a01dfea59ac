#!/bin/bash
# Issue 23: a 70B shape with tensor parallelism, one process over the GPUs of one host.
# Default: LLaMA-3-70B shape (random bf16) at TP=2 on two H200s: 65.7 GiB of weights per
# GPU (70.55e9 params x 2 bytes / 2), KV cache 160 KiB per token per GPU (80 layers x 4
# KV heads x 128 x 2 (k, v) x 2 bytes); the step benchmark's 16384 pages x 16 tokens take
# 40 GiB per GPU, the engine sizes its cache from what is left (0.9 of it).
# TP=8 variant (the paper's configuration): bench/repro/tp/tp_llama2_70b_8gpu.sh.
#
# Usage: OUT=dir PART="step engine 8b" bash bench/repro/tp/tp_llama3_70b.sh
# PART lists parts run in order inside one call; each gets what is left of LIMIT (default
# 560 s, one device call) and a part that dies leaves the next to run:
#   step     : the step at every B_DENSE (default 2048) on every WORKLOADS (default
#              512/512,sharegpt) in the three modes (non-overlap, nanobatch-only, overlap
#              with the searched plan incl. network nano-ops), in one process (weights made
#              once); % of optimal from both GPUs' GEMM rates measured in the run; timeline
#              PNG of the first B_dense and workload (collective time and the share of it
#              under a GEMM: 'collective_overlapped_by_gemm'); HLO schedule report (each
#              all-reduce start/done pair and the other nano-batch's GEMMs between)
#   step1024 : the same at B_dense 1024 on 512/512 (no timeline)
#   engine   : the engine end to end, NUM_PROMPTS (default 384) requests of 512/512,
#              non-overlap and overlap
#   8b       : LLaMA-3-8B shape at TP=2 against TP=1: step with the float32 reference
#              (distance of each to float32) and engine throughput on the same requests
#   topo     : nvidia-smi topology and the GPUs' clocks/power (how the GPUs are linked)
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
END=$((SECONDS + LIMIT))
left() { echo $((END - SECONDS > 0 ? END - SECONDS : 1)); }
step() {  # step NAME EXTRA_ARGS...
  local name=$1; shift
  timeout "$(left)" python3 -m nanojax bench step --model "random:$MODEL" \
    --tensor-parallel-size "$TP" --plan "$PLAN" --modes "$MODES" --repeats 10 --quiet \
    ${NUM_LAYERS:+--num-layers "$NUM_LAYERS"} --json "$OUT/$name.json" "$@" 2>&1 \
    | grep -v "^[WI]1" | tail -n 12
}
run_part() {
case "$1" in
  topo)
    nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
    nvidia-smi --query-gpu=index,name,power.limit,clocks.max.sm,pcie.link.gen.current \
      --format=csv >> "$OUT/topo.txt" 2>&1
    nvidia-smi nvlink --status >> "$OUT/topo.txt" 2>&1
    head -n 12 "$OUT/topo.txt" ;;
  step)
    step "step_${MODEL}_tp${TP}" --b-dense "${B_DENSE:-2048}" \
      --workloads "${WORKLOADS:-512/512,sharegpt}" \
      --timeline "$OUT/timeline_${MODEL}_tp${TP}.png" --dump-hlo "$OUT/hlo"
    # the schedule report is in the JSON; the HLO text comes back only if it is small
    find "$OUT/hlo" -type f ! -name '*after_optimizations.txt' -delete 2>/dev/null
    (cd "$OUT" && tar czf hlo_${MODEL}_tp${TP}.tar.gz hlo && rm -rf hlo
     [ "$(stat -c %s hlo_${MODEL}_tp${TP}.tar.gz)" -lt 15000000 ] || rm hlo_${MODEL}_tp${TP}.tar.gz) ;;
  step1024)
    step "step_${MODEL}_tp${TP}_1024" --b-dense 1024 --workloads 512/512 ;;
  engine)
    timeout "$(left)" python3 -m nanojax bench throughput --model "random:$MODEL" \
      --gpu-memory-utilization "${MEM_FRACTION:-0.95}" --tensor-parallel-size "$TP" --plan "$PLAN" --modes non-overlap,overlap \
      --num-prompts "${NUM_PROMPTS:-384}" --input-len 512 --output-len 512 --b-dense 2048 \
      --constant-batch --fixed-shapes --admission predicted --quiet \
      --json "$OUT/engine_${MODEL}_tp${TP}_512_512.json" 2>&1 | grep -v "^[WI]1" | tail -n 8 ;;
  8b)
    for tp in 1 2; do
      plan=llama3-8b-1gpu
      [ "$tp" = 2 ] && plan=bench/results/search_tp/plan_llama3-8b_tp2_h200_datasheet.json
      timeout "$(left)" python3 -m nanojax bench step --model random:llama3-8b \
        --tensor-parallel-size $tp --plan $plan --b-dense 2048 --workloads 512/512 \
        --modes non-overlap,overlap --f32-reference --quiet \
        --json "$OUT/step_llama3-8b_tp${tp}_f32ref.json" 2>&1 | grep -v "^[WI]1" | tail -n 4
    done
    for tp in 1 2; do
      timeout "$(left)" python3 -m nanojax bench throughput --model random:llama3-8b \
        --gpu-memory-utilization "${MEM_FRACTION:-0.95}" --tensor-parallel-size $tp --num-prompts 256 --input-len 512 --output-len 512 \
        --b-dense 2048 --constant-batch --fixed-shapes --quiet \
        --json "$OUT/engine_llama3-8b_tp${tp}_512_512.json" 2>&1 | grep -v "^[WI]1" | tail -n 3
    done ;;
  *) echo "unknown PART $1" >&2; return 2 ;;
esac
}
for part in $PART; do
  echo "== $part ($(left) s left)"
  run_part "$part"
done
ls -la "$OUT"
