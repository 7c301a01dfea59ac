"""FP8 KV cache quality on SmolLM2-135M (float32 weights), on the CPU: greedy agreement
and teacher-forced logits distance against a bf16 KV cache (nanojax/bench/kv_quality.py).

    python bench/repro/fp8/kv_quality_cpu.py OUT.json [--prompts 64] [--max-tokens 64]

Compares fp8 and float32 caches with the bf16 one (float32 vs bf16 is the yardstick: how
far the bf16 cache itself is from exact). Writes OUT.json with the command and timings.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtypes", default="fp8,float32")
    ap.add_argument("--baseline", default="bf16")
    args = ap.parse_args()
    import jax

    from checkpoints.loader import load_model
    from nanojax.bench.kv_quality import QUALITY_PROMPTS, measure
    t0 = time.perf_counter()
    bundle = load_model("smollm2-135m", dtype="float32")
    res = measure(bundle, QUALITY_PROMPTS[:args.prompts], args.max_tokens,
                  tuple(args.dtypes.split(",")), args.baseline,
                  log=lambda m: print(m, file=sys.stderr, flush=True))
    res = {"command": "python " + " ".join(sys.argv), "model": "smollm2-135m",
           "weights": "float32", "env": {"jax": jax.__version__,
                                         "backend": jax.default_backend(),
                                         "python": platform.python_version()},
           "wall_s": time.perf_counter() - t0, **res}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "baseline_cache_values"},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
