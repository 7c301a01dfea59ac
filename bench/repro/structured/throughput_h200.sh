#!/bin/bash
# Structured outputs' cost on the H200 (issue 44), one call: offline throughput of the
# LLaMA-3-8B shape (random weights, B_dense 2048, predicted admission, fixed shapes) on
# ShareGPT lengths with 0%, 25% and 100% of the requests under a JSON schema, one process
# each. Target: 100% >= 0.9x the 0% run's throughput.
#
# The schema is the bench's default, an array of integers that may not close before
# 100,000 items (`nanojax bench throughput --help`), so every request runs to its
# ShareGPT output length in all three runs and the token counts match.
#
# A tokenizer for the grammar: random:llama3-8b has none, so the grammars are compiled
# against SmolLM2's (--tokenizer, 49,152 ids) with the model's vocabulary of 128,256: the
# masks allow only ids under 49,152 (ids past a tokenizer are never allowed, as for any
# model whose vocabulary is padded past its tokenizer's), and outputs are not
# detokenized in any run (the engine itself still has no tokenizer). The device runs
# the same forward in every run (plus the mask's select in a constrained step's sampler);
# the host's matchers and masks are the cost measured.
#
# llguidance is not installed on the GPU machine (Python 3.12, no downloads): carry its
# wheel and the tokenizer in .whl/ (git-ignored). Before the call, in the repo root:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl llguidance==1.9.1
#   mkdir -p .whl/smollm2-tokenizer && python3 -c "from pathlib import Path; \
#     from nanojax.bench.workload import load_tokenizer; \
#     load_tokenizer('smollm2-135m').save(Path('.whl/smollm2-tokenizer'))"
# (the 1.9.1 wheel is tagged cp39-abi3-manylinux_2_31: without that --platform pip finds
# none). Then, on the device (which sets $OUT), with carry [".whl"] and timeout 600:
#   bash bench/repro/structured/throughput_h200.sh
# N: requests per run (default 2048); LIMIT0 / LIMIT: seconds for the first process (it
# compiles every step shape) and each later one (persistent and step caches warm); MODEL,
# B_DENSE, EXTRA (more flags): a CPU smoke test (MODEL=random:smollm2-135m B_DENSE=64 N=2
# EXTRA="--max-model-len 128").
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
set -u
OUT=${OUT:?set OUT}
export PYTHONUNBUFFERED=1
python3 -c "import llguidance; print('llguidance', llguidance.__version__)" || exit 1
N=${N:-2048}
args=(--model "${MODEL:-random:llama3-8b}" --b-dense "${B_DENSE:-2048}" --admission predicted --fixed-shapes
      --trace sharegpt --num-prompts "$N" --tokenizer .whl/smollm2-tokenizer --quiet ${EXTRA:-})
limit=${LIMIT0:-230}
for F in 0 0.25 1; do
  start=$(date +%s)
  timeout "$limit" python3 -m nanojax bench throughput "${args[@]}" --structured-fraction "$F" \
    --json "$OUT/structured_$F.json" 2>&1 | grep -v "^[WI]1" | grep -v '^{"results"' | tail -n 5
  echo "F=$F: $(( $(date +%s) - start )) s"
  limit=${LIMIT:-170}
done
python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {}
for f in ("0", "0.25", "1"):
    p = out / f"structured_{f}.json"
    if p.is_file() and "partial" not in (d := json.loads(p.read_text())):
        r = d["results"]["async"]
        runs[f] = {k: r[k] for k in ("total_tokens_per_s", "output_tokens_per_s",
                                     "output_tokens", "wall_s", "iterations",
                                     "host_ms_per_iteration", "device_wait_share",
                                     "compiles_during_run", "warmup_s", "preemptions")}
        runs[f]["steady_tokens_per_s"] = r["steady_state"].get("tokens_per_s")
        runs[f]["finish_reasons"] = r["structured"]["finish_reasons"]
base = runs.get("0", {}).get("total_tokens_per_s")
summary = {"runs": runs, "over_unconstrained": {
    f: r["total_tokens_per_s"] / base for f, r in runs.items() if base}}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary["over_unconstrained"]))
EOF
ls -la "$OUT"
