#!/bin/bash
# Issue 16's "no behaviour change" check: the step and the engine of a baseline tree and of
# this tree, one after the other in one GPU call, each in its own process (LLaMA-3-8B shape,
# random bf16 weights, 32 layers, Triton decode kernel). The baseline is a plain copy of an
# earlier commit's files: `git archive REV nanojax pallas_kernels search checkpoints
# pyproject.toml | tar x -C baseline` (the folder is git-ignored through .git/info/exclude
# and carried with the call). Writes one JSON per run and summary.json with new / old.
# Usage: OUT=dir BASE=baseline [BASE_REV=87a64b6] bash bench/repro/step/same_call_check.sh
set -u
OUT=${OUT:?set OUT}; BASE=${BASE:-baseline}
# one persistent compilation cache for both trees: an unchanged step compiles once
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxcache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
step=(bench step --model random:llama3-8b --plan llama3-8b-1gpu --b-dense 2048
      --workloads 512/512,sharegpt --modes non-overlap,nanobatch-only --repeats 10 --quiet)
engine=(bench --model random:llama3-8b --quiet --b-dense 2048 --admission predicted
        --fixed-shapes --num-prompts 128 --input-len 512 --output-len 512
        --max-model-len 1024 --max-num-seqs 128)
quiet() { grep -v "^[WI]1" | tail -n "$1"; }
here=$PWD
old() { (cd "$BASE" && NANOJAX_DECODE_KERNEL=triton PYTHONPATH=. timeout "$1" python3 -m nanojax "${@:2}"); }
new() { PYTHONPATH="$here" timeout "$1" python3 -m nanojax "${@:2}" --decode-kernel triton; }
echo "== step, baseline ${BASE_REV:-}"; old 200 "${step[@]}" --json "$OUT/step_old.json" 2>&1 | quiet 6
echo "== step, this tree";  new 150 "${step[@]}" --json "$OUT/step_new.json" 2>&1 | quiet 6
echo "== engine, baseline"; old 230 "${engine[@]}" --json "$OUT/engine_old.json" 2>&1 | quiet 3
echo "== engine, this tree"; new 150 "${engine[@]}" --json "$OUT/engine_new.json" 2>&1 | quiet 3
python3 - "$OUT" "${BASE_REV:-}" <<'PY'
import json, sys
from pathlib import Path
out, rev = Path(sys.argv[1]), sys.argv[2]
def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.exists() else None
summary = {"baseline_rev": rev, "step": [], "engine": None}
so, sn = load("step_old.json"), load("step_new.json")
if so and sn:
    old = {(r["workload"], r["mode"]): r for r in so["results"] if "error" not in r}
    for r in sn["results"]:
        k = (r.get("workload"), r["mode"])
        if k in old and "error" not in r:
            summary["step"].append({"workload": k[0], "mode": k[1],
                                    "old_tokens_per_s": old[k]["tokens_per_s"],
                                    "new_tokens_per_s": r["tokens_per_s"],
                                    "new_over_old": r["tokens_per_s"] / old[k]["tokens_per_s"]})
eo, en = load("engine_old.json"), load("engine_new.json")
if eo and en:
    o, n = eo["results"]["async"], en["results"]["async"]
    summary["engine"] = {"old_tokens_per_s": o["total_tokens_per_s"],
                         "new_tokens_per_s": n["total_tokens_per_s"],
                         "new_over_old": n["total_tokens_per_s"] / o["total_tokens_per_s"],
                         "old_compiles_during_run": o["compiles_during_run"],
                         "new_compiles_during_run": n["compiles_during_run"]}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary, indent=1))
PY
