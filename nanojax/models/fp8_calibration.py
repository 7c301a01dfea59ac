"""Static FP8 activation scales from a calibration pass.

A static scale is one input_scale per projection (absmax over calibration text / 448), the
scale llm-compressor's static FP8 recipe writes into a checkpoint and TensorRT-LLM's FP8
engines use. With it an FP8 projection's input is quantized by an elementwise divide
and convert that XLA fuses into the producer (RMSNorm, SiLU x up): no per-token row
absmax, which costs XLA a reduction pass of its own before the convert (the dynamic
scheme's cost on the GPU: bench/results/log/fp8.md). The price is precision: one scale
for every token, so tokens far below the calibration's absmax keep fewer of e4m3's
normal values (the CPU's quality measurement: bench/repro/fp8/weights_quality_cpu.py).

`input_absmax` runs the float model over whole sequences (packed prefills) and records each
FP8 projection's input absmax, padding excluded; `with_static_scales` writes the scales
into an FP8 bundle quantized from the same weights.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from nanojax.layers.attention.metadata import packed_prefills
from nanojax.layers.fp8 import FP8_MAX, FP8_PROJECTIONS
from nanojax.layers.linear import Linear
from nanojax.models.bundle import ModelBundle


def input_absmax(bundle: ModelBundle, sequences: list[list[int]], group: int = 8,
                 page_size: int = 16, progress: bool = False) -> dict[tuple[str, ...], float]:
    """The float model over `sequences` (token ids) -> each FP8 projection's input absmax,
    keyed by its path in the parameter tree (e.g. ("layers_0", "down_proj")). progress: a
    bar over the packed batches."""
    from tqdm.auto import tqdm
    from nanojax.engine.forward import UnrolledForward
    if bundle.config.quantization is not None:
        raise ValueError("calibrate the float model: this bundle is already quantized as "
                         f"{bundle.config.quantization}")
    if not sequences or not all(sequences):
        raise ValueError("calibration needs sequences of at least one token each")
    fwd = UnrolledForward(bundle.config)  # layers unrolled: one module path per projection
    params = fwd.prepare(bundle.params)

    @jax.jit
    def absmax(params, tokens, kv, meta, rows):
        valid = meta.slot_mapping >= 0  # packed_prefills' padding tokens write no slot
        seen: dict[tuple[str, ...], jax.Array] = {}

        def record(next_fun, args, kwargs, context):
            m = context.module
            if (isinstance(m, Linear) and context.method_name == "__call__"
                    and m.name in FP8_PROJECTIONS):
                x = jnp.abs(args[0].astype(jnp.float32))
                if x.shape[0] == valid.shape[0]:
                    x = jnp.where(valid.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0.0)
                path = tuple(m.path)
                seen[path] = jnp.maximum(seen.get(path, 0.0), jnp.max(x))
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(record):
            fwd(params, tokens, kv, meta, rows)
        return seen

    out: dict[tuple[str, ...], float] = {}
    logit_rows = np.zeros(group, np.int32)  # logits unused: a few rows, one shape
    batches = packed_prefills(sequences, [1] * len(sequences), group, page_size)
    for tokens, meta, _, pages in tqdm(batches, total=-(-len(sequences) // group),
                                       desc="calibrate", disable=not progress):
        kv = fwd.init_kv(pages, page_size)
        for path, v in jax.device_get(absmax(params, tokens, kv, meta, logit_rows)).items():
            out[path] = max(out.get(path, 0.0), float(v))
    if not out:
        raise ValueError("no FP8 projection saw an input: nothing to calibrate")
    return out


def with_static_scales(fp8_bundle: ModelBundle,
                       absmax: dict[tuple[str, ...], float]) -> ModelBundle:
    """The FP8 bundle with each projection's input_scale = its calibration absmax / 448
    and activation_scale "static". Every FP8 projection must have been calibrated."""
    cfg = fp8_bundle.config
    if cfg.quantization != "fp8":
        raise ValueError(f"static scales go on an FP8 bundle, not {cfg.quantization}")
    done = set()

    def walk(node, path):
        if not isinstance(node, dict):
            return node
        if path and path[-1] in FP8_PROJECTIONS and "weight" in node:
            if path not in absmax:
                raise ValueError(f"no calibration absmax for {'/'.join(path)}")
            done.add(path)
            scale = max(absmax[path], 1e-12) / FP8_MAX
            return {**node, "input_scale": np.asarray(scale, np.float32)}
        return {k: walk(v, path + (k,)) for k, v in node.items()}

    params = {**fp8_bundle.params, "params": walk(fp8_bundle.params["params"], ())}
    if missing := set(absmax) - done:
        raise ValueError(f"calibrated projections missing from the FP8 bundle: "
                         f"{sorted('/'.join(p) for p in missing)[:4]}")
    return dataclasses.replace(fp8_bundle, config=cfg.replace(activation_scale="static"),
                               params=params)
