#!/bin/bash
# Issue 45's "no behaviour change" check: the 8B step (LLaMA-3-8B shape, random bf16
# weights, B_dense 2048, 512/512 and sharegpt, non-overlap) of a baseline tree and of this
# tree, each in its own process, in one GPU call, with the default kernels. The baseline
# is a plain copy of an earlier commit's files (`git archive REV | tar x -C BASE`).
# Usage: OUT=dir BASE=dir [WORKLOADS=512/512] bash bench/repro/step/before_after_h200.sh
set -u
OUT=${OUT:?set OUT}; BASE=${BASE:?set BASE}
export PYTHONUNBUFFERED=1
step=(bench step --model random:llama3-8b --plan llama3-8b-1gpu --b-dense 2048
      --workloads ${WORKLOADS:-512/512,sharegpt} --modes non-overlap --repeats 10 --quiet)
here=$PWD
(cd "$BASE" && PYTHONPATH=. timeout "${LIMIT:-170}" python3 -m nanojax "${step[@]}" \
  --json "$OUT/step_before.json" 2>&1 | grep -v "^[WI]1" | tail -n 4)
PYTHONPATH="$here" timeout "${LIMIT:-170}" python3 -m nanojax "${step[@]}" \
  --json "$OUT/step_after.json" 2>&1 | grep -v "^[WI]1" | tail -n 4
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {}
for name in ("before", "after"):
    p = out / f"step_{name}.json"
    if p.exists():
        for r in json.loads(p.read_text())["results"]:
            if "error" not in r:
                rows.setdefault((r["workload"], r["mode"]), {})[name] = r["tokens_per_s"]
summary = [{"workload": w, "mode": m, **v, "after_over_before": v["after"] / v["before"]}
           for (w, m), v in rows.items() if len(v) == 2]
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary))
PY
