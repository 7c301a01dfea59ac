"""The tokens a scheduler change must not change: greedy outputs (per-request digests) of
random:tiny on saturated workloads, with both admission policies, written to a JSON file.
Run it once per scheduler (e.g. with an older nanojax/engine/scheduler.py in place) and
compare the files' "digests". Tiny shapes, fixed shapes: ~1 minute on the CPU.

Usage: PYTHONPATH=. python bench/scripts/scheduler_token_check.py OUT.json
"""
import json
import sys

from checkpoints.loader import load_model
from nanojax.bench.offline import run_offline
from nanojax.bench.workload import make_requests
from nanojax.engine.llm_engine import EngineConfig, LLMEngine

# (KV pages of 4 tokens, requests, prompt, output): the cache fits the steady state; the
# cache too small for it (KV-bound, greedy admission preempts)
WORKLOADS = ((480, 150, 32, 32), (300, 100, 20, 40))


def main(path: str) -> None:
    bundle = load_model("random:tiny", dtype="float32")
    out = {}
    for admission in ("predicted", "greedy"):
        for pages, n, prompt, output in WORKLOADS:
            eng = LLMEngine(bundle, EngineConfig(
                b_dense=64, page_size=4, num_pages=pages, max_model_len=64,
                admission=admission, fixed_shapes=True))
            reqs = make_requests(n, bundle.config.vocab_size, prompt, output, seed=3)
            r = run_offline(eng, reqs, progress=False)
            out[f"{admission}_{pages}_pages_{prompt}_{output}"] = {
                "iterations": r["iterations"], "preemptions": r["preemptions"],
                "steady_mean_fill": r["steady_state"].get("mean_fill"),
                "digests": r["output_digests"]}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: {kk: v for kk, v in r.items() if kk != "digests"}
                      for k, r in out.items()}))


if __name__ == "__main__":
    main(sys.argv[1])
