#!/bin/bash
# Mixtral-8x7B shape (random bf16 weights, ~93 GB; 12.9B active of 46.7B parameters) on
# one H200. Each PART fits one 10-minute GPU call:
#   PART=probe   the expert GEMM: XLA's ragged_dot against the Mosaic GPU grouped GEMM
#                (a few tilings) and a dense GEMM of the same rows, and the kernel's error
#                on uneven groups (bench/repro/moe/moe_grouped_gemm_probe.py). ~1-2 min.
#   PART=step    one dense iteration (B_dense 2048, workloads 512/512 and splitwise) in
#                the three modes with the hand-written plan nanojax/plans/mixtral-8x7b-1gpu
#                (the 8B plan on the Mixtral signature); % of optimal uses active
#                parameters and the GEMM rate measured here at the expert shapes.
#                Expect ~1-2 min to build the weights, ~3-4 min of compiles (overlap
#                the longest), then seconds of timing: ~6-8 min. If it runs short of
#                the call, drop a workload (WORKLOADS=512/512).
#   PART=engine  128 requests of 512/512 through the engine (--fixed-shapes) and through
#                transformers' generate_batch on a MixtralForCausalLM of the same shape
#                (built in bf16 on the GPU, run first in its own process), one run.
#                Peer capped at PEER_LIMIT s (default 240); ~8-9 min in all.
#   PART=decode  where a small batch's iteration goes: the probe (its decode-sized rows
#                included), then the engine alone on PART=engine's requests with a
#                device timeline of 4 decode-only iterations (--timeline-at 300).
#                ~6-7 min.
# MoE steps run the expert GEMMs through the Mosaic GPU grouped GEMM on Hopper
# (models/moe.py); the step PART also runs non-overlap with XLA's ragged_dot (mode
# non-overlap::xlagrouped) for the A/B. MODES overrides the step's modes.
# PART=engine compiles powers-of-two steps (BUCKET_STEP=2048; 8 shapes, not the GPU's
# default 13): its 128-token decodes and 2,048-token prefill chunks are both powers of two.
# QUANT=fp8 (PART=engine): the experts and projections in FP8 (W8A8, quantized at load;
# the peer stays transformers' bf16 Mixtral: issue 42 item 5); KV=fp8: FP8 pages too.
# PEER=0 (PART=engine): the engine alone, without the peer: on an H100 (80 GB) the FP8
#   Mixtral (~47 GB) fits and transformers' bf16 one (~93 GB) does not.
#   PART=kernels the GPU tests of the grouped GEMMs and the FP8 MoE block (pytest -m gpu;
#                ~1 min; passed on an H100, bench/results/log/fp8.md §98); if it fails
#                on the card at hand, PART=engine QUANT=fp8 with EXTRA="--grouped-gemm
#                xla" runs XLA's ragged_dot instead.
# Usage: OUT=dir PART=probe|step|engine|decode|kernels [QUANT=fp8] [KV=fp8] [EXTRA="flags"]
#   bash bench/repro/moe/moe_mixtral.sh
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
# 93 GB of weights: XLA may take 0.95 of the GPU's memory (its default 0.75 leaves ~12 GB)
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.95}
quiet() { tee -a "$OUT/moe_${PART}.log" | grep -v "^[WI]1" | tail -n "$1"; }  # full log kept
case "${PART:?set PART to probe, step, engine, decode or kernels}" in
probe)
  timeout "${LIMIT1:-400}" python3 bench/repro/moe/moe_grouped_gemm_probe.py \
    "$OUT/moe_grouped_gemm_probe_h200.json" 2>&1 | quiet 8
  ;;
step)
  timeout "${LIMIT1:-560}" python3 -m nanojax bench step --model random:mixtral-8x7b \
    --plan mixtral-8x7b-1gpu --b-dense "${BDENSE:-2048}" --num-pages "${PAGES:-8192}" \
    --workloads "${WORKLOADS:-512/512,splitwise}" --modes "${MODES:-non-overlap,non-overlap::xlagrouped,nanobatch-only,overlap}" \
    --repeats 5 --quiet --json "$OUT/step_mixtral-8x7b_1xh200.json" 2>&1 | quiet 16
  ;;
engine)
  n=${NUM_PROMPTS:-128} peer=(--peer --peer-timeout "${PEER_LIMIT:-240}") name=peer_
  [ "${PEER:-1}" = 0 ] && peer=() name=
  timeout "${LIMIT1:-570}" python3 -m nanojax bench --model random:mixtral-8x7b --quiet \
    --gpu-memory-utilization "${MEM_FRACTION:-0.95}" \
    --b-dense 2048 --admission predicted --fixed-shapes --num-prompts "$n" \
    --input-len 512 --output-len 512 --max-model-len 1024 --max-num-seqs "$n" \
    --token-bucket-step "${BUCKET_STEP:-2048}" ${QUANT:+--quantization "$QUANT"} \
    ${KV:+--kv-cache-dtype "$KV"} ${EXTRA:-} "${peer[@]}" \
    --json "$OUT/engine_${name}mixtral-8x7b_512_512${QUANT:+_$QUANT}.json" 2>&1 | quiet 12
  ;;
kernels)
  timeout "${LIMIT1:-200}" python3 -m pytest -q -p no:cacheprovider -o addopts="" -m gpu \
    tests/test_grouped_matmul_mgpu.py tests/test_fp8_moe.py 2>&1 | quiet 15
  ;;
decode)
  timeout "${LIMIT1:-200}" python3 bench/repro/moe/moe_grouped_gemm_probe.py \
    "$OUT/moe_grouped_gemm_probe_decode_h200.json" 2>&1 | quiet 30
  n=${NUM_PROMPTS:-128}
  timeout "${LIMIT2:-360}" python3 -m nanojax bench --model random:mixtral-8x7b --quiet \
    --gpu-memory-utilization "${MEM_FRACTION:-0.95}" \
    --b-dense 2048 --admission predicted --fixed-shapes --num-prompts "$n" \
    --input-len 512 --output-len 512 --max-model-len 1024 --max-num-seqs "$n" \
    --timeline "$OUT/engine_timeline_mixtral-8x7b.json" --timeline-at 300 \
    --timeline-iterations 4 --json "$OUT/engine_mixtral-8x7b_512_512.json" 2>&1 | quiet 12
  ;;
esac
ls -la "$OUT"
