"""Where FP8 W8A8's quality loss on SmolLM2-135M comes from, on the CPU: teacher-forced
top-1 agreement, KL and greedy agreement against the float32 model (float32 weights, KV
and activations), by nanojax/bench/kv_quality.py's measure_variants, of:

- yardstick: the model in bfloat16 (weights and activations), what any 16-bit deployment
  already loses against float32;
- the headline: every projection FP8 as the engine runs it (quantize_bundle, real e4m3
  weights and per-token e4m3 activations), and the same by fake quantization (below);
- the noise floor: the engine's FP8 model with its embeddings perturbed by 1e-6 relative
  (no float32 logit moves measurably; FP8's rounding decisions flip and cascade, so this
  is how far two equally good FP8 runs land apart);
- FP8 on subsets: attention only (q/k/v/o), MLP only (gate/up/down), all but down_proj,
  down_proj only, all but the first and last layer;
- weights only (e4m3 per output channel, dequantized; float32 activations) and
  activations only (per-token e4m3, float32 weights);
- per-tensor weight scales against per-channel: one scale per projection, and one per
  fused module as vLLM keeps them (q/k/v share one, gate/up one); weights only per tensor;
  and vLLM's on-the-fly `--quantization fp8` default (per-tensor weights per fused module,
  per-tensor dynamic activation scale: one absmax over the step's whole input);
- finer than per channel / per token: vLLM's `fp8_per_block` scheme (DeepSeek-V3's FP8
  layout: a scale per 128 x 128 weight tile and per token and 128 inputs; SmolLM2's
  hidden size 576 is no multiple of 128, so here each row's last group is 64 wide).

    python bench/repro/fp8/quality_sensitivity_cpu.py OUT.json [--prompts 32] [--max-tokens 32]

Fake quantization: a variant is the float32 model with selected projections' kernels
rounded through e4m3 and back (nanojax/layers/fp8.py's quantize_weight: the values the
engine's FP8 weights hold) and, for activations, a leaf `fq_act` added to a projection's
parameters (stacked per layer like the rest: 0 float, 1 per token, 2 per tensor, 3 per
1 x 128 group) that a wrapper of Linear.__call__, installed by this script only, reads to
round the projection's input through e4m3 (quantize_activation's rule) before the float32
GEMM. "fp8 all (fake)" against "fp8 all (engine)" checks that the two agree: the same
weights bit for bit and each projection's output to float32 rounding, so the model-level
difference is the noise floor's (rounding decisions that flip and cascade).

All bundles run without the GGUF's Q4 blocks (bundle.gguf None: the CPU engine would read
them for 1-row steps, and a modified float tree has none; with every prompt in one batch
no step has 1 row anyway). Variants are measured in groups (memory: each holds its own
float tree and the scorer's stacked copy), each group against the same float32 baseline
(greedy float32 generation is deterministic: every group scores the same sequences); each
group's results are kept in OUT.partial, and rerunning the command resumes from there.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import json
import platform
import shlex
import sys
import time
from pathlib import Path

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL = ATTN + MLP
FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
         "up_proj": "gate_up", "o_proj": "o", "down_proj": "down"}  # vLLM's fused modules

BLOCK = 128  # vLLM's fp8_per_block: 128 x 128 weight tiles, 1 x 128 activation groups
A_MODES = {"token": 1, "tensor": 2, "group": 3}  # the fq_act leaf's values (0: float)

# name -> spec: w / a: the projections whose weights / inputs are rounded through e4m3;
# w_scale: "channel" | "tensor" | "fused-tensor" | "block"; a_scale: "token" | "tensor" |
# "group" (1 x BLOCK);
# skip_ends: the first and last layer stay float32
SPECS = {
    "fp8 all (fake)": dict(w=ALL, a=ALL),
    "fp8 attention only (q/k/v/o)": dict(w=ATTN, a=ATTN),
    "fp8 MLP only (gate/up/down)": dict(w=MLP, a=MLP),
    "fp8 all but down_proj": dict(w=ALL[:-1], a=ALL[:-1]),
    "fp8 down_proj only": dict(w=("down_proj",), a=("down_proj",)),
    "fp8 all but first and last layer": dict(w=ALL, a=ALL, skip_ends=True),
    "fp8 weights only (per-channel)": dict(w=ALL, a=()),
    "fp8 activations only (per-token)": dict(w=(), a=ALL),
    "fp8 all, per-tensor weight scales": dict(w=ALL, a=ALL, w_scale="tensor"),
    "fp8 all, per-tensor weight scales fused (qkv, gate_up)": dict(
        w=ALL, a=ALL, w_scale="fused-tensor"),
    "fp8 weights only (per-tensor)": dict(w=ALL, a=(), w_scale="tensor"),
    "vLLM on-the-fly default: per-tensor weights (fused) + per-tensor dynamic activations":
        dict(w=ALL, a=ALL, w_scale="fused-tensor", a_scale="tensor"),
    "fp8 per-block (vLLM fp8_per_block: 128x128 weight tiles, 1x128 activation groups)":
        dict(w=ALL, a=ALL, w_scale="block", a_scale="group"),
}


def install_activation_fake_quant():
    """Linear.__call__ wrapped: a float projection whose parameters hold `fq_act` gets its
    input rounded through e4m3 first (1: per-token scale, 2: one scale for the whole
    input, 3: one per token and group of BLOCK inputs; 0: as is). The script's own
    patch: nanojax/ is unchanged."""
    import jax.numpy as jnp

    from nanojax.layers import linear
    from nanojax.layers.fp8 import FP8_MAX, quantize_activation

    orig = linear.Linear.__call__

    def call(self, x):
        if self.quantization is None and self.has_variable("params", "fq_act"):
            mode = self.get_variable("params", "fq_act")
            xf = x.astype(jnp.float32)
            x8, sx = quantize_activation(xf)                        # per token
            per_token = x8.astype(jnp.float32) * sx
            st = jnp.maximum(jnp.max(jnp.abs(xf)), 1e-12) / FP8_MAX  # per tensor
            per_tensor = quantize_activation(xf, st)[0].astype(jnp.float32) * st
            t, k = xf.shape                                         # per 1 x BLOCK group
            xg = jnp.pad(xf, ((0, 0), (0, -k % BLOCK))).reshape(t, -1, BLOCK)
            sg = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1, keepdims=True), 1e-12) / FP8_MAX
            per_group = (quantize_activation(xg, sg)[0].astype(jnp.float32) * sg).reshape(
                t, -1)[:, :k]
            xq = jnp.select([mode == 1, mode == 2, mode == 3],
                            [per_token, per_tensor, per_group], xf)
            x = xq.astype(x.dtype)
        return orig(self, x)

    linear.Linear.__call__ = call


def fake_weight(kernel, scale_mode: str, tensor_amax=None):
    """kernel [in, out] f32 -> the same shape rounded through e4m3: per output channel
    (quantize_weight, as the engine quantizes), per BLOCK x BLOCK tile, or with one scale
    (absmax / 448 of this kernel, or tensor_amax: a fused module's)."""
    import jax.numpy as jnp
    import numpy as np

    from nanojax.layers.fp8 import FP8_MAX, to_fp8, quantize_weight
    if scale_mode == "channel":
        w8, scale = quantize_weight(kernel)
        return np.asarray((w8.astype(jnp.float32) * scale[:, None]).T)
    if scale_mode == "block":  # one scale per BLOCK x BLOCK tile (a last one may be cut)
        k, n = kernel.shape
        pad = np.pad(np.asarray(kernel, np.float32), ((0, -k % BLOCK), (0, -n % BLOCK)))
        tiles = pad.reshape(pad.shape[0] // BLOCK, BLOCK, pad.shape[1] // BLOCK, BLOCK)
        scale = np.maximum(np.abs(tiles).max(axis=(1, 3), keepdims=True), 1e-12) / FP8_MAX
        back = np.asarray(to_fp8(jnp.asarray(tiles / scale)).astype(jnp.float32)) * scale
        return back.reshape(pad.shape)[:k, :n].astype(np.float32)
    amax = float(np.abs(kernel).max()) if tensor_amax is None else tensor_amax
    scale = max(amax, 1e-12) / FP8_MAX
    return np.asarray(to_fp8(jnp.asarray(kernel, jnp.float32) / scale).astype(jnp.float32)
                      * scale)


def fake_bundle(float_model, w=(), a=(), w_scale="channel", a_scale="token",
                skip_ends=False):
    import numpy as np
    n = float_model.config.num_layers
    params = dict(float_model.params["params"])
    for i in range(n):
        quantized = not (skip_ends and i in (0, n - 1))
        layer = dict(params[f"layers_{i}"])
        fused_amax: dict = {}
        for name in ALL:
            k = np.asarray(layer[name]["kernel"])
            fused_amax[FUSED[name]] = max(fused_amax.get(FUSED[name], 0.0),
                                          float(np.abs(k).max()))
        for name in ALL:
            node = dict(layer[name])
            if quantized and name in w:
                node["kernel"] = fake_weight(
                    np.asarray(node["kernel"]), "tensor" if w_scale == "fused-tensor"
                    else w_scale, fused_amax[FUSED[name]] if w_scale == "fused-tensor"
                    else None)
            if a:  # every projection gets the leaf (the scan stacks equal trees)
                on = quantized and name in a
                node["fq_act"] = np.float32(A_MODES[a_scale] if on else 0)
            layer[name] = node
        params[f"layers_{i}"] = layer
    return dataclasses.replace(float_model, params={**float_model.params, "params": params})


def perturbed(bundle, eps: float = 1e-6):
    """The bundle with its embedding table times (1 + eps N(0, 1)): a float32-rounding-
    sized change that moves no float32 logit measurably, to show how far one FP8 run's
    rounding decisions alone scatter the metrics (the noise floor of a comparison)."""
    import numpy as np
    p = dict(bundle.params["params"])
    emb = np.asarray(p["embed"]["embedding"])
    noise = np.random.default_rng(0).standard_normal(emb.shape)
    p["embed"] = {**p["embed"], "embedding": (emb * (1 + eps * noise)).astype(emb.dtype)}
    return dataclasses.replace(bundle, params={**bundle.params, "params": p})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--group", type=int, default=4, help="variants measured per call")
    ap.add_argument("--only", default="", help="variant names separated by ; (a probe)")
    args = ap.parse_args()
    import jax

    from checkpoints.loader import load_model, quantize_bundle
    from nanojax.bench.kv_quality import QUALITY_PROMPTS, measure_variants
    install_activation_fake_quant()
    t0 = time.perf_counter()
    log = lambda m: print(f"[{time.perf_counter() - t0:7.1f}s] {m}", file=sys.stderr,  # noqa
                          flush=True)
    float_model = dataclasses.replace(load_model("smollm2-135m", dtype="float32"), gguf=None,
                                      read_gguf_blocks=None)
    makers = {
        "bf16 model (weights + activations)": lambda: dataclasses.replace(
            load_model("smollm2-135m", dtype="bfloat16"), gguf=None, read_gguf_blocks=None),
        "fp8 all (engine: quantize_bundle)": lambda: quantize_bundle(float_model, "fp8"),
        "fp8 all (engine), embeddings x (1 + 1e-6 N(0,1))": lambda: quantize_bundle(
            perturbed(float_model), "fp8"),
        **{name: (lambda s=spec: fake_bundle(float_model, **s)) for name, spec in SPECS.items()},
    }
    if args.only:
        makers = {k: makers[k] for k in args.only.split(";")}
    names = list(makers)
    # each group's results go to OUT.partial as it ends; a rerun of the same command
    # (after a kill: the whole run holds ~1.6 GB per variant of a group) resumes there
    partial = Path(args.out + ".partial")
    state = {"compared": {}, "groups": [], "runs": []}
    if partial.is_file():
        state = json.loads(partial.read_text())
        log(f"resuming from {partial}: {list(state['compared'])} done")
    state["runs"].append({"command": "python " + shlex.join(sys.argv), "wall_s": 0.0})
    todo = [n for n in names if n not in state["compared"]]
    for g in range(0, len(todo), args.group):
        chunk = todo[g:g + args.group]
        log(f"group {len(state['groups']) + 1}: {chunk}")
        variants = {"float32": (float_model, "auto"),
                    **{name: (makers[name](), "auto") for name in chunk}}
        res = measure_variants(variants, "float32", QUALITY_PROMPTS[:args.prompts],
                               args.max_tokens, log=log)
        del variants
        gc.collect()
        jax.clear_caches()
        with contextlib.suppress(OSError, AttributeError):  # hand freed heap back (glibc)
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        state["compared"].update(res.pop("compared"))
        state["groups"].append({"variants": chunk, **res})
        state["runs"][-1]["wall_s"] = time.perf_counter() - t0
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(state, indent=1))
        log("group done: " + ", ".join(
            f"{k} top1 {state['compared'][k]['top1_agreement']:.4f}" for k in chunk))
    compared, groups = {k: state["compared"][k] for k in names}, state["groups"]
    summary = {k: {"top1_agreement": v["top1_agreement"], "mean_kl": v["mean_kl"],
                   "tokens_before_first_divergence": v["tokens_before_first_divergence"]}
               for k, v in compared.items()}
    state["runs"][-1]["wall_s"] = time.perf_counter() - t0
    res = {"command": "python " + shlex.join(sys.argv), "model": "smollm2-135m",
           "note": (f"{args.prompts} prompts x {args.max_tokens} greedy tokens (the headline "
                    "fp8_weights_quality_cpu.json used 64 x 64: its 'all projections FP8' "
                    "row is rerun here at this size as 'fp8 all (engine: quantize_bundle)'); "
                    "baseline the float32 model (weights, activations, KV); every variant "
                    "keeps a float32 KV cache except the bf16 model's (bf16). 'fake' "
                    "variants: the float32 model with e4m3-rounded kernels / projection "
                    "inputs (this script's docstring). The float32 weights are the embedded "
                    "GGUF's (SmolLM2-135M-Instruct Q4_1) dequantized."),
           "env": {"jax": jax.__version__, "backend": jax.default_backend(),
                   "python": platform.python_version()},
           "wall_s": sum(r["wall_s"] for r in state["runs"]), "runs": state["runs"],
           "baseline": "float32",
           "prompts": args.prompts, "max_tokens": args.max_tokens,
           "specs": {k: {"w": list(s["w"]), "a": list(s["a"]),
                         "w_scale": s.get("w_scale", "channel"),
                         "a_scale": s.get("a_scale", "token"),
                         "skip_first_last_layer": s.get("skip_ends", False)}
                     for k, s in SPECS.items() if k in compared},
           "summary": summary, "groups": groups, "compared": compared}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    partial.unlink(missing_ok=True)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
