"""FP8 weights and activations (--quantization fp8) on SmolLM2-135M, on the CPU: greedy
agreement and teacher-forced logits distance against the unquantized model (float32
weights, float32 KV), and with an FP8 KV cache on top (nanojax/bench/kv_quality.py).
--static also scores FP8 weights with static activation scales (one input_scale per
projection, nanojax/models/fp8_calibration.py) calibrated on the float model's greedy
continuations of CALIBRATION_PROMPTS, which the scored prompts do not include.
--block R,R scores a block-wise FP8 checkpoint (DeepSeek-V3 / Qwen3-FP8: e4m3 weights
with one scale per R x R block) as nanojax runs one: requantized per output channel at
load (quantization "fp8", checkpoints/hf_import.py) and with its blocks kept ("fp8-block",
R = 128); against quantizing the float weights per channel directly, and both formats'
weights alone (dequantized, activations in float32).

    python bench/repro/fp8/weights_quality_cpu.py OUT.json [--prompts 64] [--max-tokens 64]
        [--static] [--no-fp8-kv] [--block 128,128]
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
    ap.add_argument("--block", default=None, metavar="R,R",
                    help="also a block-wise FP8 checkpoint of R x C blocks, as loaded")
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
    if args.block:
        variants.update(block_variants(float_model, tuple(map(int, args.block.split(",")))))
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


def block_variants(float_model, block: tuple[int, int]) -> dict:
    """The variants --block scores: the float weights quantized block-wise (absmax per block
    to 448, as checkpoints store them) and then either requantized per channel (what the
    loader does for quantization "fp8": the blocks dequantized in float32, then
    quantize_weight) or kept (quantization "fp8-block", R x C = 128 x 128 only: W8A8 with
    the block scales and 128-wide activation groups, the block-scaled GEMM's function);
    and each format's weights alone, dequantized (activations unquantized)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from checkpoints.loader import quantize_bundle
    from nanojax.layers.fp8 import (FP8_PROJECTIONS, WEIGHT_BLOCK, expand_blocks,
                                    quantize_weight, quantize_weight_blocks)
    rows, cols = block
    if rows != cols:
        raise SystemExit("--block: square blocks only (R,R)")

    @jax.jit
    def block_dequantized(kernel):  # float [in, out] -> its block-FP8 values, same layout
        w8, scale = quantize_weight_blocks(kernel, rows)
        return (w8.astype(jnp.float32) * expand_blocks(scale, block, w8.shape)).T

    @jax.jit
    def channel_dequantized(kernel):
        w8, scale = quantize_weight(kernel)
        return (w8.astype(jnp.float32) * scale[:, None]).T

    def with_kernels(f):
        def one(path, leaf):
            names = [getattr(k, "key", None) for k in path]
            return np.asarray(f(leaf)) if names[-1] == "kernel" and names[-2] in \
                FP8_PROJECTIONS else leaf
        return dataclasses.replace(float_model, params=jax.tree_util.tree_map_with_path(
            one, float_model.params))

    blocks = with_kernels(block_dequantized)
    name = f"fp8 block {rows}x{cols}"
    out = {f"{name}, requantized per channel (as loaded)": (quantize_bundle(blocks, "fp8"),
                                                            "auto")}
    if rows == WEIGHT_BLOCK:
        out[f"{name} kept (fp8-block: W8A8 with 1x{cols} activation groups)"] = (
            quantize_bundle(float_model, "fp8-block"), "auto")
    out[f"{name} weights alone (dequantized)"] = (blocks, "auto")
    out["fp8 per-channel weights alone (dequantized)"] = (with_kernels(channel_dequantized),
                                                         "auto")
    return out


if __name__ == "__main__":
    sys.exit(main())
