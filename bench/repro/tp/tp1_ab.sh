#!/bin/bash
# Issue 19 item 5: on ONE GPU, the step at TP=1 through the tensor-parallel code path
# (shard_map over a 1-device 'tp' mesh, nanojax/parallel/tp.py; mode option ':shardmap')
# against today's path, in the same process, LLaMA-3-8B shape (random bf16), B_dense 2048,
# each mode's step timed on the same synthetic batch. Target: shard_map within 2%.
# Usage: bash bench/repro/tp/tp1_ab.sh OUT.json      (about 4-6 minutes on an H200)
set -u
OUT=${1:?usage: tp1_ab.sh OUT.json}
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout "${LIMIT:-570}" python3 -m nanojax bench step --model random:llama3-8b \
  --plan llama3-8b-1gpu --b-dense "${BDENSE:-2048}" --workloads 512/512 \
  --modes "${MODES:-non-overlap,non-overlap::shardmap,overlap,overlap::shardmap}" \
  --repeats 20 --quiet --json "$OUT" 2>&1 | grep -v "^[WI]1" | tail -n 12
python3 - "$OUT" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
t = {r["mode"]: r["step_s"] for r in d["results"] if "step_s" in r}
for m, s in t.items():
    if "shardmap" in m:
        base = m.split(":")[0]
        print(f"{m}: {1e3 * s:.2f} ms vs {base}: {1e3 * t[base]:.2f} ms -> "
              f"{t[base] / s:.4f}x (>= 0.98 passes)")
PY
