"""A loaded model, the engine's input: config, parameter tree and tokenizer. Loaders
(checkpoints/, found through nanojax/plugins.py) make it; what the engine does with it
once loaded (quantize_bundle, cpu_params) is here."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from nanojax.config import ModelConfig
from nanojax.errors import CheckpointError
from nanojax.tokenizer import Tokenizer


@dataclasses.dataclass
class ModelBundle:
    config: ModelConfig
    params: dict            # {"params": {...}} as LlamaForCausalLM expects
    tokenizer: Tokenizer | None
    # the GGUF file the weights were imported from, and the loader's reader of its
    # quantized blocks (gguf, config) -> layers/quant.py's `quant` tree: a CPU engine may
    # run those blocks (cpu_params)
    gguf: Path | None = None
    read_gguf_blocks: Callable[[Path, ModelConfig], dict] | None = None
    # the checkpoint's recommended sampling (its generation_config.json: temperature,
    # top_p, top_k, min_p, repetition_penalty), for requests that leave them unset
    sampling_defaults: dict = dataclasses.field(default_factory=dict)


def default_dtype() -> str:
    import jax
    return "bfloat16" if jax.default_backend() == "gpu" else "float32"


def quantize_bundle(bundle: ModelBundle, quantization: str | None) -> ModelBundle:
    """The bundle with its dense projections in `quantization` (None: as loaded). Each
    weight is quantized on its own (a jitted call per array, on the device it is on or
    the default one for host arrays, returned to the host), so no second copy of the
    whole model exists at once."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from nanojax.layers.fp8 import (FP8_PROJECTIONS, is_expert_stack, quantize_experts,
                                    quantize_params)
    cfg = bundle.config
    if quantization is None or cfg.quantization == quantization:
        return bundle
    if cfg.quantization is not None:
        raise CheckpointError(f"the checkpoint is quantized as {cfg.quantization}; it "
                              f"cannot be re-quantized as {quantization}")
    new_cfg = cfg.replace(quantization=quantization)  # validates
    blocks = quantization == "fp8-block"
    one = jax.jit(lambda node: quantize_params({"q_proj": node}, blocks=blocks)["q_proj"])
    experts = jax.jit(quantize_experts)  # an MoE block's stacked expert weights

    # (path, are its weights and scales finite?): an inf weight gives an inf scale, a NaN
    # one a NaN code (XLA's max may drop NaNs)
    check = jax.jit(lambda q: jnp.isfinite(q["weight_scale"]).all()
                    & jnp.isfinite(q["weight"].astype(jnp.float32)).all())
    finite = []

    def walk(node, path=()):
        if not isinstance(node, dict):
            return node
        out = {}
        for k, v in node.items():
            if isinstance(v, dict) and "kernel" in v and k in FP8_PROJECTIONS:
                q, on_host = one(v), isinstance(v["kernel"], np.ndarray)
            elif is_expert_stack(k, v):
                q, on_host = experts(v), isinstance(v, np.ndarray)
            else:
                out[k] = walk(v, (*path, k))
                continue
            finite.append(("/".join((*path, k)), check(q)))
            out[k] = jax.tree_util.tree_map(np.asarray, q) if on_host else q
        return out
    params = walk(bundle.params)
    bad = [name for name, ok in zip([n for n, _ in finite],
                                    jax.device_get([ok for _, ok in finite])) if not ok]
    if bad:  # (checked once at the end: no wait on the device per weight)
        raise CheckpointError(f"cannot quantize {bad[0]} to {quantization}: its weights hold "
                              f"inf or NaN ({len(bad)} projection(s) do)")
    return dataclasses.replace(bundle, config=new_cfg, params=params)


def cpu_params(bundle: ModelBundle, kernels, on_gpu: bool, tensor_parallel_size: int = 1):
    """The parameters a CPU engine runs: with KernelConfig.cpu_weights "q4" and a float32
    model imported from a GGUF file, its Q4_1 / Q8_0 blocks are added as the `quant`
    collection (nanojax/layers/quant.py) beside the f32 tree; otherwise bundle.params."""
    cfg = bundle.config
    if (on_gpu or kernels.cpu_weights != "q4" or bundle.gguf is None
            or bundle.read_gguf_blocks is None or cfg.is_moe
            or cfg.quantization is not None
            or tensor_parallel_size != 1 or cfg.dtype != "float32"
            or not Path(bundle.gguf).is_file()):
        return bundle.params
    quant = bundle.read_gguf_blocks(Path(bundle.gguf), cfg)
    return {**bundle.params, "quant": quant} if quant else bundle.params
