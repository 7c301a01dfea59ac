"""FP8 weights and activations (--quantization fp8) on SmolLM2-135M, on the CPU: greedy
agreement and teacher-forced logits distance against the unquantized model (float32
weights, float32 KV), and with an FP8 KV cache on top (nanojax/bench/kv_quality.py).

    python bench/repro/fp8/weights_quality_cpu.py OUT.json [--prompts 64] [--max-tokens 64]
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
    args = ap.parse_args()
    import jax

    from checkpoints.loader import load_model, quantize_bundle
    from nanojax.bench.kv_quality import QUALITY_PROMPTS, measure_variants
    t0 = time.perf_counter()
    float_model = load_model("smollm2-135m", dtype="float32")
    fp8 = quantize_bundle(float_model, "fp8")
    variants = {"float32": (float_model, "auto"), "fp8 weights": (fp8, "auto"),
                "fp8 weights + fp8 kv": (fp8, "fp8"), "bf16 kv (for scale)": (float_model, "bf16")}
    res = measure_variants(variants, "float32", QUALITY_PROMPTS[:args.prompts],
                           args.max_tokens, log=lambda m: print(m, file=sys.stderr, flush=True))
    res = {"command": "python " + " ".join(sys.argv), "model": "smollm2-135m",
           "env": {"jax": jax.__version__, "backend": jax.default_backend(),
                   "python": platform.python_version()},
           "wall_s": time.perf_counter() - t0, **res}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
