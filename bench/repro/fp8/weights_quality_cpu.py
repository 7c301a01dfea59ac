"""FP8 weights and activations (--quantization fp8) on SmolLM2-135M, on the CPU: greedy
agreement and teacher-forced logits distance against the unquantized model (float32
weights, float32 KV), and with an FP8 KV cache on top (nanojax/bench/kv_quality.py).
--static also scores FP8 weights with static activation scales (one input_scale per
projection, nanojax/models/fp8_calibration.py) calibrated on the float model's greedy
continuations of CALIBRATION_PROMPTS, which the scored prompts do not include.

    python bench/repro/fp8/weights_quality_cpu.py OUT.json [--prompts 64] [--max-tokens 64]
        [--static] [--no-fp8-kv]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

# calibration text for --static: raw prompts of other topics than QUALITY_PROMPTS'
CALIBRATION_PROMPTS = [
    "The museum's new exhibit features", "To change a flat tire, you need",
    "The committee met on Tuesday to discuss", "class Stack:\n    def __init__(self):",
    "Glaciers are formed when", "The novel opens with a description of",
    "In economics, inflation refers to", "The train left the station at",
    "A good night's sleep depends on", "The recipe for bread requires flour,",
    "Honeybees communicate by", "The referee blew the whistle and",
    "Quantum computers differ from classical ones because", "Our quarterly report shows",
    "The old lighthouse stood", "SELECT COUNT(*) FROM orders GROUP BY",
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--static", action="store_true",
                    help="also FP8 weights with calibrated static activation scales")
    ap.add_argument("--no-fp8-kv", action="store_true",
                    help="skip the FP8 KV and bf16 KV variants")
    args = ap.parse_args()
    import jax

    from checkpoints.loader import load_model, quantize_bundle
    from nanojax.bench.kv_quality import QUALITY_PROMPTS, greedy_generations, measure_variants
    t0 = time.perf_counter()
    float_model = load_model("smollm2-135m", dtype="float32")
    fp8 = quantize_bundle(float_model, "fp8")
    variants = {"float32": (float_model, "auto"), "fp8 weights": (fp8, "auto")}
    if not args.no_fp8_kv:
        variants.update({"fp8 weights + fp8 kv": (fp8, "fp8"),
                         "bf16 kv (for scale)": (float_model, "bf16")})
    calibration = None
    if args.static:
        from nanojax.models.fp8_calibration import input_absmax, with_static_scales
        ids, gens, _ = greedy_generations(float_model, CALIBRATION_PROMPTS, args.max_tokens,
                                          "auto")
        absmax = input_absmax(float_model, [p + g for p, g in zip(ids, gens)])
        variants["fp8 weights, static activation scales"] = (
            with_static_scales(fp8, absmax), "auto")
        calibration = {"prompts": len(CALIBRATION_PROMPTS), "tokens_each": args.max_tokens,
                       "input_absmax": {"/".join(k): v for k, v in sorted(absmax.items())}}
    res = measure_variants(variants, "float32", QUALITY_PROMPTS[:args.prompts],
                           args.max_tokens, log=lambda m: print(m, file=sys.stderr, flush=True))
    res = {"command": "python " + " ".join(sys.argv), "model": "smollm2-135m",
           "env": {"jax": jax.__version__, "backend": jax.default_backend(),
                   "python": platform.python_version()},
           "wall_s": time.perf_counter() - t0, **res,
           **({"static_calibration": calibration} if calibration else {})}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
