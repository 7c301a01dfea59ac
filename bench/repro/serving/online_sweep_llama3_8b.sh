#!/bin/bash
# Issue 20 item 6 (NanoFlow Fig. 8): online latency against request rate on the
# LLaMA-3-8B shape (random bf16 weights, one H200). For each PLAN, one `nanojax serve
# --b-dense 2048` (its other settings the GPU defaults), driven trace after trace by
# `nanojax bench serve --request-rates RATES`: ~SWEEP_S seconds of Poisson arrivals per rate, fresh prompts per rate, stopping once the mean normalized latency
# passes 2x the 200 ms/token SLO. One JSON per (trace, plan) and one PNG of all of them.
# Budget: a server start (~2.5 min cold) + ~SWEEP_S x (rates run + drain) per trace; three
# traces at three rates of ~16 s each fit one plan setting in a 10-minute call.
# Usage: OUT=dir [TRACES="splitwise lmsys sharegpt"] [PLANS="none auto"]
#        [RATES=2,4,8,12,16,24,32] [SWEEP_S=40] bash bench/repro/serving/online_sweep_llama3_8b.sh
# RATES_<trace> (RATES_sharegpt=16,24,32, ...) gives one trace its own rates: all three
# traces around their earlier highest rates in one call.
# MODEL, B_DENSE, VOCAB only for a CPU dry run (random:tiny, 64, 512).
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
MODEL=${MODEL:-random:llama3-8b}; B_DENSE=${B_DENSE:-2048}; port=${PORT:-8124}
# one server per plan setting, driven trace after trace: each rate's requests finish before
# the next rate starts, so a trace meets an idle server, and two server starts are saved
for plan in ${PLANS:-none auto}; do
  flags=(); [ "$plan" != none ] && flags=(--plan "$plan")
  python3 -m nanojax serve --model "$MODEL" --b-dense "$B_DENSE" --port "$port" \
    --no-access-log "${flags[@]}" > "$OUT/serve_plan-$plan.log" 2>&1 &
  server=$!
  for _ in $(seq 400); do  # compile, then listen
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 1; done
  for trace in ${TRACES:-splitwise lmsys sharegpt}; do
    tag=${trace}_plan-${plan}
    rates_var=RATES_$trace; rates=${!rates_var:-${RATES:-2,4,8,12,16,24,32}}
    timeout "${LIMIT:-420}" python3 -m nanojax bench serve --base-url "http://127.0.0.1:$port" \
      --trace "$trace" --request-rates "$rates" \
      --sweep-seconds "${SWEEP_S:-40}" --vocab-size "${VOCAB:-128256}" --quiet \
      --json "$OUT/sweep_$tag.json" 2>&1 | grep -v "^[WI]1" | tail -n 12
  done
  kill "$server"; wait "$server" 2> /dev/null
done
python3 -m nanojax.bench.serve_sweep "$OUT"/sweep_*.json --out "$OUT/online_latency_sweep.png"
ls -la "$OUT"
