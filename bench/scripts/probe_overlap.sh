#!/bin/bash
# Why does (or doesn't) the overlap mode overlap? Quick variants on the first layers of the
# LLaMA-3-8B shape, each in its own process (XLA flags are per process). Every
# optimized step module is dumped; the JSON holds its side-stream schedule report
# (`nanojax bench hlo-schedule`), and the dumps come back as one hlo.tar.gz.
#   A  the shipped plan: non-overlap, overlap, overlap without XLA scheduling groups
#   B  the same with JAX's profile-guided latency estimation (PGLE)
#   C  the partner GEMMs (o_proj + MLP of the other nano-batch) on stream 2
#   D  the chunked-prefill kernel (the default since §59) and fused RoPE+append (the default
#      since §54)
#   E  the prefill / append kernel benchmark
# Usage: OUT=dir VARIANTS="A D E" LAYERS=4 bash bench/scripts/probe_overlap.sh
set -u
OUT=${OUT:?set OUT}
VARIANTS=${VARIANTS:-A C B D E}
export PYTHONPATH=. PYTHONUNBUFFERED=1
common=(--model random:llama3-8b --num-layers "${LAYERS:-4}" --plan llama3-8b-1gpu
        --b-dense 2048 --workloads 512/512 --quiet)
run() {  # name timeout env... -- args...
  local name=$1 limit=$2; shift 2
  local envs=(); while [[ $1 != -- ]]; do envs+=("$1"); shift; done; shift
  echo "== $name"
  env "${envs[@]}" timeout "$limit" python3 -m nanojax bench step "${common[@]}" "$@" \
      --dump-hlo "$OUT/hlo/$name" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "rc=$?"; grep -v "^W1\|^I1" "$OUT/$name.log" | tail -n 8
  find "$OUT/hlo/$name" -type f ! -name '*after_optimizations.txt' -delete 2>/dev/null
}
for v in $VARIANTS; do case $v in
  A) run A 150 X=1 -- --modes non-overlap,overlap,overlap:1.0:nogroups --timeline "$OUT/tl_A.png" ;;
  B) run B 140 JAX_ENABLE_PGLE=true JAX_PGLE_PROFILING_RUNS=2 -- --modes non-overlap,overlap \
       --repeats 16 ;;
  C) python3 - "$OUT/plan_stream2.json" <<'PY'
import json, sys
from nanojax.pipeline.plan import load_plan
p = load_plan("llama3-8b-1gpu")
for op in p["nano_ops"]:
    if op["op"] in ("o_proj", "mlp") and op["batch"] == 1:
        op["stream"] = 2
p["name"] += "-partners-on-stream-2"
json.dump(p, open(sys.argv[1], "w"), indent=1)
PY
     run C 110 X=1 -- --modes non-overlap,overlap --plan "$OUT/plan_stream2.json" ;;
  D) run D 120 X=1 -- --prefill-kernel --fused-append --modes non-overlap,overlap ;;
  E) echo "== E prefill kernel"
     timeout 80 python3 bench/kernels/bench_decode.py --prefill-only \
       --out "$OUT/prefill_attention_h200.json" > "$OUT/E.log" 2>&1
     echo "rc=$?"; tail -n 6 "$OUT/E.log" ;;
esac; done
rm -f "$OUT"/tl_*.png "$OUT"/tl_*.events.json "$OUT/plan_stream2.json"
(cd "$OUT" && tar czf hlo.tar.gz hlo && rm -rf hlo)
ls -la "$OUT"
