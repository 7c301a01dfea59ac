"""The HF-name -> parameter-tree mapping and the tree checks the importers share. The
loaded model they make, ModelBundle, is the engine's type: nanojax/models/bundle.py."""
from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np

from nanojax.config import ModelConfig
from nanojax.errors import CheckpointError


# Our tree path -> HF tensor name. Torch Linear weights are [out, in]; we store [in, out].
# An MoE layer's stacked expert weights [E, in, out] come from E per-expert tensors.
def hf_tensor_names(cfg: ModelConfig) -> dict[tuple, tuple[str | tuple[str, ...], bool]]:
    """Maps each parameter path to (HF name, or the names stacked on a new first axis;
    transpose each?)."""
    names: dict[tuple, tuple[str, bool]] = {
        ("embed", "embedding"): ("model.embed_tokens.weight", False),
        ("norm", "scale"): ("model.norm.weight", False),
    }
    if not cfg.tie_word_embeddings:
        names[("lm_head", "kernel")] = ("lm_head.weight", True)
    for i in range(cfg.num_layers):
        p, h = f"layers_{i}", f"model.layers.{i}."
        names[(p, "input_norm", "scale")] = (h + "input_layernorm.weight", False)
        names[(p, "post_attention_norm", "scale")] = (h + "post_attention_layernorm.weight", False)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.update(_projection_names(cfg, (p, proj), h + f"self_attn.{proj}."))
        if cfg.attention_bias:
            for proj in ("q_proj", "k_proj", "v_proj"):
                names[(p, proj, "bias")] = (h + f"self_attn.{proj}.bias", False)
        if cfg.qk_norm:
            for norm in ("q_norm", "k_norm"):
                names[(p, norm, "scale")] = (h + f"self_attn.{norm}.weight", False)
        if cfg.is_moe:
            names.update(_moe_tensor_names(cfg, p, h))
            continue
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.update(_projection_names(cfg, (p, proj), h + f"mlp.{proj}."))
    return names


def _projection_names(cfg: ModelConfig, path: tuple, hf_prefix: str) -> dict:
    """A dense projection's tensors: the float kernel (stored transposed), or an FP8
    checkpoint's weight [out, in] with its scales (as stored)."""
    if cfg.quantization not in ("fp8", "fp8-block"):
        return {(*path, "kernel"): (hf_prefix + "weight", True)}
    names = {(*path, leaf): (hf_prefix + leaf, False) for leaf in ("weight", "weight_scale")}
    if cfg.activation_scale == "static":
        names[(*path, "input_scale")] = (hf_prefix + "input_scale", False)
    return names


def _moe_tensor_names(cfg: ModelConfig, p: str, h: str) -> dict:
    """Mixtral: block_sparse_moe.{gate, experts.E.w1/w3/w2}; Qwen2-MoE: mlp.{gate,
    experts.E.gate_proj/up_proj/down_proj, shared_expert.*, shared_expert_gate}; Qwen3-MoE:
    Qwen2-MoE's names without the shared expert. An FP8 checkpoint stores each expert's
    weight [out, in] and weight_scale; the router and the shared expert's gate stay float."""
    mixtral = cfg.architecture == "mixtral"
    block = h + ("block_sparse_moe." if mixtral else "mlp.")
    ours = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if mixtral else \
        {n: n for n in ("gate_proj", "up_proj", "down_proj")}
    names: dict = {(p, "moe", "router", "kernel"): (block + "gate.weight", True)}
    for proj, theirs in ours.items():
        experts = [f"{block}experts.{e}.{theirs}." for e in range(cfg.num_experts)]
        if cfg.quantization == "fp8":
            for leaf in ("weight", "weight_scale"):
                names[(p, "moe", proj, leaf)] = (tuple(e + leaf for e in experts), False)
        else:
            names[(p, "moe", proj)] = (tuple(e + "weight" for e in experts), True)
    if cfg.shared_expert_intermediate_size:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.update(_projection_names(cfg, (p, "moe", f"shared_{proj}"),
                                           f"{block}shared_expert.{proj}."))
        names[(p, "moe", "shared_expert_gate", "kernel")] = (
            block + "shared_expert_gate.weight", True)
    return names


def assemble_params(cfg: ModelConfig, get: Callable[[str], np.ndarray], progress=None) -> dict:
    """Builds the parameter tree from HF-named tensors, checking every shape."""
    from nanojax.models import param_shapes

    expected = param_shapes(cfg)["params"]
    tree: dict = {}
    for path, (name, transpose) in hf_tensor_names(cfg).items():
        parts = [np.asarray(get(n)) for n in ((name,) if isinstance(name, str) else name)]
        if path[-1] != "weight" and any("float8" in str(a.dtype) for a in parts):
            first = name if isinstance(name, str) else name[0]
            raise CheckpointError(f"tensor {first} is stored in FP8, but nanojax keeps "
                                  f"{'/'.join(path)} in the model dtype (FP8 checkpoints "
                                  "quantize the decoder's projections only)")
        if transpose:
            parts = [a.T for a in parts]
        arr = parts[0] if isinstance(name, str) else np.stack(parts)
        name = name if isinstance(name, str) else f"{name[0]} (and the other experts)"
        want = expected
        for key in path:
            want = want[key]
        if path[-1] in ("weight", "weight_scale", "input_scale"):  # an FP8 checkpoint's
            arr = check_fp8_tensor(arr, path[-1], name)
        if path[-1] in ("weight_scale", "input_scale"):
            arr = _fit_scale(arr, tuple(want.shape), name)
        if tuple(arr.shape) != tuple(want.shape):
            raise CheckpointError(f"tensor {name} has shape {tuple(arr.shape)} but the config "
                                  f"needs {tuple(want.shape)} for {'/'.join(path)}")
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = arr.astype(want.dtype, order="C")  # (ascontiguousarray: 0-d -> 1-d)
        if progress is not None:
            progress.update(1)
    return {"params": tree}


def param_dtypes(cfg: ModelConfig) -> dict:
    """The dtype each parameter has under cfg (the model dtype, or FP8 weights and f32
    scales for a quantized config), as a tree like the parameters."""
    from nanojax.models import param_shapes
    return jax.tree_util.tree_map(lambda s: s.dtype, param_shapes(cfg))


def cast_tree(cfg: ModelConfig, params: dict) -> dict:
    """Host arrays cast leaf by leaf to the dtypes cfg gives them (FP8 weights stay FP8
    when the model dtype changes)."""
    return jax.tree_util.tree_map(lambda a, dt: np.asarray(a).astype(dt), params,
                                  param_dtypes(cfg))


def check_fp8_tensor(arr: np.ndarray, leaf: str, name: str) -> np.ndarray:
    """An FP8 checkpoint's tensor as stored, checked: a `weight` must be e4m3 (a float
    type only where e4m3 holds each value exactly) with no NaN codes, a scale a finite
    positive float whose 448-fold is finite too. Otherwise the model would load and
    compute NaN logits, or a projection silently zeroed or sign-flipped. Returns the
    weight as float8_e4m3fn, a scale as float32."""
    import ml_dtypes
    floats = (np.dtype(ml_dtypes.bfloat16),)  # (ml_dtypes' kind is "V", not "f")
    is_float = arr.dtype.kind == "f" or arr.dtype in floats
    if leaf == "weight":
        if arr.dtype != ml_dtypes.float8_e4m3fn:
            as_fp8 = arr.astype(ml_dtypes.float8_e4m3fn) if is_float else None
            if as_fp8 is None or not np.array_equal(as_fp8.astype(np.float32),
                                                    arr.astype(np.float32)):  # (NaN != NaN)
                raise CheckpointError(
                    f"tensor {name} is stored as {arr.dtype} with values e4m3 cannot hold "
                    "exactly: an FP8 checkpoint's weights are float8_e4m3fn (F8_E5M2 and "
                    "integer formats are not supported), and nanojax quantizes every decoder "
                    "projection or none (an ignore list may not leave some unquantized)")
            arr = as_fp8
        magnitude = np.bitwise_and(arr.view(np.uint8), 0x7F)
        if arr.size and magnitude.max() == 0x7F:  # e4m3fn's NaN codes (one pass if none)
            nan = np.flatnonzero(magnitude == 0x7F)
            raise CheckpointError(f"tensor {name} holds {nan.size} NaN value(s) (the first at "
                                  f"flat index {int(nan[0])})")
        return arr
    if not is_float:
        raise CheckpointError(f"scale {name} is stored as {arr.dtype}, not a float type")
    arr = np.asarray(arr, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        bad = np.flatnonzero(~(np.isfinite(arr * np.float32(448.0)) & (arr > 0)))
    if bad.size:
        raise CheckpointError(
            f"scale {name} holds {bad.size} value(s) that are not finite and positive (the "
            f"first, at flat index {int(bad[0])}: {float(arr.flat[bad[0]])}); an FP8 scale "
            "multiplies a channel back, or divides the activations, and must be > 0 with "
            "448 x scale a finite float32")
    return arr


def _fit_scale(arr: np.ndarray, shape: tuple, name: str) -> np.ndarray:
    """An FP8 scale as the model keeps it: per channel [out] ([out, 1] in
    compressed-tensors), a per-tensor scale ([] or [1]) broadcast to every channel; for
    stacked experts [E, out], each expert's scales stacked the same way. Other layouts
    (block scales under a per-channel config: [rows, cols] with rows x cols channels'
    worth of values) are refused, not reshaped."""
    arr = np.asarray(arr, np.float32)
    def squeezed(dims):
        return tuple(d for d in dims if d != 1)
    if arr.size == 1:
        return np.broadcast_to(arr.reshape(()), shape)
    if squeezed(arr.shape) == squeezed(shape):
        return arr.reshape(shape)
    if len(shape) == 2 and squeezed(arr.shape) == (shape[0],):  # per tensor, per expert
        return np.broadcast_to(arr.reshape(shape[0], 1), shape)
    per = "one per tensor" if name.endswith("input_scale") else \
        f"{shape} (per channel) or one per tensor"
    raise CheckpointError(f"scale {name} has shape {tuple(arr.shape)}; the model needs {per}")


def check_fp8_values(cfg: ModelConfig, params: dict) -> None:
    """check_fp8_tensor on every FP8 weight and scale of a loaded tree (a nanojax
    checkpoint's: the HF importers check theirs tensor by tensor). Arrays restored onto
    devices (tensor-parallel shards) are counted where they lie, in one program and one
    fetch; only one that holds a bad value comes to the host, for the message."""
    if cfg.quantization is None:
        return
    leaves = [(jax.tree_util.keystr(path), path[-1].key, leaf)
              for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
              if getattr(path[-1], "key", None) in ("weight", "weight_scale", "input_scale")]
    on_device = [(name, key, leaf) for name, key, leaf in leaves
                 if isinstance(leaf, jax.Array) and (
                     leaf.dtype == jax.numpy.float8_e4m3fn if key == "weight"
                     else jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating))]
    counts = jax.device_get(_bad_value_counts(
        [leaf for _, _, leaf in on_device],
        tuple(key == "weight" for _, key, _ in on_device))) if on_device else []
    clean = {name for (name, _, _), n in zip(on_device, counts) if n == 0}
    for name, key, leaf in leaves:
        if name not in clean:
            check_fp8_tensor(np.asarray(leaf), key, name)


@functools.partial(jax.jit, static_argnums=1)
def _bad_value_counts(arrays: list, is_weight: tuple[bool, ...]) -> list:
    """Per array, the values check_fp8_tensor refuses: e4m3 NaN codes in a weight, scales
    not finite and positive (or whose 448 x is not finite)."""
    import jax.numpy as jnp
    out = []
    for x, weight in zip(arrays, is_weight):
        if weight:
            bad = (jax.lax.bitcast_convert_type(x, jnp.uint8) & 0x7F) == 0x7F
        else:
            s = x.astype(jnp.float32)
            bad = ~(jnp.isfinite(s * 448.0) & (s > 0))
        out.append(jnp.sum(bad, dtype=jnp.int32))
    return out


def check_tree(cfg: ModelConfig, params: dict) -> None:
    """Raises CheckpointError unless params has exactly the config's shapes."""
    from nanojax.models import param_shapes
    want = jax.tree_util.tree_flatten_with_path(param_shapes(cfg))[0]
    got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    for path, spec in want:
        key = jax.tree_util.keystr(path)
        if path not in got:
            raise CheckpointError(f"checkpoint lacks parameter {key}")
        if tuple(got[path].shape) != tuple(spec.shape):
            raise CheckpointError(f"parameter {key} has shape {tuple(got[path].shape)}, "
                                  f"config needs {tuple(spec.shape)}")
    if len(got) != len(want):
        raise CheckpointError(f"checkpoint has {len(got) - len(want)} parameters the config "
                              "does not describe")
