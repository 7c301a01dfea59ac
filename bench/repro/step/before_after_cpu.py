"""Issue 45's "no behaviour change" on the CPU: the same greedy requests through a baseline
tree and this tree (SmolLM2-135M, the default model; each run in its own process, the two
trees interleaved), their token ids compared one by one and their throughputs set side by
side. The GPU's before/after of the 8B step is before_after_h200.sh.

Usage: python bench/repro/step/before_after_cpu.py BASE_DIR OUT.json [--rounds 2]
       [--prompts 32] [--input-len 64] [--output-len 32]
BASE_DIR: a plain copy of an earlier commit's packages (`git archive REV nanojax
pallas_kernels search checkpoints | tar x -C BASE_DIR`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parents[3]

# one run: greedy generation of seeded random token-id prompts (no tokenizer or chat
# template between the trees), timed from the first request to the last token
_RUN = r"""
import json, sys, time
import numpy as np
from nanojax import LLM, SamplingParams
n, inp, out = (int(a) for a in sys.argv[1:4])
llm = LLM()
vocab = llm.engine.model_config.vocab_size
rng = np.random.default_rng(0)
prompts = [rng.integers(1, vocab, inp).tolist() for _ in range(n)]
params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
llm.generate(prompts[:2], params, use_tqdm=False)  # compile outside the clock
t0 = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
secs = time.perf_counter() - t0
print(json.dumps({"seconds": secs, "output_tokens_per_s": n * out / secs,
                  "token_ids": [list(o.outputs[0].token_ids) for o in outs]}))
"""


def run(tree: Path, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    p = subprocess.run([sys.executable, "-c", _RUN, str(args.prompts), str(args.input_len),
                        str(args.output_len)], cwd=tree, env=env, capture_output=True,
                       text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for _ in range(args.rounds):  # interleaved: drift on a shared machine hits both
        for name, tree in (("before", args.base.resolve()), ("after", HERE)):
            runs[name].append(run(tree, args))
            print(name, f"{runs[name][-1]['output_tokens_per_s']:.1f} output tokens/s",
                  file=sys.stderr)
    ref = runs["before"][0]["token_ids"]
    same = [sum(a == b for a, b in zip(r["token_ids"], ref)) / len(ref)
            for name in runs for r in runs[name]]
    rates = {k: [r["output_tokens_per_s"] for r in v] for k, v in runs.items()}
    per_round = [a / b for a, b in zip(rates["after"], rates["before"])]
    summary = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "model": "SmolLM2-135M-Instruct (the default), float32 on the CPU, greedy",
        "prompts": args.prompts, "input_len": args.input_len, "output_len": args.output_len,
        "rounds": args.rounds,
        "requests_with_identical_tokens": same,  # each run against the first baseline run
        "output_tokens_per_s": rates,
        "after_over_before_per_round": per_round,
        "after_over_before_median": float(np.median(per_round))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("requests_with_identical_tokens",
                                              "after_over_before_median")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
