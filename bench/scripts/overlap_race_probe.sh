#!/bin/bash
# Why the overlap mode's tokens differ from non-overlap's on the GPU (only there): the
# ablation modes and the executor's diagnostics at 4 layers, B_dense 512, on the two
# workloads where the 32-layer run differed most, each mode run twice on the same inputs:
#   keepinputs  side-stream regions also return their inputs (a freed-input race?)
#   keepall     ... every value computed inside them (a region-temporary race?)
#   nogroups    no XLA scheduling groups (regions start and finish in turn)
# then overlap with XLA's parallel async compute limit at 1, and a 1-layer optimized HLO
# dump with its buffer assignment (which buffers a region shares with the main stream).
# Usage: OUT=dir bash bench/scripts/overlap_race_probe.sh
set -u
OUT=${OUT:?set OUT}
export PYTHONPATH=. PYTHONUNBUFFERED=1
step=(python3 -m nanojax bench step --model random:llama3-8b --plan llama3-8b-1gpu
      --decode-kernel "${KERNEL:-triton}"
      --b-dense 512 --workloads "${WORKLOADS:-splitwise,sharegpt}" --repeats 1
      --num-pages 4096 --quiet)
quiet() { grep -v "^[WI]1" | tail -n "$1"; }
timeout 240 "${step[@]}" --num-layers 4 --json "$OUT/race_4layers.json" --modes \
  non-overlap,nanobatch-only,overlap,overlap:1.0:keepinputs,overlap:1.0:keepall,overlap:1.0:nogroups \
  2>&1 | quiet 20
XLA_FLAGS=--xla_gpu_experimental_parallel_async_compute_limit=1 timeout 100 "${step[@]}" \
  --num-layers 4 --modes non-overlap,overlap --json "$OUT/race_4layers_async_limit1.json" \
  2>&1 | quiet 8
timeout 80 "${step[@]}" --num-layers 1 --workloads splitwise --modes overlap \
  --dump-hlo /tmp/hlo1 --json "$OUT/race_1layer_dump.json" 2>&1 | quiet 4
tar czf "$OUT/hlo_1layer_overlap.tgz" -C /tmp hlo1 2>/dev/null
ls -la "$OUT"
